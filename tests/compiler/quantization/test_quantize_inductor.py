"""int8 on Inductor (issue 19): torchao's PT2E flow with its x86 quantizer, calibrated per instance on
the user's data, each instance's int8 weights and scales frozen into its own engine."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import compiler
from benchmarks.quantization import sensitive_case
from compiler.backends.inductor.format import AOT, COMPILED, ENGINE_PROGRAM, read_engine
from compiler.errors import PartitionError
from compiler.partitioning.dedup import graph_digest
from compiler.quantization.pt2e import Exported, quantize_program
from compiler.quantization.quantize import _captured
from compiler.quantization.torch_layers import TorchLayerProbe

pytest.importorskip("torchao", reason="Inductor int8 needs torchao (pip install 'kiln[int8-inductor]')")
import torch.ao.quantization.fx._decomposed  # registers the quantized_decomposed ops

QUANTIZE = torch.ops.quantized_decomposed.quantize_per_tensor.default
DEQUANTIZE_WEIGHT = torch.ops.quantized_decomposed.dequantize_per_channel.default

HOT = 2


@pytest.fixture(scope="module")
def int8(tmp_path_factory):
    """The sensitive model (four residual blocks of one structure, block 2 with an outlier channel)
    compiled int8 on Inductor, calibrated on the first 16 recorded samples."""
    model, program, data = sensitive_case(width=32, blocks=4, hot=HOT, batch=4, samples=24)
    recorded = tmp_path_factory.mktemp("data") / "recorded.npz"
    np.savez(recorded, x=data["x"].numpy())
    options = compiler.CompileOptions(
        backend="inductor",
        precision="int8",
        split_modules=("OutlierBlock",),
        calibration={"samples": 16, "data": str(recorded)},
    )
    cache = compiler.EngineCache(tmp_path_factory.mktemp("inductor-int8-cache"))
    return model, data, compiler.compile(program, options, cache=cache)


def test_each_instance_is_quantized_on_its_own_inputs_into_its_own_frozen_engine(int8, tmp_path):
    _, data, compiled = int8
    report = compiled.report
    blocks = [f"engine_{i}" for i in range(4)]
    assert (
        report.quantization["partitions"] == [*blocks, "engine_4"] and report.quantization["fallbacks"] == {}
    )
    # Weights and scales are compiled into each program: one engine per instance, none refit.
    assert report.unique_fingerprints == 5 and report.engines_built == 5
    assert all(compiled.dedup.instance(b).weights == {} for b in blocks)
    input_scales = []
    for block in blocks:
        header, files = read_engine(compiled.engines[compiled.dedup.instance(block).fingerprint].engine)
        assert header["frozen"] is True and header["weights"] == {} and COMPILED not in files
        program = torch.export.load(io.BytesIO(files[ENGINE_PROGRAM]))
        quantize = [n for n in program.graph.nodes if n.target == QUANTIZE]
        frozen = [*program.state_dict.values(), *program.constants.values()]
        assert quantize and any(t.dtype == torch.int8 for t in frozen)
        input_scales.append(quantize[0].args[1])  # the block input's calibrated scale
        # uint8 activations at 7 bits (quant_max, the op's fifth argument): an x86 CPU without VNNI
        # saturates full-range uint8 x int8 products (compiler/backends/capabilities.REDUCE_RANGE)
        assert {(n.args[3], n.args[4]) for n in quantize} == {(0, 127)}, [n.args for n in quantize]
    # ... calibrated on its own activations (each block sees a different input range) ...
    assert len(set(input_scales)) == len(blocks)
    # ... and computing its own block: every engine is close to its own PyTorch submodule. (The outlier
    # channel sits between the block's linears, which are all the x86 recipe quantizes, so unlike
    # ONNX Runtime's recipe it costs no accuracy here.)
    held_out = [(x,) for x in data["x"][16:20]]
    rows = compiler.compare_partitions(compiled, held_out, runs=0).rows
    assert all(r.precision == "int8" for r in rows) and max(r.rel_l2 for r in rows) < 0.05
    # A package holds the programs (no compiled code): trusted and untrusted loads compile them here
    # and answer alike.
    x = data["x"][20]
    expected = compiled(x)
    compiler.save(compiled, tmp_path / "int8.kiln")
    for trust in (True, False):
        loaded = compiler.load(tmp_path / "int8.kiln", trust_engine_code=trust)
        assert torch.allclose(loaded(x), expected, atol=1e-5, rtol=1e-5)


def test_a_partition_without_linear_or_convolution_stays_float_and_is_named():
    class Norm(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.norm(x))

    program = compiler.export(Norm().eval(), (torch.randn(2, 16),))
    options = compiler.CompileOptions(
        backend="inductor", precision="int8", calibration={"allow_random": True}
    )
    compiled = compiler.compile(program, options, cache=False)
    ((name, reason),) = compiled.report.quantization["fallbacks"].items()
    assert "found no linear or convolution" in reason
    assert compiled.plan.options.precision_of(name) == "fp32" and name not in compiled.plan.quantized_graphs


def test_an_embedding_table_is_stored_int8_with_row_scales(tmp_path):
    class Embed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Embedding(1000, 32)
            self.norm = torch.nn.LayerNorm(32)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:  # the table looked up twice: stored once
            return self.norm(self.table(ids) + self.table(ids.flip(-1)))

    model = Embed().eval()
    ids = torch.randint(0, 1000, (24, 2, 8), generator=torch.Generator().manual_seed(0))
    np.savez(tmp_path / "ids.npz", ids=ids.numpy())
    options = compiler.CompileOptions(
        backend="inductor", precision="int8", calibration={"samples": 16, "data": str(tmp_path / "ids.npz")}
    )
    compiled = compiler.compile(compiler.export(model, (ids[0],)), options, cache=False)
    assert compiled.report.quantization["fallbacks"] == {}
    (artifact,) = compiled.engines.values()
    program = torch.export.load(io.BytesIO(read_engine(artifact.engine)[1][ENGINE_PROGRAM]))
    tensors = [*program.state_dict.values(), *program.constants.values()]
    assert [t.dtype for t in tensors if tuple(t.shape) == (1000, 32)] == [torch.int8]  # no float copy
    expected = model(ids[20])
    error = float((compiled(ids[20]) - expected).detach().norm() / expected.detach().norm())
    assert 0 < error < 0.02


def test_with_aot_an_int8_engine_loads_its_native_package_instead_of_compiling(tmp_path, monkeypatch):
    """Frozen graphs cannot be saved as Inductor artifacts, but AOTInductor packages them (its oneDNN
    weights included): with ``aot: true`` a trusted load runs that package and compiles nothing."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 16)).eval()
    batch = torch.export.Dim("batch", min=1, max=16)
    program = compiler.export(model, (torch.randn(4, 32),), dynamic_shapes=({0: batch},))
    options = compiler.CompileOptions(
        backend="inductor",
        precision="int8",
        backend_options={"aot": True},
        calibration={"allow_random": True, "samples": 8},
    )
    compiled = compiler.compile(program, options, cache=False)
    (artifact,) = compiled.engines.values()
    header, files = read_engine(artifact.engine)
    assert header["frozen"] is True and AOT in files and COMPILED not in files, header
    compiler.save(compiled, tmp_path / "int8-aot.kiln")
    loaded = compiler.load(tmp_path / "int8-aot.kiln", trust_engine_code=True)
    for rows in (1, 16):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(loaded(x), compiled(x), rtol=1e-4, atol=1e-4)
    assert set(loaded.last_dispatch().values()) == {"aot"}
    # Untrusted: the package's native code never runs; the first load compiles the program, serves it,
    # and builds this machine's own package in the background (kept in the local engine cache), which
    # the next load runs.
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.warns(UserWarning, match="own AOTInductor package is being built in the background"):
        first = compiler.load(tmp_path / "int8-aot.kiln", trust_engine_code=False)
    assert [build.wait(600) for build in first.native_builds()] == [0]
    again = compiler.load(tmp_path / "int8-aot.kiln", trust_engine_code=False)
    x = torch.randn(3, 32)
    torch.testing.assert_close(again(x), compiled(x), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(first(x), compiled(x), rtol=1e-4, atol=1e-4)
    assert set(again.last_dispatch().values()) == {"aot"}


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"device": "cuda"}, r"int8 with backend 'inductor' on CUDA .*use quantization: dynamic"),
        ({"quantization": "dynamic"}, r"'dynamic' with backend 'inductor' and int8 on the CPU.*static"),
        ({"calibration": {"method": "entropy"}}, r"calibration\.method 'entropy'.*'inductor'.*'minmax'"),
    ],
)
def test_what_inductor_int8_cannot_do_is_refused_by_name(settings, match):
    with pytest.raises(PartitionError, match=match):
        compiler.CompileOptions(backend="inductor", precision="int8", **settings)


def test_layers_kept_in_float_are_left_out_by_the_quantizer_and_the_program_is_stable(int8):
    """Accuracy repair's layers on the CPU (issue 46): float_layers (canonical node names of the
    partition's graph) are left unquantized by the x86 quantizer's own switch; the program saved is the
    same bytes' digest in every call (its fingerprint and engine-cache key)."""
    _, data, compiled = int8
    plan, name = compiled.plan, f"engine_{HOT}"
    names = Exported.of(plan, name).layers()
    assert len(names) == 2  # the block's two linears
    feeds = _captured(plan, [(x,) for x in data["x"][:8]], [name])[name]
    program = quantize_program(plan, name, feeds, float_layers=names[:1])
    graph = torch.export.load(io.BytesIO(program)).graph
    weights = [n.args[1] for n in graph.nodes if n.target is torch.ops.aten.linear.default]
    assert [w.target == DEQUANTIZE_WEIGHT for w in weights] == [False, True]  # the first kept float
    again = quantize_program(plan, name, feeds, float_layers=names[:1])
    assert graph_digest(again) == graph_digest(program)  # torch.export.save's random id aside
    probe = TorchLayerProbe(
        plan, name, feeds, _captured(plan, [(x,) for x in data["x"][16:20]], [name])[name]
    )
    assert sorted(x.name for x in probe.layers) == sorted(names)
    assert probe.error_without(names) < 1e-6 < probe.full_error  # every layer in float: the float graph
