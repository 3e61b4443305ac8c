"""The README's install in a fresh virtual environment: how long it takes, with which pip, which torch
build it got and whether pip backtracked (issue 32's target: <= 180 s on 2 cores, never backtracking).

    python3 -m benchmarks.install_time [--pip own|newest] [--index workplace|pypi] [--no-lock]
                                       [--keep DIR] [--timeout S]

Creates a venv (a temporary folder, or DIR with --keep), optionally upgrades its pip to the newest
release, runs the pip commands of the README's first command there (read from README.md) without pip's
cache and records the run under its scenario name in benchmarks/results/install_time.json, with the
machine.

--index workplace installs as this machine's pip configuration says (torch's CPU build from the local
disk); --index pypi ignores that configuration, as on a machine elsewhere, so torch==2.13.0 is PyPI's
CUDA build with its nvidia-* libraries. --no-lock drops `-c constraints.txt` to see whether
pyproject's lower bounds alone keep pip from backtracking.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import resource
import shlex
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from benchmarks.machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
RESULT = ROOT / "benchmarks" / "results" / "install_time.json"
TARGET_SECONDS = 180
LOCK = ["-c", "constraints.txt"]
# What pip prints when it backtracks (pip 23.2 through 26.x).
BACKTRACKING = re.compile(r"pip is looking at multiple versions of|This is taking longer than usual")
# A distribution file pip fetched or read: its name and version (wheel, wheel metadata or sdist).
FETCHED = re.compile(
    r"(?:Downloading|Using cached|Processing|File was already downloaded)\s+\S*?"
    r"([A-Za-z0-9][A-Za-z0-9._]*?)-(\d[^-\s]*?)(?:-[^\s]*\.whl(?:\.metadata)?|\.tar\.gz|\.zip)\b"
)


def readme_install() -> list[list[str]]:
    """The pip commands of the README's first command (its `kiln zoo` part left out), each without
    pip's cache, as argument lists after ``python3``."""
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("python3 -m pip install"))
    commands = []
    for part in line.split(" && "):
        words = shlex.split(part)
        if words[:4] == ["python3", "-m", "pip", "install"]:
            commands.append([*words[1:4], "--no-cache-dir", *words[4:]])
    return commands


def versions_fetched(log: str) -> dict[str, set[str]]:
    """Every distribution name in pip's log with the versions pip fetched of it: more than one version
    of one name means pip backtracked over it."""
    seen: dict[str, set[str]] = defaultdict(set)
    for name, version in FETCHED.findall(log):
        seen[re.sub(r"[-_.]+", "-", name).lower()].add(version)
    return seen


def pip_environment(index: str) -> dict[str, str]:
    env = dict(os.environ)
    if index == "pypi":
        # No configuration files (no local find-links, extra indexes or constraint file) and no
        # PIP_* variable but the CA bundle: PyPI alone, as on a machine elsewhere.
        env = {k: v for k, v in env.items() if not k.startswith("PIP_") or k == "PIP_CERT"}
        env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _unlocked(command: list[str]) -> list[str]:
    """``command`` without ``-c constraints.txt``."""
    at = next((i for i in range(len(command) - 1) if command[i : i + 2] == LOCK), None)
    return command if at is None else command[:at] + command[at + 2 :]


def run(pip: str, index: str, lock: bool, venv: Path, timeout: float) -> dict:
    env = pip_environment(index)
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    if pip == "newest":
        subprocess.run([python, "-m", "pip", "install", "-q", "-U", "pip"], check=True, env=env)
    pip_version = subprocess.run(
        [python, "-m", "pip", "--version"], capture_output=True, text=True, check=True
    ).stdout.split()[1]
    commands = [c if lock else _unlocked(c) for c in readme_install()]
    load_before = os.getloadavg()[0]
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    returncode: int | None = 0
    log = ""
    for command in commands:
        left = timeout - (time.perf_counter() - start)
        try:
            done = subprocess.run(
                [python, *command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=left
            )
            returncode, log = done.returncode, log + done.stdout + done.stderr
        except subprocess.TimeoutExpired as stopped:
            returncode = None
            log += "".join(
                part.decode(errors="replace") if isinstance(part, bytes) else part or ""
                for part in (stopped.stdout, stopped.stderr)
            )
        if returncode != 0:
            break
    seconds = time.perf_counter() - start
    load_after = os.getloadavg()[0]
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = used.ru_utime + used.ru_stime - children.ru_utime - children.ru_stime
    (venv / "install.log").write_text(log)
    torch = subprocess.run(
        [python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    fetched = versions_fetched(log)
    several = {name: sorted(v) for name, v in fetched.items() if len(v) > 1}
    return {
        "commands": [shlex.join(["python3", *c]) for c in commands],
        "pip": pip_version,
        "index": index,
        "lock": lock,
        "seconds": round(seconds, 1),
        "cpu_seconds": round(cpu, 1),  # pip's user + system time: what a busy machine inflates least
        "timed_out": returncode is None,
        "returncode": returncode,
        "torch": torch or None,
        "backtracking_messages": len(BACKTRACKING.findall(log)),
        "distributions_fetched": len(fetched),
        "several_versions_fetched": several,
        "backtracked": bool(several) or bool(BACKTRACKING.search(log)),
        "within_target": returncode == 0 and seconds <= TARGET_SECONDS,
        # This machine is shared: the 1-minute load average before and after (2 cores).
        "load_average": [round(load_before, 1), round(load_after, 1)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pip", choices=["own", "newest"], default="own")
    parser.add_argument("--index", choices=["workplace", "pypi"], default="workplace")
    parser.add_argument("--no-lock", action="store_true")
    parser.add_argument("--keep", type=Path, help="make the venv here and keep it")
    parser.add_argument("--timeout", type=float, default=3600)
    args = parser.parse_args()
    name = f"pip-{args.pip}_{args.index}" + ("_no-lock" if args.no_lock else "")
    if args.keep:
        result = run(args.pip, args.index, not args.no_lock, args.keep.resolve(), args.timeout)
    else:
        with tempfile.TemporaryDirectory() as scratch:
            result = run(args.pip, args.index, not args.no_lock, Path(scratch) / "v", args.timeout)
    results = json.loads(RESULT.read_text()) if RESULT.exists() else {}
    results = results if "runs" in results else {"runs": {}}
    results.update(
        machine={"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0))},
        python=platform.python_version(),
        target_seconds=TARGET_SECONDS,
    )
    results["runs"][name] = result
    RESULT.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print(json.dumps({name: result}, indent=2))
    sys.exit(0 if result["returncode"] == 0 else 1)


if __name__ == "__main__":
    main()
