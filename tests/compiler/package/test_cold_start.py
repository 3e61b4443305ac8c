"""A trusted load of a default-form Inductor package (its engines AOTInductor packages) compiles
nothing and says where its seconds went; an untrusted first load compiles each repeated block once
(issue 45). Functional only: the seconds themselves are benchmarks/cold_start_zoo.py's (on the GPU),
never asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.export import Dim

import compiler
from tests.fixtures.block_stack import BlockStack

ROOT = Path(__file__).resolve().parents[3]
STAGES = ("manifest", "imports", "modules", "program_check", "runtime_graph", "weights", "plan", "engines")


@pytest.fixture(scope="module")
def aot_package(tmp_path_factory) -> Path:
    """The CPU form of the default GPU package: one engine, its AOTInductor package."""
    torch.manual_seed(0)
    model = BlockStack((32,) * 6).eval()
    x = torch.randn(4, 12)
    program = compiler.export(model, (x,), dynamic_shapes=({0: Dim("batch", min=1, max=16)},))
    module = compiler.compile(program, backend="inductor", backend_options={"aot": True}, cache=False)
    path = tmp_path_factory.mktemp("cold") / "stack.kiln"
    compiler.save(module, path)
    torch.save({"x": x, "y": model(x).detach()}, path.parent / "io.pt")
    return path


def _fresh_load(package: Path, trusted: bool, caches: dict) -> dict:
    """``compiler.load`` and a first answer in a fresh process; a native build it started is stopped
    (its completion and the loads after it are tests/backends/inductor/test_inductor_aot.py's)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **{k: str(v) for k, v in caches.items()}}
    code = f"""
        import json, os, sys, warnings, torch, compiler
        data = torch.load({str(package.parent / "io.pt")!r})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = compiler.load({str(package)!r}, trust_engine_code={trusted})
            with torch.no_grad():
                out = module(data["x"])
        print(json.dumps({{
            "close": torch.allclose(out, data["y"], rtol=1e-4, atol=1e-5),
            "dispatch": sorted(set(module.last_dispatch().values())),
            "imported": [m for m in ("torch._inductor.compile_fx", "torch._dynamo", "sympy", "triton")
                         if m in sys.modules],
            "warnings": [str(w.message) for w in caught if "compil" in str(w.message)],
            "stages": module.load_seconds,
            # the worker leads its own session: its compiler processes stop with it
            "native_builds": [(os.killpg(b.process.pid, 9), b.wait(60))[1] for b in module.native_builds()],
        }}))
        """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=900
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_trusted_load_compiles_nothing_and_has_its_stage_split(aot_package, tmp_path):
    # Fresh compiler caches: anything a load compiled (Inductor's code cache, kernels, a local engine)
    # would be written into them.
    caches = {"TORCHINDUCTOR_CACHE_DIR": tmp_path / "inductor", "KILN_CACHE_DIR": tmp_path / "engines"}
    result = _fresh_load(aot_package, True, caches)
    assert result["close"] and result["dispatch"] == ["aot"], result
    # Nothing of a compiler imported, nothing compiled (warned), nothing written into the caches.
    assert result["imported"] == [] and result["warnings"] == [], result
    written = [str(p) for d in caches.values() if d.exists() for p in d.rglob("*") if p.is_file()]
    assert written == [], written
    stages = result["stages"]
    assert set(STAGES) <= set(stages) and {"warmup", "total"} <= set(stages), stages
    assert all(v >= 0 for v in stages.values()), stages
    # The laps partition the load: together they are its total (rounding aside).
    assert abs(sum(v for k, v in stages.items() if k != "total") - stages["total"]) < 0.05, stages


def test_an_untrusted_first_load_compiles_each_repeated_block_once(aot_package, tmp_path):
    """Its package's native code never runs: the engine is compiled here from its program, cut at the
    repeated block's boundaries (six blocks, each followed by a projection: four distinct pieces to
    compile, the input layer, one block, one projection and the output projection), while this
    machine's own native package is built for the loads after it (started, then stopped by the test)."""
    caches = {"TORCHINDUCTOR_CACHE_DIR": tmp_path / "inductor", "KILN_CACHE_DIR": tmp_path / "engines"}
    first = _fresh_load(aot_package, False, caches)
    assert first["close"] and first["dispatch"] == ["blocks"], first
    assert any("not trusted to run code" in w for w in first["warnings"]), first["warnings"]
    assert first["native_builds"] == [-9], first  # one build started (killed above)
