"""What verifying a package's signature adds to a load (issue 34: a trusted load is a signed one).

model-signing's verification hashes every file of the package, as the load's own checksum checks do. A
load now verifies the signature on a thread of its own beside its file reads and waits for the verdict
before it acts on anything the package holds; before, the signature was verified first, then the files
were read. Measured: fresh-process ``compiler.load`` of one package, unsigned (no key set) and signed
(``$KILN_SIGNING_PUBLIC_KEY`` set), alternating, medians; with ``--before ROOT`` the signed load of the
same package by another kiln checkout (an earlier commit) joins the rounds, side by side.

The package: an MLP of 24 layers of 2048 x 2048 (fp32, 400 MB of weights) compiled with ONNX Runtime,
whose engine holds its weights too (about 800 MB in all), on the CPU.

    python3 benchmarks/signed_load.py [--rounds 5] [--before /path/to/older/kiln]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks._common import print_table, write_json  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402

CHILD = r"""
import json, sys, time
start = time.perf_counter()
import torch, compiler
imports = time.perf_counter() - start
start = time.perf_counter()
module = compiler.load(sys.argv[1])
load_s = time.perf_counter() - start
with torch.no_grad():
    module(torch.randn(4, 2048))
print(json.dumps({"load_s": load_s, "stages": module.load_seconds, "trusted": module.trust_engine_code}))
"""


def build(directory: Path) -> tuple[Path, Path, Path]:
    """(signed package, unsigned package, public key)."""
    import torch

    import compiler
    from tests.fixtures.signing_keys import ec_key_pair  # the suite's own P-256 key pair writer

    key = ec_key_pair(directory, "key")
    private, public = key.private, key.public
    torch.manual_seed(0)
    layers = [m for _ in range(24) for m in (torch.nn.Linear(2048, 2048), torch.nn.ReLU())]
    model = torch.nn.Sequential(*layers).eval()
    program = compiler.export(model, (torch.randn(4, 2048),))
    compiled = compiler.compile(program, backend="onnxruntime", cache=False)
    unsigned = compiler.save(compiled, directory / "unsigned.kiln").path
    os.environ["KILN_SIGNING_PRIVATE_KEY"] = str(private)
    signed = compiler.save(compiled, directory / "signed.kiln").path
    del os.environ["KILN_SIGNING_PRIVATE_KEY"]
    return signed, unsigned, public


def load(root: Path, package: Path, public: Path | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_SIGNING")}
    env["PYTHONPATH"] = str(root)
    if public is not None:
        env["KILN_SIGNING_PUBLIC_KEY"] = str(public)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(package)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", type=Path, help="another kiln checkout: its signed load beside")
    args = parser.parse_args()
    scratch = Path(tempfile.mkdtemp(prefix="kiln-signed-load-"))
    signed, unsigned, public = build(scratch)
    size = sum(f.stat().st_size for f in signed.rglob("*") if f.is_file())
    modes = {"unsigned": (ROOT, unsigned, None), "signed": (ROOT, signed, public)}
    if args.before:
        modes["signed, before"] = (args.before, signed, public)
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(args.rounds):
        for mode, (root, package, key) in modes.items():
            runs[mode].append(load(root, package, key))
    medians = {mode: round(statistics.median(r["load_s"] for r in rows), 3) for mode, rows in runs.items()}
    overhead = {mode: round(medians[mode] - medians["unsigned"], 3) for mode in medians if mode != "unsigned"}
    print_table(
        f"compiler.load in a fresh process ({size / 1e6:.0f} MB package, ONNX Runtime, CPU), s",
        ["mode", "median load", "over unsigned", "trusted"],
        [[m, medians[m], overhead.get(m, 0.0), runs[m][0]["trusted"]] for m in modes],
    )
    write_json(
        "signed_load_cpu",
        {
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "package_bytes": size,
            "rounds": args.rounds,
            "median_load_s": medians,
            "signature_overhead_s": overhead,
            "stages": {mode: rows[len(rows) // 2]["stages"] for mode, rows in runs.items()},
            "method": __doc__.split("\n\n")[1].replace("\n", " "),
        },
    )


if __name__ == "__main__":
    main()
