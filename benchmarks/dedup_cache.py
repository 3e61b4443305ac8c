"""Dedup, engine cache and weight stripping, side by side in one run (seeds 000, 001).

For BERT-shaped encoders of 4, 12 and 24 layers (random weights) with repeated-block partitioning,
and for a model whose fallback op repeats in every block:
  * compile time with dedup vs without (targets: 12 layers <= 0.3x, 24 layers <= 0.2x)
  * warm-cache compile vs cold (target <= 0.1x)
  * runtime latency split vs unsplit (target <= 1.10x)
  * package size stripped vs full
Run: python benchmarks/dedup_cache.py [--layers 4,12,24] [--runs N]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import compiler
from benchmarks._common import interleaved, print_table, write_json
from compiler.inputs.data import sample_inputs
from compiler.options import CompileOptions
from zoo.models import bert_encoder, repeated_fallback


def timed_compile(program, options: CompileOptions, cache, share: bool = True):
    """compile() spelled out so dedup can be switched off for the baseline."""
    start = time.perf_counter()
    plan = compiler.partition(program, options)
    unique = compiler.dedup(plan, share=share)
    engines = {fp: compiler.build_engine(plan, unique, fp, cache=cache) for fp in unique.fingerprints}
    compiled = compiler.assemble(plan, unique, engines)
    return compiled, time.perf_counter() - start


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def run_case(name: str, case, runs: int, work: Path) -> dict:
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    split = CompileOptions(split_modules="auto")
    _, no_dedup_s = timed_compile(program, split, None, share=False)
    cold_cache = compiler.EngineCache(work / f"{name}-cache")
    split_compiled, cold_s = timed_compile(program, split, cold_cache)
    _, warm_s = timed_compile(program, split, compiler.EngineCache(work / f"{name}-cache"))
    unsplit_compiled, _ = timed_compile(program, CompileOptions(), None)
    stripped_compiled, _ = timed_compile(
        program, CompileOptions(split_modules="auto", strip_weights=True), None
    )
    full_pkg = compiler.save(split_compiled, work / f"{name}-full.kiln").path
    strip_pkg = compiler.save(stripped_compiled, work / f"{name}-strip.kiln").path
    args, kwargs = case.args, case.kwargs
    timing = interleaved(
        {
            "split": lambda: split_compiled(*args, **kwargs),
            "unsplit": lambda: unsplit_compiled(*args, **kwargs),
        },
        runs=runs,
    )
    # At the largest shape the specs allow, per-engine-call overhead weighs what it weighs in serving.
    flat = sample_inputs(split_compiled.input_specs, "max", torch.Generator().manual_seed(0))
    big_args, big_kwargs = torch.utils._pytree.tree_unflatten(flat, program.call_spec.in_spec)
    timing_max = interleaved(
        {
            "split": lambda: split_compiled(*big_args, **big_kwargs),
            "unsplit": lambda: unsplit_compiled(*big_args, **big_kwargs),
        },
        runs=max(5, runs // 2),
    )
    report = split_compiled.report
    return {
        "model": name,
        "partitions": len(report.partitions),
        "unique": report.unique_fingerprints,
        "no_dedup_s": no_dedup_s,
        "dedup_s": cold_s,
        "dedup_ratio": cold_s / no_dedup_s,
        "warm_s": warm_s,
        "warm_ratio": warm_s / cold_s,
        "split_ms": timing["split"]["median_ms"],
        "unsplit_ms": timing["unsplit"]["median_ms"],
        "split_latency_ratio": timing["split"]["median_ms"] / timing["unsplit"]["median_ms"],
        "split_ms_at_max": timing_max["split"]["median_ms"],
        "unsplit_ms_at_max": timing_max["unsplit"]["median_ms"],
        "split_latency_ratio_at_max": timing_max["split"]["median_ms"] / timing_max["unsplit"]["median_ms"],
        "full_pkg_bytes": dir_bytes(full_pkg),
        "stripped_pkg_bytes": dir_bytes(strip_pkg),
        "full_engine_bytes": report.engine_bytes,
        "stripped_engine_bytes": stripped_compiled.report.engine_bytes,
        "stage_seconds_cold": report.stage_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", default="4,12,24")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    cases = [(f"bert-{n}L", bert_encoder(int(n), hidden=args.hidden)) for n in args.layers.split(",")]
    cases.append(("repeated-fallback-12", repeated_fallback(depth=12, width=args.hidden)))
    with tempfile.TemporaryDirectory() as tmp:
        rows = [run_case(name, case, args.runs, Path(tmp)) for name, case in cases]
    print_table(
        "dedup, engine cache, weight stripping (CPU, ONNX Runtime)",
        [
            "model",
            "parts",
            "unique",
            "no-dedup s",
            "dedup s",
            "ratio",
            "warm s",
            "warm/cold",
            "split/unsplit",
            "at max shape",
            "full KB",
            "stripped KB",
        ],
        [
            [
                r["model"],
                r["partitions"],
                r["unique"],
                r["no_dedup_s"],
                r["dedup_s"],
                r["dedup_ratio"],
                r["warm_s"],
                r["warm_ratio"],
                r["split_latency_ratio"],
                r["split_latency_ratio_at_max"],
                r["full_pkg_bytes"] / 1e3,
                r["stripped_pkg_bytes"] / 1e3,
            ]
            for r in rows
        ],
    )
    by_name = {r["model"]: r for r in rows}
    targets = {
        "dedup_ratio_12L<=0.3": by_name.get("bert-12L", {}).get("dedup_ratio"),
        "dedup_ratio_24L<=0.2": by_name.get("bert-24L", {}).get("dedup_ratio"),
        "warm_ratio_max<=0.1": max(r["warm_ratio"] for r in rows),
        "split_latency_ratio_max<=1.1": max(r["split_latency_ratio"] for r in rows),
        "split_latency_ratio_at_max_shape_max<=1.1": max(r["split_latency_ratio_at_max"] for r in rows),
    }
    print("targets:", {k: round(v, 3) if v is not None else None for k, v in targets.items()})
    write_json("dedup_cache", {"rows": rows, "targets": targets, "torch_threads": torch.get_num_threads()})


if __name__ == "__main__":
    main()
