"""Cold start, the package's file phase (issue 20 item 3): reading and checking every file a load reads,
plus Inductor's runtime imports, serially (as loads did before) and overlapped (files on worker threads
while the loading thread imports, as ``compiler.load`` does now). Each measurement is a fresh process
(imports cold), the two modes alternate, and the medians are compared side by side.

    python3 benchmarks/load_io.py PACKAGE [--rounds 4]   # PACKAGE: an Inductor package

The result in ``benchmarks/results/load_io_cpu.json`` is for a 12-layer x 384 BERT (``zoo.models.
tiny_bert(num_layers=12, hidden=384, seq_len=32)``, fp16, whole graph, 133 MB) on the 2-core CPU here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks._common import print_table, write_json
from benchmarks.machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
import compiler
from compiler.backends.inductor.backend import warm_inductor_imports
from compiler.package.manifest import PROGRAM, WEIGHTS
from compiler.package.check import checked_manifest, read_verified
path, mode = Path(sys.argv[1]), sys.argv[2]
manifest = checked_manifest(path, verify=True)
rels = [PROGRAM, WEIGHTS, *(r.file for r in manifest.engines.values() if r.file)]
start = time.perf_counter()
if mode == "serial":
    data = [read_verified(path, rel, manifest) for rel in rels]
    warm_inductor_imports()
else:
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(read_verified, path, rel, manifest) for rel in rels]
        warm_inductor_imports()
        data = [f.result() for f in futures]
print(json.dumps({"seconds": time.perf_counter() - start, "bytes": sum(map(len, data))}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()
    seconds: dict[str, list[float]] = {"serial": [], "overlapped": []}
    size = 0
    for _ in range(args.rounds):
        for mode in seconds:
            done = subprocess.run(
                [sys.executable, "-c", CHILD, args.package, mode],
                capture_output=True,
                text=True,
                check=True,
                cwd=ROOT,
            )
            result = json.loads(done.stdout.strip().splitlines()[-1])
            seconds[mode].append(round(result["seconds"], 3))
            size = result["bytes"]
    medians = {mode: statistics.median(values) for mode, values in seconds.items()}
    print_table(
        f"package files read + checked, Inductor imports ({size / 1e6:.0f} MB), s",
        ["mode", "median", "runs"],
        [[mode, medians[mode], values] for mode, values in seconds.items()],
    )
    write_json(
        "load_io_cpu",
        {
            "cpu": cpu_model(),
            "package_bytes": size,
            "seconds": seconds,
            "median_s": medians,
            "overlapped_over_serial": round(medians["overlapped"] / medians["serial"], 3),
        },
    )


if __name__ == "__main__":
    main()
