"""Automatic accuracy repair on a 12-block fp16 model in which one block overflows fp16 (issue 13).

Every block is ``LayerNorm(x + fc2(relu(fc1(x))))``; in one block (``--hot``) fc2 is scaled so the
residual sum reaches ~7e4 > 65504, the largest fp16 value, right before the LayerNorm. In fp32 the
norm brings it back and the model is fine; in an fp16 engine the sum is ``inf`` and the norm ``nan``.
All blocks have one structure, so dedup builds one fp16 engine for the twelve.

Measured, in one run:
  * without repair: validation fails (the reason names the tolerance);
  * with repair: it passes with exactly the hot block's engine in fp32 and the other eleven in fp16,
    the record names the block, and repair built only the changed partition's engine (no full
    recompile; compared with a cold full compile of the repaired options);
  * the per-partition table before and after.
Run: python benchmarks/accuracy_repair.py [--blocks 12] [--hot 7] [--width 64]
Keeps to 2 CPU cores and a couple of minutes.
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
from benchmarks._common import print_table, write_json
from compiler.errors import AccuracyError
from zoo.models import OverflowModel

FP16_MAX = 65504.0


def overflow_case(width: int = 64, blocks: int = 12, hot: int = 7, seed: int = 0):
    """(model, program) with a dynamic batch, compiled one engine per block."""
    torch.manual_seed(seed)
    model = OverflowModel(width, blocks, hot).eval()
    example = torch.randn(4, width)
    program = compiler.export(
        model, (example,), dynamic_shapes=({0: torch.export.Dim("batch", min=1, max=16)},)
    )
    return model, program


def peak_before_norm(model: OverflowModel, x: torch.Tensor) -> list[float]:
    """Per block, the largest |value| entering its LayerNorm (fp32, eager)."""
    peaks = []
    with torch.no_grad():
        for block in model.blocks:
            pre = x + block.fc2(torch.relu(block.fc1(x)))
            peaks.append(float(pre.abs().max()))
            x = block.norm(pre)
    return peaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--hot", type=int, default=7)
    parser.add_argument("--width", type=int, default=64)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    model, program = overflow_case(args.width, args.blocks, args.hot)
    peaks = peak_before_norm(model, torch.randn(16, args.width))
    tolerances = compiler.Tolerances(min_top1_agreement=0.99).resolved("fp16")
    options = compiler.CompileOptions(precision="fp16", split_modules=("OverflowBlock",))
    with tempfile.TemporaryDirectory() as work:
        cache = compiler.EngineCache(Path(work) / "cache")
        start = time.perf_counter()
        compiled = compiler.compile(program, options, cache=cache)
        compile_s = time.perf_counter() - start
        hot = f"engine_{args.hot}"  # split per block, in order: block i is engine_i

        # Without repair ("error", the library default): the compile fails validation.
        try:
            compiler.ensure_accuracy(model, compiled, tolerances, warmup=1, runs=5, cache=cache)
            without = "passed"
        except AccuracyError as exc:
            without = exc.failures
        # With repair.
        start = time.perf_counter()
        repairing = compiler.compile(program, options, cache=cache, on_accuracy_failure="repair")
        assert repairing.report.engines_built == 0  # same engines as above: all from the cache
        repaired, report = compiler.ensure_accuracy(
            model, repairing, tolerances, warmup=1, runs=5, cache=cache
        )
        with_repair_s = time.perf_counter() - start
        record = compiler.RepairRecord.from_dict(repaired.report.accuracy_repair)
        # What a full recompile of the repaired options costs, cold (the repair avoided it).
        start = time.perf_counter()
        cold = compiler.compile(
            program, repaired.plan.options, cache=compiler.EngineCache(Path(work) / "cold-cache")
        )
        full_recompile_s = time.perf_counter() - start
    data = compiler.validation_data(compiled.input_specs, samples=3)
    before_table = compiler.compare_partitions(compiled, data.samples, runs=10)
    after_table = compiler.compare_partitions(repaired, data.samples, runs=10)
    levels = {r.partition: r.precision for r in after_table.rows if r.partition.startswith("engine_")}
    block_levels = [levels[f"engine_{i}"] for i in range(args.blocks)]
    checks = {
        "without_repair_fails": without != "passed",
        "with_repair_passes": not report.failures(tolerances),
        "only_hot_block_fp32": block_levels.count("fp32") == 1 and levels[hot] == "fp32",
        "other_blocks_fp16": block_levels.count("fp16") == args.blocks - 1,
        "record_names_the_block": any(line.startswith(f"{hot}: fp16 -> fp32") for line in record.lines()),
        "rebuilt_only_changed": record.engines_built <= len(record.steps),
    }

    print(f"peak |value| before each block's LayerNorm (fp16 max {FP16_MAX:.0f}):")
    print("  " + ", ".join(f"{i}:{p:.3g}" for i, p in enumerate(peaks)))
    print_table(
        "accuracy repair: fp16, one engine per block",
        ["run", "result", "max rel L2", "top-1 agree", "seconds", "engines built"],
        [
            ["compile (fp16)", "-", "-", "-", round(compile_s, 2), compiled.report.engines_built],
            [
                "without repair",
                "FAILS" if without != "passed" else "passes",
                record.before.max_rel_l2,
                record.before.min_top1_agreement,
                "-",
                0,
            ],
            [
                "with repair",
                "passes" if checks["with_repair_passes"] else "FAILS",
                report.max_rel_l2,
                report.min_top1_agreement,
                round(with_repair_s, 2),
                record.engines_built,
            ],
            ["  of which repair", "-", "-", "-", record.seconds, record.engines_built],
            ["  of which rebuilding", "-", "-", "-", record.build_seconds, record.engines_built],
            ["full recompile (cold)", "-", "-", "-", round(full_recompile_s, 2), cold.report.engines_built],
        ],
    )
    print("\nwithout repair:", "; ".join(without) if isinstance(without, list) else without)
    print("repair decisions:\n  " + "\n  ".join(record.lines()))
    print("\nper partition, before repair:\n" + before_table.table())
    print("\nper partition, after repair:\n" + after_table.table())
    print("\nchecks:", ", ".join(f"{k}={'ok' if v else 'FAILED'}" for k, v in checks.items()))
    write_json(
        "accuracy_repair",
        {
            "config": {"blocks": args.blocks, "hot": args.hot, "width": args.width, "precision": "fp16"},
            "tolerances": tolerances.to_dict(),
            "peak_before_norm": peaks,
            "compile_seconds": round(compile_s, 3),
            "without_repair_failures": without if isinstance(without, list) else [],
            "with_repair": {
                "seconds": round(with_repair_s, 3),
                "validation": {
                    "max_rel_l2": report.max_rel_l2,
                    "min_top1_agreement": report.min_top1_agreement,
                    "data_source": report.data_source,
                },
                "record": record.to_dict(),
            },
            "full_recompile_cold_seconds": round(full_recompile_s, 3),
            "full_recompile_engines_built": cold.report.engines_built,
            "partition_precision": block_levels,
            "before": before_table.to_dict(),
            "after": after_table.to_dict(),
            "checks": checks,
        },
    )
    if not all(checks.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
