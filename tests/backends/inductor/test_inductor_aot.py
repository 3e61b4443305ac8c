"""Inductor engines with AOTInductor packages (``backend_options: {aot: true}``): built beside the
standalone graph and checked in a fresh process at build, loaded natively where trusted (no Inductor,
no Triton imported), never run where not trusted, left out with a warning where they cannot be built."""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import re
import sys
import textwrap
import warnings
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.export import Dim

import compiler
from compiler.backends import get_backend
from compiler.backends.inductor import native
from compiler.backends.inductor.aot import _check_in_fresh_process, build_aot
from compiler.backends.inductor.compat import cxx_runtime, process_cxx_runtime
from compiler.backends.inductor.format import AOT, COMPILED, HEADER, pack
from compiler.errors import BuildSettingsError, ForeignEngineCodeWarning
from compiler.program.module_policy import custom_op_modules
from tests.fixtures import preloaded
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


@pytest.fixture(scope="module")
def aot_module(program) -> compiler.CompiledModule:
    """``program`` compiled with its AOTInductor package on the CPU, once for the module's tests that
    only read it: each build is a C++ compile and a fresh-process check, ~15 CPU-seconds here."""
    _, exported = program
    return compiler.compile(exported, backend="inductor", backend_options={"aot": True}, cache=False)


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
            # this machine's own native package, built in the background for the loads after this one
            "native_builds": [b.wait(600) for b in m.native_builds()],
        }}))
        """
    )
    # Forked from the suite's preload server (torch imported, never Inductor's compiler); a second call
    # at once (two loads racing) gets a process of its own.
    done = preloaded.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
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
def test_aot_engine_loads_natively_where_trusted_and_never_where_not(
    device, tmp_path, monkeypatch, failing_compiler, request
):
    if device == "cpu":
        (model, _), module = request.getfixturevalue("program"), request.getfixturevalue("aot_module")
    else:
        model, exported = _program(device)
        module = compiler.compile(
            exported, backend="inductor", device=device, backend_options={"aot": True}, cache=False
        )
    files = _engine_files(module)
    header = json.loads(files[HEADER])
    assert AOT in files and os.path.basename(header["aot"]).startswith(("g++", "c++")), header
    assert COMPILED not in files and not header["specializations"]  # the package serves every shape
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
    # Not trusted: the package's native code never runs. The engine is compiled here from its program and
    # serves at once, while this machine's own AOTInductor package is built in the background into the
    # local engine cache. A build that fails (here: its compiler) leaves the served graph serving, and
    # says why in the cache's log, which `kiln cache ls` shows ...
    cache = tmp_path / "cache"
    env = {**env, "KILN_CACHE_DIR": str(cache)}
    failed = _fresh_load(tmp_path / "unsigned.kiln", {**env, "KILN_AOT_CXX": str(failing_compiler)}, device)
    assert any("not trusted to run code" in w for w in failed["warnings"]), failed["warnings"]
    assert any("being built in the background" in w for w in failed["warnings"]), failed["warnings"]
    assert failed["native_builds"] == [1] and "aot" not in failed["dispatch"].values(), failed
    events = native.log_events(cache)
    assert [e["state"] for e in events] == ["started", "failed"] and "failing-g++" in events[-1]["reason"]
    listed = preloaded.run(
        [sys.executable, "-m", "flows.cli", "cache", "ls", str(cache), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert listed.returncode == 0, listed.stderr[-2000:]
    (build,) = json.loads(listed.stdout)["native_builds"]
    assert build["state"] == "failed" and "failing-g++" in build["reason"], build
    assert build["why"] == "its package is not trusted to run code", build  # why this machine builds its own
    # ... and the next loads build it again: two processes at once build it once.
    with ThreadPoolExecutor(2) as pool:
        unsigned, twin = pool.map(lambda _: _fresh_load(tmp_path / "unsigned.kiln", env, device), range(2))
    kinds = [e.meta.get("kind") for e in compiler.EngineCache(cache).entries()]
    assert kinds.count("inductor-local-aot") == 1, kinds
    states = [e["state"] for e in native.log_events(cache)][2:]
    assert states.count("built") == 1 and states.count("started") == 1, states
    # ... so the next untrusted load runs natively, as a trusted one does: nothing compiled.
    again = _fresh_load(tmp_path / "unsigned.kiln", env, device)
    assert set(again["dispatch"].values()) == {"aot"} and not again["inductor"], again
    assert not again["warnings"], again["warnings"]
    for batch, want in expected.items():
        for got in (signed, failed, unsigned, twin, again):
            torch.testing.assert_close(torch.tensor(got["outs"][str(batch)]), want, rtol=1e-5, atol=1e-5)


def test_aot_that_cannot_be_built_or_loaded_is_left_out_with_the_reason(
    program, tmp_path, monkeypatch, failing_compiler
):
    model, exported = program
    monkeypatch.setenv("KILN_AOT_CXX", str(failing_compiler))
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


def test_the_instances_of_one_engine_share_one_native_build(tmp_path):
    """A package whose blocks share one engine (dedup) loads that engine once per instance: each asks for
    this machine's own package, and one build runs (a job that cannot build is logged as failed)."""
    job = {"io": {}, "options": {}, "device": "cpu", "precision": "fp32", "frozen": False}
    job |= {"target": "cpu", "torch": torch.__version__}
    weights = [torch.zeros(2)]
    first = native.start(tmp_path, "ab" * 32, b"not a program", weights, job)
    second = native.start(tmp_path, "ab" * 32, b"not a program", weights, job)
    assert second is first and first.wait(120) == 1
    assert len([p for p in (tmp_path / native.JOBS_DIR).iterdir() if p.is_dir()]) <= 1  # removed once done
    (event,) = [e for e in native.log_events(tmp_path) if e["state"] == "failed"]
    assert event["key"] == "ab" * 32 and event["reason"], event


def test_a_native_package_for_a_newer_cxx_runtime_is_refused_by_name_and_the_engine_serves(
    program, aot_module, tmp_path, monkeypatch
):
    """A package whose AOTInductor wrapper was compiled against a newer libstdc++ than the loading process
    has would crash that process when loaded (two C++ runtimes in one): the build records its runtime, a
    load refuses such a package by name and the engine, compiled here from its program, serves."""
    model, _ = program
    module = aot_module
    (fp,) = [fp for fp, a in module.engines.items() if a.engine]
    files = _engine_files(module)
    header = json.loads(files[HEADER])
    here = process_cxx_runtime()
    assert here is not None and header["aot_libstdcxx"] == cxx_runtime(header["aot"]), header
    major, minor, patch = map(int, header["aot_libstdcxx"].split("."))
    newer = f"{major}.{minor}.{max(patch, int(here.split('.')[2])) + 1}"  # a newer g++ built it
    forged = pack({**files, HEADER: json.dumps({**header, "aot_libstdcxx": newer}).encode()})
    original = module.engines[fp]
    key = ec_key_pair(tmp_path, "release")  # signed where compiled: loads trust its native code
    monkeypatch.setenv("KILN_SIGNING_PRIVATE_KEY", str(key.private))
    module.engines[fp] = dataclasses.replace(original, engine=forged)
    try:
        path = compiler.save(module, tmp_path / "newer-runtime.kiln").path
    finally:  # the module is shared with the module's other tests
        module.engines[fp] = original
    monkeypatch.delenv("KILN_SIGNING_PRIVATE_KEY")
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KILN_NATIVE_BUILD", "off")  # the build itself: the tests above
    refused = rf"libstdc\+\+ {re.escape(newer)} .*newer than the libstdc\+\+ {re.escape(here)} this process"
    # As a user meets it: a command that loads the package, in a fresh process that verifies its signature.
    compared = preloaded.run(
        [sys.executable, "-m", "flows.cli", "debug", "compare", str(path), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "KILN_SIGNING_PUBLIC_KEY": str(key.public)},
        timeout=300,
    )
    assert compared.returncode == 0, compared.stderr[-3000:]
    assert re.search(rf"ForeignEngineCodeWarning: .*{refused}", compared.stderr), compared.stderr[-3000:]
    (row,) = json.loads(compared.stdout)["rows"]
    assert row["rel_l2"] < 1e-5, row  # the engine compiled here answers as its PyTorch submodule does
    with pytest.warns(ForeignEngineCodeWarning, match=refused):
        loaded = compiler.load(path, trust_engine_code=True)
    assert "aot" not in loaded.last_dispatch().values(), loaded.last_dispatch()
    x = torch.randn(5, 12)
    torch.testing.assert_close(loaded(x), model(x), rtol=1e-5, atol=1e-5)
    # The recorded runtime is what is checked: the package as built, which needs no newer one, runs natively.
    with warnings.catch_warnings():
        warnings.simplefilter("error", ForeignEngineCodeWarning)
        native_engine = get_backend("inductor").load(original.engine, original.io, None)
    assert native_engine.last_dispatch == "aot"
    torch.testing.assert_close(native_engine(x)[0], model(x), rtol=1e-5, atol=1e-5)


class _WithCustomOp(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.kilntest.shifted_tanh(x * 2, 0.5)


@pytest.mark.slow
def test_a_package_calling_a_custom_op_passes_its_fresh_process_check() -> None:
    """The build's fresh-process check imports the modules of the custom ops the program calls before
    loading the package (a package calls them through the dispatcher): without them it failed ("Could
    not find schema for ...") and the engine lost its package (found on the H100: every fp16 decode
    program, which calls kiln::decode_attention inside its engine)."""
    from tests.backends.inductor import custom_op_module  # defines kilntest::shifted_tanh

    model, x = _WithCustomOp().eval(), torch.randn(4, 12)
    exported = torch.export.export(model, (x,))
    assert custom_op_modules(exported) == {custom_op_module.__name__}
    package, why = build_aot(exported, [x], [model(x)], {}, torch.device("cpu"), "fp32")
    assert package is not None, why


@pytest.mark.slow
def test_a_native_build_registers_the_custom_ops_its_program_calls_before_reading_it(
    tmp_path, monkeypatch
) -> None:
    """The worker that builds this machine's own package for an untrusted load is a fresh process: it
    registers the custom ops the engine's program calls, from the modules the load registered them
    from, before it reads the program. Without them it failed ("not a loadable torch.export archive";
    found on the H200 with a generation package, whose decode program calls kiln::decode_attention),
    and every later load compiled the engine again."""
    from compiler.backends.base import EngineIO
    from compiler.program.export import input_specs, save_program
    from compiler.program.text import registered_op_modules
    from tests.backends.inductor import custom_op_module  # defines kilntest::shifted_tanh

    model, x = _WithCustomOp().eval(), torch.randn(4, 12)
    exported = compiler.export(model, (x,))
    program = save_program(exported, tmp_path / "engine.pt2").read_bytes()
    assert registered_op_modules(program) == [custom_op_module.__name__]
    io_spec = EngineIO(input_specs(exported), ("y",), ("float32",))
    job = {"io": io_spec.to_dict(), "options": {"aot": True}, "device": "cpu", "precision": "fp32",
           "frozen": False, "target": "cpu", "torch": torch.__version__, "why": "not trusted"}  # fmt: skip
    key = hashlib.sha256(program).hexdigest()
    monkeypatch.setenv(native.MODE_ENV, "inline")  # the worker's own process, waited for
    (tmp_path / "cache").mkdir()
    native.start(tmp_path / "cache", key, program, [], job)
    event = native.latest(tmp_path / "cache")[key]
    assert event["state"] == "built", event


def test_a_load_that_fails_after_preparing_a_native_build_leaves_no_job(tmp_path) -> None:
    """The build's job is written beside the compile (prepare); where the compile raises, the build
    never starts and its job directory is removed, not left for the 24 h sweep."""
    from compiler.backends.base import EngineIO
    from compiler.program.export import input_specs, save_program

    model, exported = _program()
    program = save_program(exported, tmp_path / "engine.pt2").read_bytes()
    io_spec = EngineIO(input_specs(exported), ("y",), ("float32",))
    header = {"precision": "fp32", "constants": []}
    local = native.LocalAot(True, program, {"aot": True}, torch.device("cpu"), "cpu", header, tmp_path)
    assert local.will_build()
    local.prepare(io_spec, [p.detach() for p in model.parameters()], "not trusted")
    with pytest.raises(RuntimeError, match="the compile failed"), local.discarded_on_error():
        raise RuntimeError("the compile failed")
    jobs = tmp_path / native.JOBS_DIR
    assert jobs.is_dir() and not [p for p in jobs.iterdir() if p.is_dir()], list(jobs.iterdir())
