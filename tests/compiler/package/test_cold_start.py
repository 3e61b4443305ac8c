"""A trusted load of a default-form Inductor package (its engines AOTInductor packages) compiles
nothing and says where its seconds went (issue 45). Functional only: the seconds themselves are
benchmarks/cold_start_zoo.py's (on the GPU), never asserted here."""

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

ROOT = Path(__file__).resolve().parents[3]
STAGES = ("manifest", "imports", "modules", "program_check", "runtime_graph", "weights", "plan", "engines")


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(12, 32), torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


@pytest.fixture(scope="module")
def aot_package(tmp_path_factory) -> Path:
    """The CPU form of the default GPU package: one engine, its AOTInductor package."""
    torch.manual_seed(0)
    model = _Mlp().eval()
    x = torch.randn(4, 12)
    program = compiler.export(model, (x,), dynamic_shapes=({0: Dim("batch", min=1, max=16)},))
    module = compiler.compile(program, backend="inductor", backend_options={"aot": True}, cache=False)
    path = tmp_path_factory.mktemp("cold") / "mlp.kiln"
    compiler.save(module, path)
    torch.save({"x": x, "y": model(x).detach()}, path.parent / "io.pt")
    return path


def test_a_trusted_load_compiles_nothing_and_has_its_stage_split(aot_package, tmp_path):
    # Fresh compiler caches: anything a load compiled (Inductor's code cache, kernels, a local engine)
    # would be written into them.
    caches = {"TORCHINDUCTOR_CACHE_DIR": tmp_path / "inductor", "KILN_CACHE_DIR": tmp_path / "engines"}
    env = {**os.environ, "PYTHONPATH": str(ROOT), **{k: str(v) for k, v in caches.items()}}
    code = f"""
        import json, sys, warnings, torch, compiler
        data = torch.load({str(aot_package.parent / "io.pt")!r})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            module = compiler.load({str(aot_package)!r}, trust_engine_code=True)
            with torch.no_grad():
                out = module(data["x"])
        print(json.dumps({{
            "close": torch.allclose(out, data["y"], rtol=1e-4, atol=1e-5),
            "dispatch": sorted(set(module.last_dispatch().values())),
            "imported": [m for m in ("torch._inductor.compile_fx", "torch._dynamo", "sympy", "triton")
                         if m in sys.modules],
            "warnings": [str(w.message) for w in caught if "compil" in str(w.message)],
            "stages": module.load_seconds,
        }}))
        """
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
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
