"""Probe (issue 34): the AOTInductor wrapper's optimization level on CUDA, compile time against call time.

The C++ compile of a CUDA package's wrapper (host glue that launches Triton's kernels) was 12 s of a GPT-2
package build on the H200 host (probe_aot_cost.h200.json). Inductor compiles its main function at
``aot_inductor.compile_wrapper_opt_level`` (``O1``; ``$AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL``). For each
level, in fresh processes with empty caches: the default GPT-2 package's compile (as
``benchmarks/gpu_cold_start_default.py`` compiles it), then a load and the median call at batch 1 and 8,
with CUDA graphs off (every call runs the wrapper) and on (replays skip it).

    python3 benchmarks/probes/probe_aot_wrapper_opt.py OUT.json [--levels O1,O0]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_cold_start_default import MODEL, compile_fresh  # noqa: E402
from benchmarks.machine import gpu_machine  # noqa: E402

CALLS = r"""
import json, statistics, sys, time
import torch
import compiler
out = {}
for graphs in ("off", "on"):
    m = compiler.load(sys.argv[1], trust_engine_code=True, cuda_graphs=graphs)
    for batch in (1, 8):
        ids = torch.randint(0, 50257, (batch, 128), device="cuda")
        times = []
        with torch.no_grad():
            for i in range(60):
                torch.cuda.synchronize()
                start = time.perf_counter()
                m(ids)
                torch.cuda.synchronize()
                if i >= 10:
                    times.append(time.perf_counter() - start)
        out[f"graphs_{graphs}_batch{batch}_ms"] = round(statistics.median(times) * 1000, 3)
    out["dispatch"] = sorted(set(m.last_dispatch().values()))
print(json.dumps(out))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--levels", default="O1,O0")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="kiln-wrapper-opt-"))
    result: dict = {
        "machine": gpu_machine(),
        "model": MODEL,
        "method": __doc__.split("\n\n")[2].replace("\n", " "),
        "levels": {},
    }
    for level in args.levels.split(","):
        os.environ["AOT_INDUCTOR_COMPILE_WRAPPER_OPT_LEVEL"] = level
        package = scratch / f"{level}.kiln"
        row = compile_fresh(package, True, scratch / f"caches-{level}")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            [sys.executable, "-c", CALLS, str(package)], capture_output=True, text=True, env=env, timeout=300
        )
        row |= (
            json.loads(done.stdout.strip().splitlines()[-1])
            if done.returncode == 0
            else {"error": done.stderr[-2000:]}
        )
        result["levels"][level] = row
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(level, json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
