"""Probe (issue 45): what a package whose fp16 engines' weights are stored at fp16
(``engine_precision_weights``, what ``kiln zoo`` publishes) costs against one storing them at fp32: package
bytes, trusted load to first answer and the device memory the loaded module holds, BERT-base and
OPT-350m (benchmarks/cold_start_zoo.py's COMPILE and LOAD: fresh processes, fresh caches, after
``import torch``; each form compiled on its own). Prints a table, writes one JSON.

    PYTHONPATH=. python benchmarks/probes/probe_weights_memory.py --out $OUT/probe_weights_memory.json

Not run yet: its first H200 call ran past the session's device time (no rows came back).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks._common import print_table
from benchmarks.cold_start_zoo import COMPILE, LOAD, _run, machine

FORMS = {"fp32 weights": {"KILN_BENCH_FP32_WEIGHTS": "1"}, "engine precision": {}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="bert-base,opt-350m")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=400)
    args = parser.parse_args()
    deadline = time.perf_counter() + args.budget_s
    scratch = Path(tempfile.mkdtemp(prefix="probe-weights-"))
    result: dict = {"machine": machine("cuda"), "method": __doc__.split("\n\n")[0], "models": {}}
    for name in args.models.split(","):
        rows = result["models"][name] = {}
        for form, env in FORMS.items():
            package = scratch / f"{name}-{form.replace(' ', '-')}.kiln"
            caches = scratch / f"{name}-{form}"
            built = _run(COMPILE, [name, str(package), "1", "cuda", "0", "0", ""], caches, 300, env)
            row = rows[form] = {"compile_s": built.get("compile_s"), "error": built.get("error")}
            if built.get("error"):
                continue
            row["package_bytes"] = sum(f.stat().st_size for f in package.rglob("*") if f.is_file())
            loads = [
                _run(
                    LOAD, [str(package), "1", "cuda", "", ""], caches, max(deadline - time.perf_counter(), 1)
                )
                for _ in range(args.repeats)
            ]
            row["load_to_first_answer_s"] = [x.get("load_to_first_answer_s") for x in loads]
            row["weights_lap_s"] = [x.get("load_stages_s", {}).get("weights") for x in loads]
            row["device_memory_mb"] = [x.get("device_memory_mb") for x in loads]
            row["errors"] = [x["error"][-500:] for x in loads if "error" in x]
            Path(args.out).write_text(json.dumps(result, indent=1))  # as it goes: a cut run keeps rows
    Path(args.out).write_text(json.dumps(result, indent=1))
    print_table(
        "weights stored at fp32 vs at the engines' precision (trusted loads)",
        ["model", "form", "package MB", "device MB", "to first answer s", "error"],
        [
            [name, form, round((row.get("package_bytes") or 0) / 2**20), row.get("device_memory_mb"),
             row.get("load_to_first_answer_s"), (row.get("error") or "")[-80:]]
            for name, rows in result["models"].items()
            for form, row in rows.items()
        ],
    )  # fmt: skip
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
