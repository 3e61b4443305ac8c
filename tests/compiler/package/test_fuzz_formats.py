"""A format fuzzer in CI: resealed mutations of a package's runtime graph, pytree specs and manifest
load with the original answers or are refused with a typed error, and run, open, import and unpickle
nothing (tests/compiler/package/fuzz_probe.py; benchmarks/fuzz_formats.py runs it longer)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import safetensors.torch
import torch

import compiler
from zoo.models import mlp_with_fallback

ROOT = Path(__file__).resolve().parents[3]
SECONDS = 20  # the CI bound (the issue allows a minute); the benchmark runs for as long as it is told


def fuzz(tmp_path: Path, seconds: float, seed: int, max_rounds: int = 10**6) -> dict:
    """Build a small package with a fallback op between two engines, then fuzz it in a fresh process."""
    case = mlp_with_fallback(width=16)
    program = compiler.export(case.model, case.args, dynamic_shapes=case.dynamic_shapes)
    module = compiler.compile(program, cache=False)
    path = compiler.save(module, tmp_path / "mlp.kiln").path
    x = case.args[0]
    safetensors.torch.save_file({"x": x}, tmp_path / "x.safetensors")
    safetensors.torch.save_file({"y": module(x)}, tmp_path / "y.safetensors")
    config = {
        "package": str(path),
        "input": str(tmp_path / "x.safetensors"),
        "expected": str(tmp_path / "y.safetensors"),
        "root": str(ROOT),
        "scratch": str(tmp_path),
        "seed": seed,
        "seconds": seconds,
        "max_rounds": max_rounds,
        "allowed_modules": ["zoo.models"],
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_SIGNING_KEY", "KILN_ALLOWED_OP_MODULES")}
    env.update(PYTHONPATH=str(ROOT), TMPDIR=str(tmp_path))
    done = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("fuzz_probe.py")),
            str(tmp_path / "config.json"),
            str(tmp_path / "r.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=seconds + 240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((tmp_path / "r.json").read_text())


def test_fuzzed_packages_answer_as_before_or_are_refused_and_touch_nothing(tmp_path):
    torch.manual_seed(0)
    report = fuzz(tmp_path, SECONDS, seed=int(os.environ.get("KILN_FUZZ_SEED", "0")))
    rounds = report["rounds"]
    outcomes = Counter(r["outcome"] for r in rounds)
    bad = [r for r in rounds if r["outcome"] in ("crashed", "hung") or r["violations"]]
    assert not bad, json.dumps(bad[:5], indent=1)
    assert len(rounds) >= 20 and outcomes["refused"] >= 10, outcomes  # the fuzzer really ran
    assert report["control"], "the audit hook saw nothing of the positive control"
