"""Start-up costs of the ``kiln`` CLI next to ``python -c "import torch"`` (issue 21).

Times fresh processes, interleaved round after round (the machine is shared and noisy), and reports
the median wall time and CPU time (user + system) of each:

* ``python``: the interpreter alone; ``import torch``: the yardstick;
* ``kiln --help`` (target 1 s): typer and rich only;
* ``kiln versions`` (target 4 s) and ``kiln lookup`` of a model that is not registered (loads nothing;
  target 4 s): MLflow and its sqlite store, no torch;
* the no-op re-run of a one-model zoo (target 5 s fixed cost): the zoo file, a hash and a manifest read,
  then the registered-versions table; no Prefect.

Setup (not timed): compile that zoo once into a temporary folder with tracking on. Prints a table and
writes benchmarks/results/startup.json (CPU model, medians, ratios to ``import torch``, targets).
"""

from __future__ import annotations

import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script (README): python3 benchmarks/startup.py

from benchmarks.machine import cpu_model  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
RUNS = int(os.environ.get("KILN_BENCH_RUNS", "5"))
TARGETS = {"kiln --help": 1.0, "kiln versions": 4.0, "kiln lookup (no match)": 4.0, "no-op zoo re-run": 5.0}


def timed(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one fresh process; a failure stops the benchmark with its output."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if proc.returncode not in (0, 1):  # lookup of an unregistered model exits 1 by design
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return wall, cpu


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kiln-startup-"))
    zoo = {
        "settings": {
            "workspace": str(tmp / "ws"),
            "engine_cache": str(tmp / "cache"),
            "tracking": True,
            "validation": {"samples": 2, "warmup": 1, "runs": 3},
        },
        "models": [{"name": "mlp", "factory": "zoo.models:mlp_with_fallback"}],
    }
    zoo_file = tmp / "zoo.yaml"
    zoo_file.write_text(json.dumps(zoo))  # JSON is YAML
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp / 'mlflow.db'}"}
    kiln = [sys.executable, "-m", "flows.cli"]
    zoo_cmd = [*kiln, "zoo", str(zoo_file), "--out", str(tmp / "out")]
    timed(zoo_cmd, tmp, env)  # the first run compiles and registers; not timed
    commands = {
        "python": [sys.executable, "-c", "pass"],
        "import torch": [sys.executable, "-c", "import torch"],
        "kiln --help": [*kiln, "--help"],
        "kiln versions": [*kiln, "versions"],
        "kiln lookup (no match)": [*kiln, "lookup", "not-registered", "--shape", "4,64"],
        "no-op zoo re-run": zoo_cmd,
    }
    samples: dict[str, dict[str, list[float]]] = {name: {"wall": [], "cpu": []} for name in commands}
    for _ in range(RUNS):
        for name, args in commands.items():
            wall, cpu = timed(args, tmp, env)
            samples[name]["wall"].append(wall)
            samples[name]["cpu"].append(cpu)
    median = {name: {k: statistics.median(v) for k, v in s.items()} for name, s in samples.items()}
    torch_wall, torch_cpu = median["import torch"]["wall"], median["import torch"]["cpu"]
    rows, results = [], {}
    for name, m in median.items():
        target = TARGETS.get(name)
        results[name] = {
            "wall_s": samples[name]["wall"],
            "cpu_s": samples[name]["cpu"],
            "median_wall_s": m["wall"],
            "median_cpu_s": m["cpu"],
            "wall_vs_import_torch": m["wall"] / torch_wall,
            "cpu_vs_import_torch": m["cpu"] / torch_cpu,
            "target_s": target,
        }
        rows.append(
            f"{name:<24} {m['wall']:>7.2f} {m['cpu']:>7.2f} {m['wall'] / torch_wall:>7.2f}x "
            f"{m['cpu'] / torch_cpu:>7.2f}x {'' if target is None else f'{target:.0f} s'}"
        )
    load = os.getloadavg()[0]
    print(f"\nkiln start-up, median of {RUNS} interleaved runs ({cpu_model()}, load {load:.1f})")
    print(f"{'command':<24} {'wall s':>7} {'cpu s':>7} {'wall/t':>8} {'cpu/t':>8} target")
    print("\n".join(rows))
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / "startup.json"
    payload = {
        "machine": {
            "cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "load_average_1m_at_end": load,
        },
        "runs": RUNS,
        "note": "t = python -c 'import torch'; cpu = user + system time of the process (less sensitive "
        "than wall time to other work on a shared machine)",
        "commands": results,
    }
    path.write_text(json.dumps(payload, indent=2, sort_keys=True))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
