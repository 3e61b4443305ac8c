"""The README's install in a fresh virtual environment: how long it takes, with which pip, and whether
pip backtracked (issue 32's target: <= 180 s on 2 cores, never backtracking).

    python3 -m benchmarks.install_time [--upgrade-pip] [--keep]

Creates a venv in a temporary folder, runs the README's first install command there with that venv's
own pip (or, with --upgrade-pip, the newest pip), without pip's cache, and writes
benchmarks/results/install_time[_newest_pip].json naming the machine.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COMMAND = ["-m", "pip", "install", "--no-cache-dir", "torch==2.13.0", "-c", "constraints.txt", "-e", ".[dev]"]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upgrade-pip", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        python = str(Path(scratch) / "v" / "bin" / "python")
        subprocess.run([sys.executable, "-m", "venv", str(Path(scratch) / "v")], check=True)
        if args.upgrade_pip:
            subprocess.run([python, "-m", "pip", "install", "-q", "-U", "pip"], check=True)
        pip = subprocess.run(
            [python, "-m", "pip", "--version"], capture_output=True, text=True
        ).stdout.split()[1]
        start = time.perf_counter()
        done = subprocess.run([python, *COMMAND], cwd=ROOT, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        torch = subprocess.run(
            [python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
        ).stdout.strip()
    collected = Counter(re.findall(r"^Collecting (\S+?)(?:[=<>!~\[ ]|$)", done.stdout, re.M))
    result = {
        "machine": {"cpu": cpu_model(), "cores": len(__import__("os").sched_getaffinity(0))},
        "python": platform.python_version(),
        "pip": pip,
        "seconds": round(seconds, 1),
        "target_seconds": 180,
        "returncode": done.returncode,
        "torch": torch,
        "backtracked": any(n > 1 for n in collected.values()) or "backtracking" in done.stdout + done.stderr,
        "packages_collected": len(collected),
    }
    name = "install_time_newest_pip" if args.upgrade_pip else "install_time"
    out = ROOT / "benchmarks" / "results" / f"{name}.json"
    out.write_text(json.dumps(result, indent=2, sort_keys=True))
    print(json.dumps(result, indent=2))
    sys.exit(0 if done.returncode == 0 else 1)


if __name__ == "__main__":
    main()
