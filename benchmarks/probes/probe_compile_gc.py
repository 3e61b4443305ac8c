"""Probe (issue 45): how much of an Inductor compile on the GPU host is CPython's cyclic collector, and what
do the kiln CLI's thresholds (10000, 10, 10; flows/cli/__init__.py) save there?

benchmarks/cold_start_zoo.py's COMPILE of each model, default (AOTInductor) and standalone (``aot: false``,
what an untrusted load compiles), each in a fresh process with fresh caches, once at CPython's default
thresholds (700, 10, 10) and once at kiln's, in alternating order; the collector's seconds are counted
with ``gc.callbacks``. Prints a table, writes one JSON.

    PYTHONPATH=. python benchmarks/probes/probe_compile_gc.py --out $OUT/probe_compile_gc.json

On the H200 (probe_compile_gc.h200.json, one run each): the collector took 2.8-3.3 s of compiles of
17-37 s at the default thresholds and 1.1-1.4 s at kiln's, but the compiles themselves moved more than
that between runs (BERT-base standalone 17.7 -> 15.2 s, ViT-base standalone 24.5 -> 26.9 s; the default
compiles 26.8 -> 28.9 s and 36.8 -> 37.9 s). No gain measurable above the noise: the library's compile
and load paths keep CPython's thresholds; only the CLI (a batch process) sets its own.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.cold_start_zoo import COMPILE, _run, machine

HEAD = "import json, os, sys, time\n"
GC = HEAD + (
    "import gc\n"
    "if os.environ['PROBE_GC'] != 'default':\n"
    "    gc.set_threshold(*map(int, os.environ['PROBE_GC'].split(',')))\n"
    "_gc = {'s': 0.0, 'n': [0, 0, 0], 't': 0.0}\n"
    "def _count(phase, info):\n"
    "    if phase == 'start':\n"
    "        _gc['t'] = time.process_time()\n"
    "    else:\n"
    "        _gc['s'] += time.process_time() - _gc['t']\n"
    "        _gc['n'][info['generation']] += 1\n"
    "gc.callbacks.append(_count)\n"
)
OUT = 'print(json.dumps({\n    "compile_s"'
OUT_GC = 'print(json.dumps({\n    "gc_s": round(_gc["s"], 2), "gc_collections": _gc["n"], "compile_s"'


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default="bert-base,vit-base")
    parser.add_argument("--budget-s", type=float, default=500)
    args = parser.parse_args()
    assert COMPILE.startswith("\n" + HEAD) and OUT in COMPILE
    script = COMPILE.replace(HEAD, GC, 1).replace(OUT, OUT_GC, 1)
    deadline = time.perf_counter() + args.budget_s
    scratch = Path(tempfile.mkdtemp(prefix="probe-gc-"))
    result = {"machine": machine("cuda"), "method": __doc__, "models": {}}
    # untimed: the machine's first compile pays for loading CUDA, Triton and the compilers' pages
    _run(script, ["bert-base", str(scratch / "warm.kiln"), "0", "cuda", "1", "0", ""], scratch / "warm", 120,
         {"PROBE_GC": "default"})  # fmt: skip
    for name in args.models.split(","):
        rows = result["models"][name] = {}
        for aot in ("0", "1"):
            for gc_setting in ("default", "10000,10,10") if aot == "0" else ("10000,10,10", "default"):
                if time.perf_counter() > deadline:
                    break
                key = f"{'default' if aot == '1' else 'standalone'} compile, gc {gc_setting}"
                tag = f"{name}-{aot}-{gc_setting}"
                argv = [name, str(scratch / f"{tag}.kiln"), aot, "cuda", "0", "0", ""]
                run = _run(script, argv, scratch / tag, 200, {"PROBE_GC": gc_setting})
                fields = ("compile_s", "gc_s", "gc_collections", "process_s", "error")
                rows[key] = {k: run.get(k) for k in fields}
                print(f"{name:10} {key:40} {rows[key]['compile_s']} s, gc {rows[key]['gc_s']} s", flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
