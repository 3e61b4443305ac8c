"""Probe (issue 44): each kernel of ``kiln::decode_attention`` on the H100, as the decode step runs it
(16 layers' calls in one CUDA graph, the benchmark's Llama shapes, batch 1 and 8): per-kernel device
time from the profiler, so the split-KV kernels are tuned on numbers.

    python3 benchmarks/probes/probe_decode_attention_kernels.py OUT.json
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import compiler.generation.attention  # noqa: E402,F401  (defines the op)
from benchmarks.machine import gpu_machine  # noqa: E402

LAYERS, HEADS, KV, D, CACHE = 16, 32, 8, 64, 1024


def main() -> None:
    result: dict = {"machine": gpu_machine(), "batches": {}}
    for batch in (1, 8):
        g = torch.Generator(device="cuda").manual_seed(0)

        def r(*shape, g=g):
            return torch.randn(*shape, device="cuda", dtype=torch.float16, generator=g)

        calls = [
            (r(batch, 1, HEADS, D).transpose(1, 2), r(batch, KV, CACHE, D), r(batch, KV, CACHE, D),
             torch.zeros(batch, 1, 1, CACHE, device="cuda", dtype=torch.float16),
             r(batch, KV, 1, D), r(batch, KV, 1, D), D**-0.5)
            for _ in range(LAYERS)
        ]  # fmt: skip

        def step(calls=calls):
            return [torch.ops.kiln.decode_attention(*c) for c in calls]

        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        for _ in range(20):
            graph.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(200):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        kernels: dict[str, float] = defaultdict(float)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(50):
                graph.replay()
            torch.cuda.synchronize()
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name] += event.device_time / 50
        row = {"us_16_layers": start.elapsed_time(end) / 200 * 1e3, "kernel_us_per_step": dict(kernels)}
        result["batches"][str(batch)] = row
        print(batch, json.dumps(row), flush=True)
    Path(sys.argv[1]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
