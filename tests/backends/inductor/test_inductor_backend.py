"""The Inductor backend on the CPU: build, dedup, strip, refit, engine cache, package round trip in a fresh
process, engine compatibility and build failures. Every Inductor compile here is real (g++ on the CPU),
so the models are tiny and static-shaped, and one compiled model serves most tests; the GPU path is
tests/gpu/test_inductor_gpu.py.
"""

from __future__ import annotations

import io
import json
import os
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
import torch

import compiler
from compiler.backends import get_backend
from compiler.backends.inductor.backend import InductorBackend
from compiler.backends.inductor.format import COMPILED, ENGINE_WEIGHTS, HEADER, read_engine
from compiler.errors import (
    BackendUnavailableError,
    BuildSettingsError,
    EngineBuildError,
    EngineCompatibilityError,
    RefitError,
    UnsafeProgramError,
)
from tests.fixtures import preloaded
from tests.fixtures.signing_keys import ec_key_pair
from zoo.models import repeated_fallback, soft_sign_clip, tiny_bert

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def blocks():
    """Three blocks around a custom op (which stays in PyTorch): four partitions (each block's tail joins
    the next block's head), three unique structures (the two middle ones are equal)."""
    case = repeated_fallback(depth=3, width=16)
    program = compiler.export(case.model, case.args)  # static shapes: one Inductor compile per structure
    return case, program


@pytest.fixture(scope="module")
def compiled(blocks, tmp_path_factory):
    _, program = blocks
    cache = compiler.EngineCache(tmp_path_factory.mktemp("inductor-cache"))
    return compiler.compile(program, backend="inductor", cache=cache), cache


def test_inductor_engines_match_eager_with_one_build_per_structure(blocks, compiled):
    case, _ = blocks
    module, _ = compiled
    x = case.args[0]
    torch.testing.assert_close(module(x), case.model(x), rtol=1e-5, atol=1e-5)
    report = module.report
    assert report.backend == "inductor" and report.engine_target == "cpu"
    assert len(report.partitions) == 4 and report.unique_fingerprints == 3
    assert report.engines_built == 3 and report.refits == 1
    assert report.fallback_ops == {"kiln_zoo.soft_sign_clip.default": 3}
    header, files = read_engine(next(iter(module.engines.values())).engine)
    assert header["torch"] == torch.__version__ and header["device"] == "cpu" and header["compiler"]
    assert set(files) == {HEADER, "program.pt2", ENGINE_WEIGHTS, COMPILED}
    assert files[COMPILED], "the compiled graph travels with the engine"


def test_op_table_keeps_custom_ops_and_forced_ops_in_pytorch(blocks):
    backend = get_backend("inductor")
    assert backend.supports(torch.ops.aten.addmm.default)
    assert not backend.supports(soft_sign_clip._opoverload)
    _, program = blocks
    plan = compiler.partition(
        program, compiler.CompileOptions(backend="inductor", torch_executed_ops=("aten.relu",))
    )
    assert all("aten.relu" not in str(p.ops) for p in plan.partitions)


def test_cache_hit_and_stripped_engines(blocks, compiled, tmp_path):
    case, program = blocks
    module, cache = compiled
    again = compiler.compile(program, backend="inductor", cache=cache)
    assert again.report.cache_hits == 3 and again.report.engines_built == 0
    stripped = compiler.compile(program, backend="inductor", cache=cache, strip_weights=True)
    for artifact in stripped.engines.values():
        assert ENGINE_WEIGHTS not in read_engine(artifact.engine)[1]
    assert stripped.report.engine_bytes < module.report.engine_bytes
    x = case.args[0]
    torch.testing.assert_close(stripped(x), case.model(x), rtol=1e-5, atol=1e-5)
    artifact = next(iter(stripped.engines.values()))
    with pytest.raises(RefitError, match="weight-stripped"):
        get_backend("inductor").load(artifact.engine, artifact.io, None)


def test_refit_puts_new_weights_in_without_a_build(blocks, compiled):
    case, _ = blocks
    module, _ = compiled
    tuned = {k: v + 0.01 * torch.randn_like(v) for k, v in case.model.state_dict().items()}
    refitted = module.refit(tuned)
    reference = repeated_fallback(depth=3, width=16).model
    reference.load_state_dict(tuned)
    x = case.args[0]
    torch.testing.assert_close(refitted(x), reference(x), rtol=1e-5, atol=1e-5)
    artifact = next(iter(module.engines.values()))
    bad = {name: torch.zeros(1) for name in read_engine(artifact.engine)[0]["weights"]}
    with pytest.raises(RefitError, match="expected shape"):
        get_backend("inductor").load(artifact.engine, artifact.io, bad)


def test_refit_in_place_copies_into_the_engines_own_tensors(blocks, compiled, tmp_path):
    case, _ = blocks
    module, _ = compiled
    loaded = compiler.load(compiler.save(module, tmp_path / "m.kiln").path, trust_engine_code=True)
    calls = {name: call.engine for name, call in loaded.graph.named_children() if hasattr(call, "engine")}
    storages = {name: [w.data_ptr() for w in engine.weights] for name, engine in calls.items()}
    tuned = {k: v + 0.01 * torch.randn_like(v) for k, v in case.model.state_dict().items()}
    assert loaded.refit(tuned, in_place=True) is loaded
    reference = repeated_fallback(depth=3, width=16).model
    reference.load_state_dict(tuned)
    x = case.args[0]
    torch.testing.assert_close(loaded(x), reference(x), rtol=1e-5, atol=1e-5)
    # The same engines, the same tensors: nothing loaded again, so captures over them stay valid.
    for name, call in loaded.graph.named_children():
        if name in calls:
            assert call.engine is calls[name]
            assert [w.data_ptr() for w in call.engine.weights] == storages[name]


def _load_in_a_fresh_process(
    package: Path, x: Path, env: dict, cache: Path | None = None
) -> tuple[list[str], torch.Tensor, str]:
    """(stdout words, output, warnings) of loading ``package`` in a new process (with ``cache`` where
    given) and calling it on ``x``."""
    code = textwrap.dedent(
        f"""
        import warnings, torch, compiler
        import zoo.models  # registers the custom op the package's program calls
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            m = compiler.load({str(package)!r}, cache={str(cache) if cache else None!r})
        print(m.report.backend, m.device, m.trust_engine_code)
        print("WARNINGS", *(str(w.message) for w in caught if "Inductor engine" in str(w.message)))
        torch.save(m(torch.load({str(x)!r})), {str(x)!r} + ".out")
        """
    )
    # forked from the suite's preload server: torch imported, nothing of kiln's or Inductor's compiler
    done = preloaded.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    first, _, warned = done.stdout.partition("WARNINGS")
    return first.split(), torch.load(f"{x}.out"), warned


def test_package_round_trip_in_a_fresh_process(blocks, compiled, tmp_path, monkeypatch):
    """A signed package, loaded where its key is set, runs its engines' compiled graphs as stored; an
    unsigned one (no key: nothing vouches for it) has them compiled again from their programs, with a
    warning saying why. Both answer exactly as the compiled module did."""
    case, _ = blocks
    module, _ = compiled
    torch.save(case.args[0], tmp_path / "x.pt")
    expected = module(case.args[0])
    env = dict(os.environ)
    key = ec_key_pair(tmp_path, "release")
    monkeypatch.setenv("KILN_SIGNING_PRIVATE_KEY", str(key.private))
    compiler.save(module, tmp_path / "signed.kiln")
    monkeypatch.delenv("KILN_SIGNING_PRIVATE_KEY")
    compiler.save(module, tmp_path / "unsigned.kiln")

    words, out, warned = _load_in_a_fresh_process(
        tmp_path / "signed.kiln", tmp_path / "x.pt", {**env, "KILN_SIGNING_PUBLIC_KEY": str(key.public)}
    )
    assert words == ["inductor", "cpu", "True"] and not warned.strip(), warned
    torch.testing.assert_close(out, expected, rtol=0, atol=0)

    words, out, warned = _load_in_a_fresh_process(tmp_path / "unsigned.kiln", tmp_path / "x.pt", env)
    assert words == ["inductor", "cpu", "False"]
    assert "not trusted to run code" in warned and "compiling it from its program" in warned
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


def test_an_untrusted_load_keeps_what_it_compiles_in_the_cache_it_is_handed(blocks, compiled, tmp_path):
    """The graphs a load compiles from engines' programs go to the cache the load was handed, not to
    one the backend opens itself ($KILN_CACHE_DIR here, which stays empty)."""
    case, _ = blocks
    module, _ = compiled
    compiler.save(module, tmp_path / "unsigned.kiln")
    torch.save(case.args[0], tmp_path / "x.pt")
    default, handed = tmp_path / "default", tmp_path / "handed"
    env = {**os.environ, "KILN_CACHE_DIR": str(default)}
    words, out, _ = _load_in_a_fresh_process(tmp_path / "unsigned.kiln", tmp_path / "x.pt", env, handed)
    assert words == ["inductor", "cpu", "False"]
    torch.testing.assert_close(out, module(case.args[0]), rtol=1e-6, atol=1e-6)
    kinds = {e.meta.get("kind") for e in compiler.EngineCache(handed).entries()}
    assert kinds == {"inductor-local-compile"}, kinds
    assert not default.exists() or not compiler.EngineCache(default).entries()


def test_a_refit_keeps_the_trust_its_module_was_loaded_with(blocks, compiled, tmp_path):
    case, _ = blocks
    module, _ = compiled
    compiler.save(module, tmp_path / "m.kiln")
    assert module.trust_engine_code  # compiled here: its own engines
    loaded = compiler.load(tmp_path / "m.kiln")
    assert loaded.trust_engine_code is False  # no key, no explicit trust
    assert compiler.load(tmp_path / "m.kiln", trust_engine_code=True).trust_engine_code
    tuned = {k: v + 0.01 for k, v in case.model.state_dict().items()}
    assert loaded.refit(tuned).trust_engine_code is False


def test_an_untrusted_engine_program_is_read_as_data(compiled):
    """Compiling an untrusted engine again reads its program as a package's program is read: an archive
    entry torch might unpickle is refused before torch sees it."""
    module, _ = compiled
    artifact = next(iter(module.engines.values()))
    _, files = read_engine(artifact.engine)
    program = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(files["program.pt2"])) as source, zipfile.ZipFile(program, "w") as out:
        root = source.namelist()[0].split("/")[0]
        for name in source.namelist():
            out.writestr(name, source.read(name))
        out.writestr(f"{root}/data/payload.pkl", b"cos\nsystem\n(S'true'\ntR.")
    engine = _with_files({**files, "program.pt2": program.getvalue()})
    untrusting = InductorBackend("cpu", trust_engine_code=False)
    with pytest.raises(UnsafeProgramError, match="never has"), pytest.warns(UserWarning, match="not trusted"):
        untrusting.load(engine, artifact.io, None)


def _with_files(files: dict) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buffer.getvalue()


def _with_header(engine: bytes, **changes: object) -> bytes:
    """The engine with header fields changed: what an engine from another machine or torch looks like."""
    _, files = read_engine(engine) if "format" not in changes else (None, _files(engine))
    return _with_files({**files, HEADER: json.dumps({**json.loads(files[HEADER]), **changes})})


def _files(engine: bytes) -> dict:
    with zipfile.ZipFile(io.BytesIO(engine)) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"torch": "2.0.0"}, "built with torch 2.0.0"),
        ({"device": "cuda:sm_90"}, "built for cuda:sm_90"),
        ({"device_index": 1}, "built for cuda:1; this backend runs on cpu"),
        ({"format": 99}, "newer than this kiln reads"),
        ({"format": 1}, "no longer read: recompile"),
    ],
)
def test_engines_for_another_torch_or_device_are_refused(compiled, changes, message):
    module, _ = compiled
    artifact = next(iter(module.engines.values()))
    with pytest.raises(EngineCompatibilityError, match=message):
        get_backend("inductor").load(_with_header(artifact.engine, **changes), artifact.io, None)


def test_a_compiled_graph_that_does_not_load_is_compiled_again_from_the_program(compiled):
    """Another build of the same torch version, or another Inductor configuration, cannot use the stored
    compiled graph: the engine compiles its program again (a warning says so) and answers the same."""
    module, _ = compiled
    artifact = next(iter(module.engines.values()))
    header, entries = read_engine(artifact.engine)
    files = dict(entries)
    files[COMPILED] = files[COMPILED][: len(files[COMPILED]) // 2]  # not an artifact any more
    # Other (valid) options: not the graph this process compiled for the engine already.
    other = {**header["options"], "compile_options": {"size_asserts": True}}
    files[HEADER] = json.dumps({**header, "options": other})
    damaged = _with_files(files)
    with pytest.warns(UserWarning, match="does not load here.*compiling it from its program"):
        engine = get_backend("inductor").load(damaged, artifact.io, None)
    reference = get_backend("inductor").load(artifact.engine, artifact.io, None)
    inputs = [torch.randn(spec.opt_shape) for spec in artifact.io.inputs]
    torch.testing.assert_close(engine(*inputs), reference(*inputs), rtol=0, atol=0)


def test_one_compile_serves_every_shape_in_range_without_guards():
    """Dynamic batch (1..8) and sequence (4..64) compile once, symbolically: every shape in range, the
    minimum batch 1 included, matches eager, and shapes the build never saw run without dynamo compiling
    anything. The opt batch (2) equals the rows of BERT's token-type table: they must stay independent."""
    case = tiny_bert(num_layers=1, hidden=32, seq_len=8)
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    module = compiler.compile(program, backend="inductor", cache=False)
    assert module.report.engines_built == module.report.unique_fingerprints >= 1
    assert min(s.opt_shape[0] for a in module.engines.values() for s in a.io.inputs) == 2
    frames = dict(torch._dynamo.utils.counters["frames"])
    for batch, seq in ((1, 4), (3, 9), (8, 64)):
        ids = torch.randint(0, 512, (batch, seq))
        inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        expected, actual = case.model(**inputs), module(**inputs)
        torch.testing.assert_close(actual.last_hidden_state, expected.last_hidden_state, rtol=1e-4, atol=1e-4)
    assert dict(torch._dynamo.utils.counters["frames"]) == frames, "an engine call went through dynamo"


def test_non_contiguous_inputs_are_answered_like_contiguous_ones(blocks, compiled):
    """The compiled graph asserts contiguous strides; a transposed input (or a view a fallback op
    returns) must still be answered, as eager answers it."""
    case, _ = blocks
    module, _ = compiled
    x = case.args[0].t().contiguous().t()  # same values, column-major strides
    assert not x.is_contiguous()
    torch.testing.assert_close(module(x), case.model(x), rtol=1e-5, atol=1e-5)


def test_a_failed_inductor_build_falls_back_and_caches_nothing(blocks, tmp_path, failing_compiler):
    case, program = blocks
    cache = compiler.EngineCache(tmp_path / "cache")
    broken = {"compile_options": {"cpp.cxx": (str(failing_compiler),)}}
    module = compiler.compile(program, backend="inductor", cache=cache, backend_options=broken)
    failures = module.report.build_failures
    failed = {f["fingerprint"] for f in failures}
    # Partitions that need a C++ kernel fail; one whose only op is a matmul (an extern call) needs none.
    assert failed and {f["fell_back_to"] for f in failures} == {"torch"}
    assert failed != set(module.engines), "the compiler setting reached Inductor: a matmul-only block built"
    assert all("Inductor could not compile partition" in f["error"] for f in failures)
    assert {fp: a.backend for fp, a in module.engines.items()} == {
        fp: "torch" if fp in failed else "inductor" for fp in module.engines
    }
    assert len(list((tmp_path / "cache").glob("*.bin"))) == len(module.engines) - len(failed), (
        "a failed build is never cached"
    )
    torch.testing.assert_close(module(case.args[0]), case.model(case.args[0]), rtol=1e-5, atol=1e-5)
    ort = compiler.compile(
        program, backend="inductor", cache=cache, backend_options=broken, on_build_failure="onnxruntime"
    )
    assert {ort.engines[fp].backend for fp in failed} == {"onnxruntime"}
    torch.testing.assert_close(ort(case.args[0]), case.model(case.args[0]), rtol=1e-4, atol=1e-4)
    with pytest.raises(EngineBuildError, match="Inductor could not compile"):
        compiler.compile(
            program, backend="inductor", cache=cache, backend_options=broken, on_build_failure="error"
        )


def test_missing_host_compiler_and_bad_settings_are_typed_errors(blocks):
    _, program = blocks
    with pytest.raises(BackendUnavailableError, match=r"needs a C\+\+ compiler.*kiln-no-such-cxx"):
        compiler.compile(
            program,
            backend="inductor",
            cache=False,
            backend_options={"compile_options": {"cpp.cxx": ("kiln-no-such-cxx",)}},
        )
    with pytest.raises(BuildSettingsError, match=r"unknown backend_options .* for Inductor"):
        compiler.compile(program, backend="inductor", cache=False, backend_options={"refit": "all"})
    with pytest.raises(BuildSettingsError, match="mode"):
        compiler.compile(program, backend="inductor", cache=False, backend_options={"mode": "fastest"})
    with pytest.raises(BuildSettingsError, match="CUDA graph modes are not offered"):
        compiler.compile(
            program, backend="inductor", cache=False, backend_options={"mode": "reduce-overhead"}
        )
    with pytest.raises(BuildSettingsError, match=r"\['cpp\.cxxx'\]: not Inductor config settings"):
        compiler.compile(
            program, backend="inductor", cache=False, backend_options={"compile_options": {"cpp.cxxx": "g++"}}
        )


def test_inductor_backend_on_cuda_needs_a_gpu():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: tests/gpu covers CUDA")
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
        get_backend("inductor", device="cuda")
    assert InductorBackend("cpu").engine_target() == "cpu"
