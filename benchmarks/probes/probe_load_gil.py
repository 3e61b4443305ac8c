"""Probe (issue 45): does the trusted load's weights lap lose to the GIL while transformers imports beside
it, and do larger read chunks or a shorter switch interval win it back?

The default package of BERT-base and OPT-350m (benchmarks/cold_start_zoo.py's COMPILE), then its LOAD to
first answer (a fresh process, after ``import torch``; the output types' import runs on a thread beside
the load, as by default) with the weights read in chunks of 16 MiB (kiln's), 64 MiB and 256 MiB, each
under Python's default switch interval (5 ms) and 0.5 ms. Prints a table, writes one JSON.

    PYTHONPATH=. python benchmarks/probes/probe_load_gil.py --out $OUT/probe_load_gil.json

On the H200 (probe_load_gil.h200.json, 2 runs each): no variant beat the default; the weights lap stayed
0.8-1.6 s beside the import whatever the chunk, and 0.5 ms made the load slower (2.3-3.6 s). Ruled out.
The import itself bounds the first answer there: ``import transformers.modeling_outputs`` after torch
took 1.62-1.64 s in three fresh processes on that host (``-X importtime``: ``transformers.utils`` 1.1 s,
its ``import_utils`` 0.69 s), so a BERT's ModelOutput cannot come back sooner from a process that has not
imported transformers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.cold_start_zoo import COMPILE, LOAD, _run, machine

MARK = "    import compiler  # inside the timed region: compiler.load's own imports are the load's\n"
PATCH = MARK + (
    "    import functools, compiler.package.save_load as _sl, compiler.package.weights_file as _wf\n"
    "    _sl.read_weights = functools.partial(_wf.read_weights, chunk_bytes=int(os.environ['PROBE_CHUNK']))\n"
    "    sys.setswitchinterval(float(os.environ['PROBE_SWITCH']))\n"
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="bert-base,opt-350m")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=500)
    args = parser.parse_args()
    assert MARK in LOAD
    script = LOAD.replace(MARK, PATCH)
    deadline = time.perf_counter() + args.budget_s
    scratch = Path(tempfile.mkdtemp(prefix="probe-gil-"))
    result = {"machine": machine("cuda"), "models": {}}
    for name in args.models.split(","):
        package = scratch / f"{name}.kiln"
        built = _run(COMPILE, [name, str(package), "1", "cuda", "0", "0", ""], scratch / name, 300)
        rows = result["models"][name] = {"compile": {k: built.get(k) for k in ("compile_s", "error")}}
        if "error" in built:
            continue
        for chunk in (16 << 20, 64 << 20, 256 << 20):
            for switch in (0.005, 0.0005):
                runs = []
                for _ in range(args.repeats):
                    if time.perf_counter() > deadline:
                        break
                    env = {"PROBE_CHUNK": str(chunk), "PROBE_SWITCH": str(switch)}
                    argv = [str(package), "1", "cuda", "", ""]
                    runs.append(_run(script, argv, scratch / f"{name}-load", 60, env))
                ok = [r for r in runs if "error" not in r]
                key = f"chunk {chunk >> 20} MiB, switch {switch * 1e3:g} ms"
                rows[key] = {
                    "load_to_first_answer_s": [r["load_to_first_answer_s"] for r in ok],
                    "median_s": statistics.median([r["load_to_first_answer_s"] for r in ok]) if ok else None,
                    "load_stages_s": [r["load_stages_s"] for r in ok],
                    "errors": [r["error"][-500:] for r in runs if "error" in r],
                }
                print(f"{name:10} {key:30} {rows[key]['median_s']}", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
