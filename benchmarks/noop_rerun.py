"""Re-running an unchanged zoo: its fixed cost and what each model adds (issue 12: <= 1 s per model;
issue 21: <= 5 s fixed).

Compiles the example zoo once into a temporary workspace and output directory, then times, side by side
and alternating (machines are noisy), fresh processes:

* ``start``: the process start alone (``python -m flows.cli --help``: Python, typer and the CLI);
* ``noop``: ``kiln zoo deploy/zoo.yaml`` again with nothing changed (all N models);
* ``noop_one``: the same zoo cut to its first model, also unchanged (same workspace and output);
* ``touched`` (once, last): the zoo after one model's factory kwargs changed, so that model compiles again.

Per-model no-op cost beyond the start = (noop - start) / N. What each further model adds = (noop -
noop_one) / (N - 1), so the fixed cost, paid once whatever the zoo's size (imports, the zoo file, the
summary) = noop_one - that. Prints a table and writes benchmarks/results/noop_rerun.json.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks._common import print_table, write_json

ROOT = Path(__file__).resolve().parents[1]
RUNS = int(os.environ.get("KILN_BENCH_RUNS", "3"))


def _timed(args: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr[-3000:]}")
    return seconds


def main() -> None:
    tmp = Path(tempfile.mkdtemp(prefix="kiln-noop-"))
    zoo = yaml.safe_load((ROOT / "deploy" / "zoo.yaml").read_text())
    zoo["settings"].update(workspace=str(tmp / "ws"), engine_cache=str(tmp / "cache"), tracking=False)
    zoo_file = tmp / "zoo.yaml"
    zoo_file.write_text(yaml.safe_dump(zoo))
    one_file = tmp / "zoo-one.yaml"
    one_file.write_text(yaml.safe_dump({**zoo, "models": zoo["models"][:1]}))
    models = len(zoo["models"])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    kiln = [sys.executable, "-m", "flows.cli"]
    zoo_cmd = [*kiln, "zoo", str(zoo_file), "--out", str(tmp / "out")]
    one_cmd = [*kiln, "zoo", str(one_file), "--out", str(tmp / "out")]
    first = _timed(zoo_cmd, env)
    times: dict[str, list[float]] = {"start": [], "noop": [], "noop_one": []}
    for _ in range(RUNS):
        times["start"].append(_timed([*kiln, "--help"], env))
        times["noop"].append(_timed(zoo_cmd, env))
        times["noop_one"].append(_timed(one_cmd, env))
    # One model changed: only it runs again (its stages, engines from the cache).
    zoo["models"][-1]["factory_kwargs"] = {"width": 48}
    zoo_file.write_text(yaml.safe_dump(zoo))
    touched = _timed(zoo_cmd, env)
    start, noop, one = (statistics.median(times[k]) for k in ("start", "noop", "noop_one"))
    per_model = (noop - start) / models
    marginal = (noop - one) / (models - 1)
    fixed = one - marginal
    rows = [
        ["first run (compile all)", f"{first:.2f}", ""],
        ["process start (kiln --help)", f"{start:.2f}", ""],
        ["no-op re-run", f"{noop:.2f}", f"{per_model:.3f} s/model beyond start"],
        ["no-op re-run, first model only", f"{one:.2f}", f"{marginal:.3f} s per further model"],
        ["no-op fixed cost", f"{fixed:.2f}", "target 5 s"],
        ["one model changed", f"{touched:.2f}", ""],
    ]
    print_table(f"Unchanged zoo re-run ({models} models, median of {RUNS})", ["run", "seconds", "note"], rows)
    write_json(
        "noop_rerun",
        {
            "models": models,
            "runs": RUNS,
            "first_run_s": first,
            "process_start_s": times["start"],
            "noop_s": times["noop"],
            "one_changed_s": touched,
            "noop_per_model_beyond_start_s": per_model,
            "target_per_model_s": 1.0,
            "met": per_model <= 1.0,
            "noop_one_model_s": times["noop_one"],
            "noop_per_further_model_s": marginal,
            "noop_fixed_s": fixed,
            "target_fixed_s": 5.0,
            "met_fixed": fixed <= 5.0,
        },
    )


if __name__ == "__main__":
    main()
