"""Whether an engine cache written by one checkout of kiln stays warm for another (issue 35).

Compiles a fixed model (two repeated blocks; ONNX Runtime fp32, fp16 and split per block, and Inductor)
into the engine cache at ``--cache`` and prints, per compile, the engine-cache keys and how many
engines were built. Run it first from the old checkout, then from the new one against the same cache:
the second run's keys equal the first's and it builds nothing.

    (cd old-checkout && PYTHONPATH=$PWD python benchmarks/warm_cache.py --cache /tmp/c --json > before.json)
    PYTHONPATH=$PWD python benchmarks/warm_cache.py --cache /tmp/c --json > after.json

``--label NAME`` also records this run under NAME in benchmarks/results/warm_cache.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script

import compiler  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402

COMPILES = {
    "onnxruntime": {"backend": "onnxruntime"},
    "onnxruntime split": {"backend": "onnxruntime", "split_modules": "auto"},
    "onnxruntime fp16": {"backend": "onnxruntime", "precision": "fp16"},
    "inductor": {"backend": "inductor"},
}


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList([Block(), Block()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.sigmoid()


def run(cache_dir: Path) -> dict[str, dict]:
    torch.manual_seed(0)
    program = compiler.export(Model().eval(), (torch.randn(2, 8),))
    results = {}
    for name, settings in COMPILES.items():
        cache = compiler.EngineCache(cache_dir / name.replace(" ", "-"))
        module = compiler.compile(program, cache=cache, **settings)
        results[name] = {
            "keys": sorted(a.cache_key for a in module.engines.values()),
            "builds": cache.stats.builds,
        }
    return results


def machine() -> dict:
    """The machine the runs were recorded on (keys and build counts do not depend on it; the record says
    where they were seen)."""
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "gpu": None, "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cache", type=Path, required=True, help="the engine cache folder, kept between runs"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--label", help="record this run under LABEL in benchmarks/results/warm_cache.json")
    args = parser.parse_args(argv)
    results = run(args.cache)
    if args.json:
        print(json.dumps(results, indent=1))
    else:
        for name, result in results.items():
            print(f"{name:20} builds {result['builds']}  keys {' '.join(k[:12] for k in result['keys'])}")
    if args.label:
        path = ROOT / "benchmarks" / "results" / "warm_cache.json"
        recorded = json.loads(path.read_text()) if path.exists() else {}
        recorded[args.label] = results
        recorded["machine"] = machine()
        path.write_text(json.dumps(recorded, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
