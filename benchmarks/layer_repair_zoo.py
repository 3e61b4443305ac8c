"""Layer-granular accuracy repair on Inductor through `kiln zoo`, on the device it is for (issue 46).

The suite proves Inductor's int8 layer repair on the CPU (PT2E, tests/test_mixed_precision_inductor_zoo.py).
On CUDA, Inductor's int8 and fp8 are dynamic rowwise GEMMs (torch._int_mm / torch._scaled_mm), and the
same repair leaves the raised linears out of the rewrite; that path needs a GPU. This runs it as a user
does: a BERT classifier from a config (random weights, saved with save_pretrained), recorded inputs, one
zoo file with an int8 and (on CUDA) an fp8 entry at a tolerance all-quantized misses, `kiln zoo`, then
each package read back in a fresh process. Writes the repair records and the answers' error to JSON.

    python -m benchmarks.layer_repair_zoo --device cuda --out OUT.json [--rel-l2 0.01] [--int8-rel-l2 0.015]
    python -m benchmarks.layer_repair_zoo --device cpu --out /tmp/lr.json   # the CPU's PT2E int8
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.machine import cpu_model, gpu_machine
from tests.fixtures.mixed_precision import bert, eager_logits, record, relative, zoo

CONFIG = {  # BertConfig fields: 2 layers x 128
    "vocab_size": 1024,
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 512,
    "max_position_embeddings": 64,
    "num_labels": 4,
}


def entries(device: str, rel_l2: float, int8_rel_l2: float | None = None) -> dict[str, dict]:
    common = {
        "task": "sequence-classification",
        "backend": "inductor",
        "devices": [device],
        "validation": {"data": "recorded.npz"},
        "on_accuracy_failure": "repair",
        "repair_seconds": 300,
        "tolerances": {"rel_l2": rel_l2},
    }
    if device == "cpu":  # static PT2E, calibrated on the first 8 recorded batches
        return {
            "int8": {**common, "precision": "int8", "calibration": {"data": "recorded.npz", "samples": 8}}
        }
    # Dynamic rowwise: no calibration. Its int8 entry may take its own tolerance: on the H100 at 0.01,
    # int8 rowwise (its other ops in bf16) kept no linear (results/layer_repair_zoo_h100_strict.json).
    tolerance = {"int8": int8_rel_l2 or rel_l2, "fp8": rel_l2}
    return {
        name: {**common, "precision": name, "quantization": "dynamic", "tolerances": {"rel_l2": tol}}
        for name, tol in tolerance.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--rel-l2", type=float, default=0.01, help="the entries' tolerance")
    parser.add_argument("--int8-rel-l2", type=float, help="the CUDA int8 entry's own (default: --rel-l2)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kiln-layer-repair-") as tmp:
        root = Path(tmp)
        model = bert(root / "bert", 3, **CONFIG)
        ids = record(root, model, 16, 2, 16, seed=0)
        settings = {
            "engine_cache": str(root / "engines"),
            "validation": {"samples": 8, "warmup": 0, "runs": 2},
        }
        run = zoo(root, "run", entries(args.device, args.rel_l2, args.int8_rel_l2), settings)
        eager = eager_logits(model, ids)
    result = {
        "machine": gpu_machine() if args.device == "cuda" else {"cpu": cpu_model()},
        "device": args.device,
        "tolerance_rel_l2": args.rel_l2,
        "int8_tolerance_rel_l2": args.int8_rel_l2 or args.rel_l2,
        "seconds": round(time.perf_counter() - start, 1),
        "warnings": run["summary"].get("warnings", []),
        "models": {},
    }
    for name, package in run["packages"].items():
        repair = package.get("repair") or {}
        result["models"][name] = {
            "precision": package.get("precision"),
            "read_back_rel_l2_vs_eager": relative(package["logits"], eager),
            "before": repair.get("before"),
            "after": repair.get("after"),
            "passed": repair.get("passed"),
            "partition_steps": repair.get("steps"),
            "searches": repair.get("searches"),
            "kept": repair.get("kept"),
            "lines": repair.get("lines"),
        }
        row = result["models"][name]
        print(f"{name}: {row['precision']}, read back rel L2 {row['read_back_rel_l2_vs_eager']:.4f}")
        for line in row["lines"] or []:
            print(f"  {line}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
