"""Generation side by side (issue 44 item 6): kiln's prefill and decode programs vs transformers'
``generate`` with a static cache compiled with ``mode="reduce-overhead"`` (its documented fast path),
and vs eager ``generate``, on a Llama-style decoder built from a config; one run.

    python -m benchmarks.generation --out $OUT/generation_h100.json   # the GPU: ~1.5B params, fp16
    python -m benchmarks.generation --tiny --device cpu                # a tiny model, fp32: tests the logic

Measured, per path: time to first token (wall time of ``generate(..., max_new_tokens=1)``, batch 1) at
two prompt lengths, and decode tokens/s at batch 1 and 8 (wall time of ``generate`` of ``new + 1``
tokens minus that of 1 token, over ``new`` steps; the same for every path). For kiln also: compile
seconds (export and compile of both programs), the package's bytes on disk, each decode step's time on
the GPU's timeline (CUDA events) and whether its steps replayed CUDA graphs.

The floor: the bytes one decode step must read at batch 1 (every weight it multiplies by: all but the
input embedding table, of which one row per token is read; and the whole static key/value cache, which
attention reads at every step) over the GPU's memory bandwidth, measured here as a device-to-device copy
of 1 GiB (bytes read + bytes written per second). Targets (issue 44): decode tokens/s >= 1.3x the
compiled transformers path at batch 1 and 8; batch-1 step time <= 1.5x the floor; time to first token
<= the compiled path's. Each missed target is printed. The JSON (``--out``) is rewritten after every
phase, so a run cut short leaves what it measured. Imports only torch, transformers and ``compiler``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import compiler
from benchmarks.machine import cpu_model, gpu_machine
from compiler.generation.module import GenerationModule
from compiler.generation.package import save_generation
from compiler.generation.spec import program_options
from compiler.generation.step import generation_spec, program_case

RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {"decode_vs_hf_compiled": 1.3, "step_over_floor": 1.5, "ttft_vs_hf_compiled": 1.0}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 512,
}
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
}


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny model (tests the benchmark's logic)")
    parser.add_argument("--device", default=None, help="cuda (default where there is one) or cpu")
    parser.add_argument("--backend", default="inductor", help="kiln backend (default inductor)")
    parser.add_argument("--max-cache-len", type=int, default=None, help="default 1024 (tiny: 64)")
    parser.add_argument(
        "--new-tokens", type=int, default=None, help="decode steps timed (default 64; tiny 8)"
    )
    parser.add_argument("--runs", type=int, default=None, help="timed repeats (median; default 5, tiny 2)")
    parser.add_argument("--prompts", default=None, help="two prompt lengths (default 128,512; tiny 8,24)")
    parser.add_argument("--no-aot", action="store_true", help="Inductor engines without AOTInductor (faster)")
    parser.add_argument("--budget-s", type=float, default=510.0, help="optional phases stop past this")
    parser.add_argument(
        "--out", default=None, help="the JSON (default benchmarks/results/generation_<dev>.json)"
    )
    parser.add_argument(
        "--decode-compile-options",
        type=json.loads,
        default=None,
        help="Inductor config for the decode program, as JSON (e.g. '{\"combo_kernels\": true}')",
    )
    return parser.parse_args()


class Report:
    """The results so far, written (atomically) after every phase."""

    def __init__(self, path: Path, data: dict[str, Any]):
        self.path, self.data, self.start = path, data, time.perf_counter()
        self.data.setdefault("phases", {})
        self.data.setdefault("skipped", [])
        self.data.setdefault("errors", {})

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def phase(self, name: str, fn: Callable[[], Any]) -> Any:
        print(f"[{self.elapsed():6.1f}s] {name} ...", flush=True)
        begin = time.perf_counter()
        try:
            return fn()
        except Exception as exc:  # record it, keep what else can be measured
            traceback.print_exc()
            self.data["errors"][name] = f"{type(exc).__name__}: {exc}"[:2000]
            return None
        finally:
            self.data["phases"][name] = round(time.perf_counter() - begin, 2)
            self.save()

    def save(self) -> None:
        self.data["wall_seconds"] = round(self.elapsed(), 1)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        scratch = self.path.with_name(f".{self.path.name}.tmp")
        scratch.write_text(json.dumps(self.data, indent=2, sort_keys=True, default=str))
        os.replace(scratch, self.path)


def build_model(tiny: bool, dtype: torch.dtype, device: str, layers: int | None = None) -> torch.nn.Module:
    """The benchmark's Llama (``layers``: fewer decoder layers than LLAMA_1B's, for probes; the tiny
    config keeps its own)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    sizes = TINY if tiny else {**LLAMA_1B, **({"num_hidden_layers": layers} if layers else {})}
    config = LlamaConfig(
        **sizes,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    with torch.device(device):  # initialised on the device: a 1.5B model's init on the host takes a minute
        lm = LlamaForCausalLM(config)
    lm = lm.to(dtype).eval()
    lm.generation_config.eos_token_id = None  # every path generates exactly the tokens asked for
    return lm


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Bytes per second of a device-to-device copy (read + written), 1 GiB on CUDA (64 MiB on the CPU)."""
    size = (1 << 30) if device.startswith("cuda") else (1 << 26)
    src = torch.empty(size, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    sync(device)
    times = []
    for _ in range(10):
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * size / statistics.median(times)


def step_bytes(lm: torch.nn.Module, cache_bytes_batch1: int) -> dict[str, int]:
    """What one batch-1 decode step must read: weights (less the input embedding table, unless tied to
    the head, which reads all of it) and the whole static cache."""
    embedding = lm.get_input_embeddings().weight
    head = lm.get_output_embeddings().weight
    skip = embedding.data_ptr() if embedding.data_ptr() != head.data_ptr() else None
    weights = sum(p.numel() * p.element_size() for p in lm.parameters() if p.data_ptr() != skip)
    return {"weights": weights, "cache": cache_bytes_batch1}


def compile_kiln(lm: torch.nn.Module, args: argparse.Namespace, settings: dict) -> dict:
    """Export and compile both programs (the compile seconds), then save the package (its bytes)."""
    start = time.perf_counter()
    spec = generation_spec(
        lm,
        max_batch=max(settings["batches"]),
        max_cache_len=settings["max_cache_len"],
        prompt_min=1,
        prompt_max=max(settings["prompts"]),
    )
    programs, reports = {}, {}
    for program in ("prefill", "decode"):
        options = program_options(
            program,
            args.backend,
            settings["device"],
            {"backend_options": {"aot": False} if args.no_aot else {}},
        )
        if program == "decode" and args.decode_compile_options:
            options["backend_options"]["compile_options"] = args.decode_compile_options
        wrapper, kwargs, shapes = program_case(lm, spec, program)
        with torch.no_grad():  # as kiln zoo exports generation programs (tasks/stages.py)
            exported = compiler.export(wrapper, (), kwargs, dynamic_shapes=shapes)
        programs[program] = compiler.compile(
            exported,
            backend=args.backend,
            strip_weights=True,
            device=settings["device"],
            precision=settings["precision"],
            **options,
        )
        report = programs[program].report
        reports[program] = {
            "partitions": len(programs[program].plan.partitions),
            "fallback_ops": dict(programs[program].plan.fallback_ops),
            **options,
            "cuda_graph_check": report.cuda_graphs,
        }
    module = GenerationModule(programs["prefill"], programs["decode"], spec)
    seconds = time.perf_counter() - start
    folder = Path(tempfile.mkdtemp(prefix="kiln-generation-bench-"))
    try:
        begin = time.perf_counter()
        info = save_generation(module, folder / "gen.kiln")
        save_s = time.perf_counter() - begin
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return {
        "module": module,
        "compile_seconds": seconds,
        "package_bytes": info.bytes,
        "save_seconds": save_s,
        "programs": reports,
    }


def wall(device: str, fn: Callable[[], Any]) -> float:
    sync(device)
    start = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - start


def measure(
    generate: Callable[[torch.Tensor, int], Any],
    settings: dict,
    vocab: int,
    after: Callable[[], Any] | None = None,
) -> dict:
    """TTFT at each prompt length (batch 1) and decode tokens/s at each batch (see the module docstring).
    ``after``: called after each batch's runs (kiln reads its per-step GPU times there)."""
    device, runs, new = settings["device"], settings["runs"], settings["new_tokens"]
    generator = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {}

    def prompt(batch: int, length: int) -> torch.Tensor:
        return torch.randint(3, vocab, (batch, length), generator=generator).to(device)

    for length in settings["prompts"]:
        ids = prompt(1, length)
        warm = wall(device, lambda ids=ids: generate(ids, 1))
        out[f"first_call_s_prompt{length}"] = round(warm, 3)
        out[f"ttft_ms_prompt{length}"] = statistics.median(
            wall(device, lambda ids=ids: generate(ids, 1)) * 1e3 for _ in range(runs)
        )
    for batch in settings["batches"]:
        ids = prompt(batch, settings["prompts"][0])
        out[f"first_call_s_batch{batch}"] = round(wall(device, lambda ids=ids: generate(ids, new + 1)), 3)
        wall(device, lambda ids=ids: generate(ids, new + 1))
        first, whole = [], []
        for _ in range(runs):  # interleaved, so drift hits both alike
            first.append(wall(device, lambda ids=ids: generate(ids, 1)))
            whole.append(wall(device, lambda ids=ids: generate(ids, new + 1)))
        step = max(statistics.median(whole) - statistics.median(first), 1e-9) / new
        out[f"decode_step_ms_batch{batch}"] = step * 1e3
        out[f"decode_tokens_per_s_batch{batch}"] = batch / step
        if after is not None:
            out.update({f"{k}_batch{batch}": v for k, v in after().items()})
    return out


def replayed_step_ms(static: Any, position: int, steps: int = 64) -> float:
    """The batch-1 step's captured graph replayed back to back (device time a step, its greedy pick
    included, plus a token copy each): what a step costs without ``generate``'s loop around it."""
    bucket = static._bucket(static.bucket_rows(1))
    token = torch.ones(1, dtype=torch.long, device=static.device)
    static.position.fill_(position)
    for _ in range(4):
        static.step(bucket, token)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    static.position.fill_(position)
    begin.record()
    for _ in range(steps):
        static.step(bucket, token)
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / steps


def greedy_divergence(module: GenerationModule, lm: torch.nn.Module, settings: dict) -> dict:
    length, new = settings["prompts"][0], settings["new_tokens"]
    ids = torch.randint(3, module.spec.vocab_size, (1, length), generator=torch.Generator().manual_seed(1))
    ids = ids.to(settings["device"])
    got = module.generate(ids, max_new_tokens=new, eos_token_id=[])
    with torch.no_grad():
        want = lm.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=0
        )
    differ = (got[0, length:] != want[0, length:]).nonzero()
    return {"new_tokens": new, "first_divergence": int(differ[0]) if len(differ) else None}


def hf_generate(lm: torch.nn.Module) -> Callable[[torch.Tensor, int], Any]:
    def run(ids: torch.Tensor, tokens: int) -> Any:
        with torch.no_grad():
            return lm.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
            )

    return run


def hf_static_compiled(lm: torch.nn.Module, settings: dict) -> dict:
    """transformers' fast path: a static cache (one size for every call: no recompiles) and ``generate``'s
    own compile of its decode steps, mode "reduce-overhead" (its prefill runs eager, as documented)."""
    from transformers import CompileConfig

    config = lm.generation_config
    config.cache_implementation = "static"
    config.max_cache_len = settings["max_cache_len"]  # transformers >= 5.17; ignored by older ones
    config.compile_config = CompileConfig(mode="reduce-overhead", fullgraph=True)
    if not settings["device"].startswith("cuda"):  # transformers compiles only on accelerators, unless told
        config.compile_config._compile_all_devices = True
    try:
        try:
            return {"fullgraph": True, **measure(hf_generate(lm), settings, lm.config.vocab_size)}
        except Exception as exc:  # a graph break under fullgraph: the same path without it
            print(f"compiled HF, fullgraph=True: {type(exc).__name__}: {str(exc)[:300]}; again without it")
            torch._dynamo.reset()
            lm.__dict__.pop("_compiled_call", None)
            config.compile_config = CompileConfig(mode="reduce-overhead", fullgraph=False)
            row = measure(hf_generate(lm), settings, lm.config.vocab_size)
            return {"fullgraph": False, "fullgraph_error": f"{type(exc).__name__}: {exc}"[:1000], **row}
    finally:
        config.cache_implementation, config.compile_config, config.max_cache_len = None, None, None


def verdicts(results: dict, summary: dict, settings: dict) -> list[str]:
    """Each target, met or missed (or not measured), as a printed line."""
    lines = []
    kiln, hf = results.get("kiln") or {}, results.get("hf_static_compiled") or {}
    for batch in settings["batches"]:
        key = f"decode_tokens_per_s_batch{batch}"
        if key in kiln and key in hf:
            ratio = kiln[key] / hf[key]
            summary[f"decode_vs_hf_compiled_batch{batch}"] = ratio
            ok = ratio >= TARGETS["decode_vs_hf_compiled"]
            lines.append(
                f"{'met' if ok else 'MISSED'}: decode tokens/s at batch {batch}: kiln {kiln[key]:.1f} vs "
                f"compiled HF {hf[key]:.1f} = {ratio:.2f}x (target >= {TARGETS['decode_vs_hf_compiled']}x)"
            )
        else:
            lines.append(f"NOT MEASURED: decode tokens/s at batch {batch} (kiln or compiled HF missing)")
    floor = summary.get("bandwidth_floor_ms_batch1")
    if floor and "decode_step_ms_batch1" in kiln:
        over = kiln["decode_step_ms_batch1"] / floor
        summary["decode_step_over_floor_batch1"] = over
        ok = over <= TARGETS["step_over_floor"]
        lines.append(
            f"{'met' if ok else 'MISSED'}: batch-1 decode step {kiln['decode_step_ms_batch1']:.3f} ms vs "
            f"bandwidth floor {floor:.3f} ms = {over:.2f}x (target <= {TARGETS['step_over_floor']}x)"
        )
    else:
        lines.append("NOT MEASURED: batch-1 decode step vs the bandwidth floor")
    for length in settings["prompts"]:
        key = f"ttft_ms_prompt{length}"
        if key in kiln and key in hf:
            ratio = kiln[key] / hf[key]
            summary[f"ttft_vs_hf_compiled_prompt{length}"] = ratio
            ok = ratio <= TARGETS["ttft_vs_hf_compiled"]
            lines.append(
                f"{'met' if ok else 'MISSED'}: time to first token, prompt {length}: kiln {kiln[key]:.2f} ms "
                f"vs compiled HF {hf[key]:.2f} ms = {ratio:.2f}x (target <= 1x)"
            )
        else:
            lines.append(f"NOT MEASURED: time to first token at prompt {length}")
    return lines


def table(results: dict, settings: dict) -> None:
    columns = [
        *(f"TTFT ms p{p}" for p in settings["prompts"]),
        *(f"tok/s b{b}" for b in settings["batches"]),
        *(f"step ms b{b}" for b in settings["batches"]),
    ]
    keys = [
        *(f"ttft_ms_prompt{p}" for p in settings["prompts"]),
        *(f"decode_tokens_per_s_batch{b}" for b in settings["batches"]),
        *(f"decode_step_ms_batch{b}" for b in settings["batches"]),
    ]
    print("\n" + "  ".join(["path".ljust(20), *(c.rjust(12) for c in columns)]))
    for name, row in results.items():
        cells = [f"{row[k]:.4g}" if isinstance(row.get(k), float) else "-" for k in keys]
        print("  ".join([name.ljust(20), *(c.rjust(12) for c in cells)]))


def main() -> None:
    args = arguments()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    tiny = args.tiny
    cuda = device.startswith("cuda")
    settings = {
        "device": device,
        "dtype": "float16" if cuda else "float32",
        "precision": "fp16" if cuda else "fp32",
        "backend": args.backend,
        "max_cache_len": args.max_cache_len or (64 if tiny else 1024),
        "new_tokens": args.new_tokens or (8 if tiny else 64),
        "runs": args.runs or (2 if tiny else 5),
        "prompts": [int(p) for p in (args.prompts or ("8,24" if tiny else "128,512")).split(",")],
        "batches": [1, 8],
        "aot": not args.no_aot,
        "budget_s": args.budget_s,
        "decode_compile_options": args.decode_compile_options,
    }
    out = (
        Path(args.out)
        if args.out
        else RESULTS / f"generation_{'gpu' if cuda else 'cpu'}{'_tiny' if tiny else ''}.json"
    )
    machine = (
        gpu_machine()
        if cuda
        else {
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "torch": torch.__version__,
            "platform": platform.platform(),
        }
    )
    import transformers

    machine["transformers"] = transformers.__version__
    report = Report(
        out, {"machine": machine, "settings": settings, "targets": TARGETS, "results": {}, "summary": {}}
    )
    results, summary = report.data["results"], report.data["summary"]
    print(f"machine: {machine}")
    bandwidth = report.phase("bandwidth", lambda: copy_bandwidth(device))
    dtype = getattr(torch, settings["dtype"])
    lm = report.phase("build model", lambda: build_model(tiny, dtype, device))
    if lm is None:
        raise SystemExit(f"could not build the model: {report.data['errors']}")
    params = sum(p.numel() for p in lm.parameters())
    report.data["model"] = {"family": "llama", "parameters": params, "config": "tiny" if tiny else LLAMA_1B}
    kiln = report.phase("kiln compile + save", lambda: compile_kiln(lm, args, settings))
    if kiln is not None:
        module = kiln.pop("module")
        report.data["kiln"] = kiln
        summary["compile_seconds"], summary["package_bytes"] = kiln["compile_seconds"], kiln["package_bytes"]
        static = module.static_decode()

        def step_times() -> dict:
            times = module.last_times.decode
            return {
                "decode_step_device_ms": statistics.median(times) * 1e3 if times else None,
                "graphed": static.graphed,
                "graph_reason": static.reason,
                "captures": static.captures,
                "cache_copy_back_max_bytes": static.full_copy_max_bytes,  # whole caches up to this
            }

        report.data["greedy_vs_eager"] = report.phase(
            "greedy tokens vs eager", lambda: greedy_divergence(module, lm, settings)
        )
        results["kiln"] = report.phase(
            "kiln timings",
            lambda: measure(
                lambda ids, n: module.generate(ids, max_new_tokens=n, eos_token_id=[]),
                settings,
                module.spec.vocab_size,
                step_times,
            ),
        )
        if static.graphed and results["kiln"]:
            results["kiln"]["decode_replay_ms_batch1"] = report.phase(
                "kiln replayed steps", lambda: replayed_step_ms(static, module.spec.prompt_max)
            )
        bytes_read = step_bytes(lm, module.spec.cache_bytes(1))
        if bandwidth:
            summary["copy_bandwidth_gb_per_s"] = bandwidth / 1e9
            summary["step_bytes_batch1"] = bytes_read
            summary["bandwidth_floor_ms_batch1"] = sum(bytes_read.values()) / bandwidth * 1e3
    results["hf_static_compiled"] = report.phase(
        "HF static cache, reduce-overhead", lambda: hf_static_compiled(lm, settings)
    )
    if report.elapsed() < args.budget_s * 0.75:
        results["hf_eager"] = report.phase(
            "HF eager",
            lambda: measure(
                hf_generate(lm), {**settings, "runs": min(3, settings["runs"])}, lm.config.vocab_size
            ),
        )
    else:
        report.data["skipped"].append(
            f"HF eager: {report.elapsed():.0f}s used of the {args.budget_s:.0f}s budget"
        )
    results = {k: v for k, v in results.items() if v}
    lines = verdicts(results, summary, settings)
    report.data["verdicts"] = lines
    report.save()
    print(
        f"\ngeneration: Llama-style {params / 1e9:.3f}B params, {settings['dtype']}, {device}, kiln on "
        f"{args.backend}; {machine.get('gpu', machine.get('cpu'))}; host {machine.get('host_cpu', '')}"
    )
    table(results, settings)
    print()
    for key in ("copy_bandwidth_gb_per_s", "bandwidth_floor_ms_batch1", "compile_seconds", "package_bytes"):
        if key in summary:
            print(f"{key}: {summary[key]:.4g}")
    if "kiln" in results:
        row = results["kiln"]
        print(f"kiln decode steps graphed: {row.get('graphed_batch1')} ({row.get('graph_reason_batch1')})")
    print(f"greedy tokens vs eager: {report.data.get('greedy_vs_eager')}")
    print()
    for line in lines:
        print(line)
    for name, error in report.data["errors"].items():
        print(f"ERROR in {name}: {error[:300]}")
    print(f"\nwrote {out} ({report.elapsed():.0f}s)")


if __name__ == "__main__":
    main()
