"""Probe (issue 44): what generate's greedy pick costs between decode steps on the GPU, per form.

``generate`` spends ~50 us between captured steps (1.36 ms a step vs 1.31 replayed back to back on the
H100); the pick is an argmax over the vocabulary (128,256 for the Llama-style benchmark model). Times
each form on the device inside a CUDA graph (what a captured step pays; CUDA events over 20 replays of
100 calls, fp16 logits) and checks that they agree. probe_greedy_pick.h100.json timed eager calls
(bound by launches, not the kernels); probe_greedy_pick_graphed.h100.json times them captured.

    python3 benchmarks/probes/probe_greedy_pick.py OUT.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.machine import gpu_machine  # noqa: E402


def two_stage(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    rows, vocab = logits.shape
    pad = (-vocab) % chunk
    padded = torch.nn.functional.pad(logits, (0, pad), value=float("-inf")) if pad else logits
    values, inner = padded.view(rows, -1, chunk).max(-1)
    best = values.argmax(-1, keepdim=True)
    return (best * chunk + inner.gather(-1, best)).squeeze(-1)


def device_us(fn, logits: torch.Tensor, calls: int = 100, replays: int = 20) -> float:
    """Device time of one call, captured in a CUDA graph of ``calls`` calls (what a captured decode step
    pays: no launch gaps; timed eagerly, every form is bound by its launches)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(logits)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(logits)
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / (calls * replays) * 1e3


def main() -> None:
    result: dict = {"machine": gpu_machine(), "cases": {}}
    forms = {
        "argmax": lambda x: x.argmax(-1),
        "two_stage_1024": two_stage,
        "two_stage_4096": lambda x: two_stage(x, 4096),
        "two_stage_256": lambda x: two_stage(x, 256),
        "copy_token": lambda x: x[:, :1].copy_(x[:, 1:2]),
    }
    for rows in (1, 8):
        for vocab in (128256, 50257, 32000):
            logits = torch.randn(rows, vocab, device="cuda", dtype=torch.float16)
            want = logits.argmax(-1)
            case = {}
            for name, fn in forms.items():
                if name != "copy_token":
                    assert torch.equal(fn(logits), want), name
                case[name] = device_us(fn, logits.clone())
            result["cases"][f"rows{rows}_vocab{vocab}"] = case
            print(rows, vocab, {k: round(v, 1) for k, v in case.items()})
    Path(sys.argv[1]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
