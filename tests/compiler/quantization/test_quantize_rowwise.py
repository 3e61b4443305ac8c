"""Inductor on CUDA (issue 19): torchao's dynamic rowwise recipes (int8 with ``torch._int_mm``, fp8
with ``torch._scaled_mm``) written into the partition's graph as ATen ops. The graph and its values are
checked here on the CPU (torch's CPU kernels of both GEMMs run the program); builds and speed on CUDA
are tests/gpu/test_quantize_rowwise_gpu.py and benchmarks/quantization_cuda.py.
"""

from __future__ import annotations

import io

import pytest
import torch

import compiler
from benchmarks.quantization import sensitive_case
from compiler.engine_build.float_ops import named
from compiler.errors import PartitionError
from compiler.partitioning.dedup import canonical_weights
from compiler.partitioning.partition import QUANTIZED_PREFIX
from compiler.quantization.recipe import RecipeCall
from compiler.quantization.rowwise import (
    RECIPES,
    _rewritten,
    int8_linear,
    int8_weight,
    layers,
    quantize_fingerprint,
)
from compiler.quantization.torch_layers import TorchLayerProbe

BLOCKS = [f"engine_{i}" for i in range(4)]
GEMMS = {
    "fp8": ("aten._scaled_mm.default", torch.float8_e4m3fn),
    "int8": ("aten._int_mm.default", torch.int8),
}


def _plan(precision: str, width: int = 32):
    _, program, _ = sensitive_case(width=width, blocks=4, hot=2, batch=4, samples=8)
    options = compiler.CompileOptions(
        backend="inductor",
        device="cuda",  # partitioning and the rewrite need no GPU: the graphs stay on the CPU here
        precision=precision,
        quantization="dynamic",
        split_modules=("OutlierBlock",),
    )
    return compiler.partition(program, options)


def _instance(tensors: dict[str, torch.Tensor], name: str) -> list[torch.Tensor]:
    prefix = f"{QUANTIZED_PREFIX}{name}/w"
    own = {int(k[len(prefix) :]): v for k, v in tensors.items() if k.startswith(prefix)}
    return [own[j] for j in range(len(own))]


@pytest.mark.parametrize("precision", ["int8", "fp8"])
def test_one_program_serves_every_instance_each_with_its_own_quantized_weights_and_scales(precision):
    plan = _plan(precision)
    program, tensors = quantize_fingerprint(RecipeCall(plan, BLOCKS))
    exported = torch.export.load(io.BytesIO(program))
    ops = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    gemm, dtype = GEMMS[precision]
    # ATen only (a package's program rules), the linears now low-precision GEMMs
    assert gemm in ops and "aten.linear.default" not in ops
    assert all(op.startswith("aten.") for op in ops)
    computed = {
        n.meta["val"].dtype for n in exported.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
    }
    assert torch.bfloat16 in computed  # the other ops in bf16, as torchao's recipes run
    first, second = (_instance(tensors, b) for b in BLOCKS[:2])
    assert [t.dtype for t in first].count(dtype) == 2  # both linears of the block
    assert [(t.dtype, t.shape) for t in first] == [(t.dtype, t.shape) for t in second]
    assert any(not torch.equal(a.float(), b.float()) for a, b in zip(first, second, strict=True))
    every = plan.weights()
    module = exported.module()
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(0))
    for name in BLOCKS:
        partition = next(p for p in plan.partitions if p.name == name)
        weights = iter(
            every[key] for _, key in sorted(canonical_weights(partition).items(), key=lambda i: int(i[0][1:]))
        )
        args = [x if source.kind == "activation" else next(weights) for source in partition.inputs]
        expected = plan.submodule(name)(*args)[0]
        actual = module(x, *_instance(tensors, name))[0]
        error = float((actual - expected).detach().norm() / expected.detach().norm())
        assert 0 < error < 0.1, (name, error)  # close, not equal


def test_int8_pads_rows_cublas_refuses_only_where_the_specs_allow_that_few():
    # batch 4: four rows, which cuBLAS's int8 GEMM refuses (it needs 17): the graph pads them
    program, _ = quantize_fingerprint(RecipeCall(_plan("int8"), BLOCKS))
    ops = [str(n.target) for n in torch.export.load(io.BytesIO(program)).graph.nodes]
    assert "aten.pad.default" in ops and "aten.slice.Tensor" in ops
    # and the padded GEMM gives the unpadded one's rows
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 32, generator=generator), torch.randn(24, 32, generator=generator)
    weight, scale = int8_weight(w)
    torch.testing.assert_close(int8_linear(x, weight, scale, None, True), int8_linear(x, weight, scale))
    error = float((int8_linear(x, weight, scale) - x @ w.t()).norm() / (x @ w.t()).norm())
    assert 0 < error < 0.05, error


def test_a_block_without_an_aligned_linear_is_refused_by_name():
    plan = _plan("fp8", width=24)  # 24: a multiple of 8 (int8) but not of 16 (fp8)
    with pytest.raises(compiler.errors.QuantizationError, match=r"no linear .* multiples of 16 \(fp8"):
        quantize_fingerprint(RecipeCall(plan, ["engine_0"]))


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (
            {"precision": "fp8", "quantization": "dynamic"},
            r"precision fp8 with backend 'inductor' on cpu: .*8\.9\+; use device: cuda",
        ),
        (
            {"precision": "fp8", "device": "cuda"},
            r"fp8 with backend 'inductor' on CUDA scales activations per row.*quantization: dynamic",
        ),
        (
            {"precision": "int8", "device": "cuda", "partition_precision": {"engine_0": "fp8"}},
            r"fp8 and int8 with backend 'inductor' on CUDA .*quantization: dynamic",
        ),
    ],
)
def test_what_inductor_cannot_do_on_cuda_is_refused_by_name(settings, match):
    with pytest.raises(PartitionError, match=match):
        compiler.CompileOptions(backend="inductor", **settings)
    # and float precisions on CUDA need none of it
    assert (
        compiler.CompileOptions(backend="inductor", device="cuda", precision="bf16").quantization == "static"
    )


def test_inductor_cuda_settings_keep_dedup_need_no_calibration_and_name_their_gemm():
    options = compiler.CompileOptions(
        backend="inductor",
        precision="int8",
        device="cuda",
        quantization="dynamic",
        partition_precision={"engine_0": "fp8"},  # both recipes in one compile
    )
    int8, fp8 = options.quantization_settings("int8"), options.quantization_settings("fp8")
    assert int8["scales"] == fp8["scales"] == "refit" and int8["mode"] == fp8["mode"] == "dynamic"
    assert int8["graph"] != fp8["graph"]  # different graphs, so different fingerprints
    assert options.compute_precision("engine_0") == options.compute_precision("engine_1") == "bf16"


def test_linears_kept_in_float_stay_float_and_the_probe_measures_each():
    """Accuracy repair's layers on CUDA (issue 46): the linears named in float_layers (canonical node
    names of the partition's graph) are left out of the rewrite, weight and GEMM."""
    plan, name = _plan("int8"), BLOCKS[2]
    names = layers(plan, name)
    assert len(names) == 2  # the block's two linears
    graph, _, _ = _rewritten(plan, name, RECIPES["int8"], names[:1])
    kept = [canonical for canonical, node in named(graph) if node.target is torch.ops.aten.linear.default]
    assert kept == names[:1] and sum(n.target is int8_linear for n in graph.graph.nodes) == 1
    recipe = {**plan.options.partition_quantization(name, "int8"), "float_layers": names[:1]}
    _, tensors = quantize_fingerprint(RecipeCall(plan, [name], settings=recipe))
    assert [t.dtype for t in _instance(tensors, name)].count(torch.int8) == 1  # one weight int8, one not
    # The probe runs the recipe's module in PyTorch (here on the CPU, where the plan's weights are).
    generator = torch.Generator().manual_seed(1)
    feeds = [{"x0": torch.randn(4, 32, generator=generator).numpy()} for _ in range(3)]
    probe = TorchLayerProbe(plan, name, [], feeds)
    assert sorted(x.name for x in probe.layers) == sorted(names) and all(x.flops > 0 for x in probe.layers)
    assert probe.error_without(names) < probe.full_error  # both in float: only the bf16 around them
    assert all(probe.gain(x).rel_l2 != 0 for x in probe.layers)


class _Reshaping(torch.nn.Module):
    """Two linears around a view by the dynamic batch size: the partition's graph holds size nodes."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(32, 64), torch.nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        return self.b(self.a(x).view(b * t, 64)).view(b, t, 32)


def test_a_dynamic_partition_names_its_linears_past_its_size_nodes():
    """A partition with a dynamic dimension computes sizes (SymInt values, no tensors) in its graph:
    the layer list accuracy repair searches (on the GPU, issue 46) reads past them."""
    batch = torch.export.Dim("batch", min=1, max=8)
    program = compiler.export(_Reshaping().eval(), (torch.randn(2, 4, 32),), dynamic_shapes=({0: batch},))
    options = compiler.CompileOptions(
        backend="inductor", device="cuda", precision="int8", quantization="dynamic"
    )
    plan = compiler.partition(program, options)
    name = plan.partitions[0].name
    sizes = [n for n in plan.submodule(name).graph.nodes if isinstance(n.meta.get("val"), torch.SymInt)]
    assert sizes  # what made the search fail on the H100
    assert len(layers(plan, name)) == 2
