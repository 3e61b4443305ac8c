"""Inductor engines with AOTInductor packages (``backend_options: {aot: true}``): built beside the
standalone graph and checked in a fresh process at build, loaded natively where trusted (no Inductor,
no Triton imported), never run where not trusted, left out with a warning where they cannot be built."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch
from torch.export import Dim

import compiler
from compiler.backends.inductor.aot import _check_in_fresh_process
from compiler.backends.inductor.format import AOT, HEADER
from compiler.errors import BuildSettingsError
from tests.fixtures.signing_keys import ec_key_pair

ROOT = Path(__file__).resolve().parents[3]


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(12, 24), torch.nn.Linear(24, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc2(torch.relu(self.fc1(x))))


def _program(device: str = "cpu") -> tuple[torch.nn.Module, torch.export.ExportedProgram]:
    torch.manual_seed(0)
    model = _Mlp().eval().to(device)
    x = torch.randn(4, 12, device=device)
    return model, compiler.export(model, (x,), dynamic_shapes=({0: Dim("batch", min=1, max=16)},))


@pytest.fixture(scope="module")
def program():
    return _program()


def _engine_files(module: compiler.CompiledModule) -> dict[str, bytes]:
    (artifact,) = [a for a in module.engines.values() if a.engine]
    with zipfile.ZipFile(io.BytesIO(artifact.engine)) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def _fresh_load(package: Path, env: dict, device: str = "cpu") -> dict:
    code = textwrap.dedent(
        f"""
        import json, sys, warnings, torch, compiler
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = compiler.load({str(package)!r})
            for _ in range(2):  # the second round replays what the first captured (CUDA)
                torch.manual_seed(1)
                outs = {{b: m(torch.randn(b, 12).to({device!r})).tolist() for b in (1, 3, 16)}}
        print(json.dumps({{
            "dispatch": m.last_dispatch(), "outs": outs, "graphs": m.cuda_graphs.to_dict(),
            # torch.export's deserializer imports part of torch._inductor; its compiler is what a
            # standalone graph's load needs, and a native one must not.
            "inductor": "torch._inductor.compile_fx" in sys.modules,
            "warnings": [str(w.message) for w in caught if "Inductor" in str(w.message)],
        }}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none here)"),
        ),
    ],
)
def test_aot_engine_loads_natively_where_trusted_and_never_where_not(device, tmp_path, monkeypatch):
    model, exported = _program(device)
    module = compiler.compile(
        exported, backend="inductor", device=device, backend_options={"aot": True}, cache=False
    )
    files = _engine_files(module)
    header = json.loads(files[HEADER])
    assert AOT in files and os.path.basename(header["aot"]).startswith(("g++", "c++")), header
    torch.manual_seed(1)
    with torch.no_grad():
        expected = {b: model(torch.randn(b, 12).to(device)).cpu() for b in (1, 3, 16)}

    env = dict(os.environ)
    key = ec_key_pair(tmp_path, "release")
    monkeypatch.setenv("KILN_SIGNING_PRIVATE_KEY", str(key.private))
    compiler.save(module, tmp_path / "signed.kiln")
    monkeypatch.delenv("KILN_SIGNING_PRIVATE_KEY")
    compiler.save(module, tmp_path / "unsigned.kiln")

    signed = _fresh_load(
        tmp_path / "signed.kiln", {**env, "KILN_SIGNING_PUBLIC_KEY": str(key.public)}, device
    )
    # Every batch in range answered by the native package, with Inductor's compiler not imported.
    assert set(signed["dispatch"].values()) == {"aot"} and not signed["inductor"], signed
    assert not signed["warnings"], signed["warnings"]
    if device == "cuda":  # captured once per shape, then replayed
        assert signed["graphs"]["enabled"] and signed["graphs"]["captures"] == 3, signed["graphs"]
    # Not trusted: the package's native code never runs. The engine is compiled here from its program,
    # and so is this machine's own AOTInductor package, kept in the local engine cache ...
    env = {**env, "KILN_CACHE_DIR": str(tmp_path / "cache")}
    unsigned = _fresh_load(tmp_path / "unsigned.kiln", env, device)
    assert any("not trusted to run code" in w for w in unsigned["warnings"]), unsigned["warnings"]
    assert any("building this machine's own" in w for w in unsigned["warnings"]), unsigned["warnings"]
    kinds = [e.meta.get("kind") for e in compiler.EngineCache(tmp_path / "cache").entries()]
    assert "inductor-local-aot" in kinds, kinds
    # ... so the next untrusted load runs natively, as a trusted one does: nothing compiled.
    again = _fresh_load(tmp_path / "unsigned.kiln", env, device)
    assert set(again["dispatch"].values()) == {"aot"} and not again["inductor"], again
    assert not again["warnings"], again["warnings"]
    for batch, want in expected.items():
        for got in (signed, unsigned, again):
            torch.testing.assert_close(torch.tensor(got["outs"][str(batch)]), want, rtol=1e-5, atol=1e-5)


def test_aot_that_cannot_be_built_or_loaded_is_left_out_with_the_reason(program, tmp_path, monkeypatch):
    model, exported = program
    failing = tmp_path / "failing-g++"
    failing.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = "--version" ] && exec g++ --version; done\nexit 1\n'
    )
    failing.chmod(0o755)
    monkeypatch.setenv("KILN_AOT_CXX", str(failing))
    with pytest.warns(UserWarning, match="no AOTInductor package for partition .*failing-g\\+\\+"):
        module = compiler.compile(exported, backend="inductor", backend_options={"aot": True}, cache=False)
    files = _engine_files(module)
    assert AOT not in files and "failing-g++" in json.loads(files[HEADER])["aot_skipped"]
    x = torch.randn(5, 12)
    torch.testing.assert_close(module(x), model(x), rtol=1e-5, atol=1e-5)  # the standalone graph serves

    # A package that does not load in a fresh process is named, never kept.
    garbage = tmp_path / "engine.pt2"
    garbage.write_bytes(b"PK\x03\x04 not a package")
    problem = _check_in_fresh_process(
        str(garbage), [x], [model(x)], torch.device("cpu"), "fp32", str(tmp_path)
    )
    assert problem is not None and problem.startswith("failed in a fresh process"), problem


def test_aot_option_must_be_a_flag(program):
    _, exported = program
    with pytest.raises(BuildSettingsError, match="aot must be true or false"):
        compiler.compile(exported, backend="inductor", backend_options={"aot": "yes"}, cache=False)
