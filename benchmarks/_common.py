"""Shared benchmark plumbing: interleaved timing, a printed table, JSON results."""

from __future__ import annotations

import json
import platform
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from compiler.validation.validate import measure_latency

RESULTS = Path(__file__).resolve().parent / "results"


def interleaved(fns: dict[str, Callable[[], object]], warmup: int = 3, runs: int = 30) -> dict[str, dict]:
    """Time several callables in turn, round after round (kiln's own ``measure_latency``), as dicts."""
    with torch.no_grad():
        timed = measure_latency(fns, warmup=warmup, runs=runs)
    return {name: {"median_ms": t.median_ms, "p95_ms": t.p95_ms, "runs": t.runs} for name, t in timed.items()}


def print_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max([len(str(h)), *(len(r[i]) for r in cells)]) for i, h in enumerate(columns)]
    print(f"\n{title}")
    print("  ".join(str(h).ljust(w) for h, w in zip(columns, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


def write_json(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {
        "machine": {
            "cpu_count": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        **payload,
    }
    path.write_text(json.dumps(payload, indent=2, sort_keys=True))
    print(f"\nwrote {path}")
    return path


def _fmt(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)
