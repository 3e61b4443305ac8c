"""The format fuzzer of tests/compiler/package/test_fuzz_formats.py, run for longer: resealed mutations of
a package's runtime graph, pytree specs and manifest, each loaded untrusted under an audit hook in a fresh
process.

    python -m benchmarks.fuzz_formats --seconds 600 --seed 7

Prints the outcomes as a table and writes benchmarks/results/fuzz_formats.json (machine named); exits
1 if any round crashed, hung or touched anything outside its package.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

from benchmarks._common import print_table, write_json
from benchmarks.machine import cpu_model
from tests.compiler.package.test_fuzz_formats import fuzz


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        report = fuzz(Path(scratch), args.seconds, args.seed)
    rounds = report["rounds"]
    outcomes = Counter(r["outcome"] for r in rounds)
    bad = [r for r in rounds if r["outcome"] in ("crashed", "hung") or r["violations"]]
    print_table("format fuzzer", ["outcome", "rounds"], sorted(outcomes.items()))
    write_json(
        "fuzz_formats",
        {
            "cpu": cpu_model(),
            "seconds": args.seconds,
            "seed": args.seed,
            "outcomes": outcomes,
            "bad": bad[:20],
        },
    )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
