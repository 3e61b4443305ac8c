"""Probe (issue 44): where a batch-1 decode step's 1.9 ms goes on the GPU (the floor is 0.87 ms).

Builds the generation benchmark's 1.5B Llama-style model (fp16), compiles kiln's prefill and decode
programs as ``benchmarks/generation.py`` does (``aot: false``: same Inductor kernels, faster compile), then
profiles decode steps two ways: plain calls (graphs off: every kernel named, with its GPU time) and
captured-graph replays (the step time that counts). Writes the kernel table, kernels per step, the decode
graph's op counts and partition layout to OUT.json.

    python3 benchmarks/probes/probe_decode_profile.py OUT.json [--layers 16]

``--compile-options JSON`` compiles with that Inductor config (mode max-autotune-no-cudagraphs), to set
variants side by side: probe_decode_pdl_{off,on}.h100.json are ``{}`` and ``{"triton.enable_pdl": true}``,
decode only, graphed only, on one warm H100.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import compiler  # noqa: E402
from benchmarks.generation import build_model  # noqa: E402
from benchmarks.machine import gpu_machine  # noqa: E402
from compiler.generation.decoding import StaticDecode  # noqa: E402
from compiler.generation.spec import program_options  # noqa: E402
from compiler.generation.step import generation_spec, program_case  # noqa: E402


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def kernel_table(prof: torch.profiler.profile, steps: int) -> list[dict]:
    rows = []
    for event in prof.key_averages():
        cuda_us = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if not torch.cuda.is_available():  # the smoke run: CPU ops stand in for kernels
            cuda_us = event.self_cpu_time_total
        elif event.device_type != torch.autograd.DeviceType.CUDA or not cuda_us:
            continue
        if cuda_us:
            rows.append(
                {
                    "kernel": event.key[:160],
                    "count_per_step": event.count / steps,
                    "us_per_step": cuda_us / steps,
                }
            )
    rows.sort(key=lambda r: -r["us_per_step"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--aot", action="store_true")
    parser.add_argument("--decode-only", action="store_true", help="compile and profile decode alone")
    parser.add_argument("--smoke", action="store_true", help="tiny model on the CPU: tests the probe")
    parser.add_argument("--compile-options", default="{}", help="Inductor config for the programs (JSON)")
    parser.add_argument("--graphed-only", action="store_true", help="skip the plain-call profile")
    args = parser.parse_args()
    compile_options = json.loads(args.compile_options)
    result: dict = {
        "machine": {} if args.smoke else gpu_machine(),
        "layers": args.layers,
        "compile_options": compile_options,
    }
    dev = "cpu" if args.smoke else "cuda"
    activity = torch.profiler.ProfilerActivity.CPU if args.smoke else torch.profiler.ProfilerActivity.CUDA
    lm = build_model(args.smoke, torch.float32 if args.smoke else torch.float16, dev, layers=args.layers)
    spec = generation_spec(lm, max_batch=8, max_cache_len=1024, prompt_min=1, prompt_max=512)
    backend_options = {} if args.aot else {"aot": False}
    if compile_options:
        backend_options.update(mode="max-autotune-no-cudagraphs", compile_options=compile_options)
    programs, start = {}, time.perf_counter()
    for name in ("decode",) if args.decode_only else ("prefill", "decode"):
        wrapper, kwargs, shapes = program_case(lm, spec, name)
        with torch.no_grad():  # as kiln zoo exports generation programs
            exported = compiler.export(wrapper, (), kwargs, dynamic_shapes=shapes)
        if name == "decode":
            ops = (
                collections.Counter(
                    str(n.target) for n in exported.graph_module.graph.nodes if n.op == "call_function"
                )
                if hasattr(exported, "graph_module")
                else {}
            )
            result["decode_export_ops"] = dict(ops.most_common(40))
        programs[name] = compiler.compile(
            exported,
            backend="inductor",
            strip_weights=True,
            device=dev,
            precision="fp32" if args.smoke else "fp16",
            **program_options(name, "inductor", dev, {"backend_options": backend_options}),
        )
    result["compile_s"] = time.perf_counter() - start
    plan = programs["decode"].plan
    result["decode_partitions"] = [
        {"nodes": len(getattr(p, "nodes", []) or []), "repr": repr(p)[:300]} for p in plan.partitions
    ]
    result["decode_fallback_ops"] = dict(plan.fallback_ops)
    steps = 64
    token = torch.tensor([5], device=dev)
    # Graph replays (a whole step captured, as generate runs it): the step time and the kernels in it.
    static = StaticDecode(programs["decode"], spec, torch.device(dev))
    result["graphed"], result["reason"] = static.graphed, static.reason
    bucket = static._bucket(1)  # captures where graphed
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        static.step(bucket, token)
        sync(dev)
        times.append(time.perf_counter() - begin)
    result["graphed_step_wall_ms"] = statistics.median(times) * 1e3
    if dev == "cuda":
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_event.record()
        for _ in range(steps):
            static.step(bucket, token)
        end_event.record()
        sync(dev)
        result["graphed_step_device_ms"] = start_event.elapsed_time(end_event) / steps
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(steps):
            static.step(bucket, token)
        sync(dev)
    result["graphed_kernels"] = kernel_table(prof, steps)[:60]
    result["graphed_kernels_per_step"] = sum(r["count_per_step"] for r in result["graphed_kernels"])

    if args.graphed_only:
        Path(args.out).write_text(json.dumps(result, indent=1))
        shown = {k: v for k, v in result.items() if "kernels" not in k or "per_step" in k}
        print(json.dumps(shown, indent=1))
        return
    # Plain calls on a fresh static cache (graphs off): each kernel with its time.
    plain = StaticDecode(programs["decode"], spec, torch.device(dev))
    plain.graphed = plain.pad_to_buckets = False
    bucket = plain._bucket(1)
    for _ in range(5):
        plain.step(bucket, token)
    sync(dev)
    begin = time.perf_counter()
    for _ in range(steps):
        plain.step(bucket, token)
    sync(dev)
    result["plain_step_wall_ms"] = (time.perf_counter() - begin) / steps * 1e3
    with torch.profiler.profile(activities=[activity]) as prof:
        for _ in range(steps):
            plain.step(bucket, token)
        sync(dev)
    table = kernel_table(prof, steps)
    result["plain_kernels"] = table[:80]
    result["plain_kernels_per_step"] = sum(r["count_per_step"] for r in table)
    result["plain_kernel_us_per_step"] = sum(r["us_per_step"] for r in table)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if "kernels" not in k or "per_step" in k}, indent=1))
    print("plain top kernels:")
    for row in table[:40]:
        print(f"{row['us_per_step']:9.1f} us  x{row['count_per_step']:5.1f}  {row['kernel']}")


if __name__ == "__main__":
    main()
