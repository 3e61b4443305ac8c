"""fp8 on Inductor (issue 19): torchao's rowwise recipe written into the partition's graph as ATen ops.
The graph and its values are checked here on the CPU (torch's reference ``_scaled_mm`` runs the
program); builds and speed on CUDA are tests/gpu/test_quantize_fp8_gpu.py and benchmarks/fp8_inductor.py.
"""

from __future__ import annotations

import io

import pytest
import torch

import compiler
from benchmarks.quantization import sensitive_case
from compiler.dedup import canonical_weights
from compiler.errors import PartitionError
from compiler.partition import QUANTIZED_PREFIX
from compiler.quantize_fp8 import quantize_fingerprint

BLOCKS = [f"engine_{i}" for i in range(4)]


@pytest.fixture(scope="module")
def plan():
    _, program, _ = sensitive_case(width=32, blocks=4, hot=2, batch=4, samples=8)
    return compiler.partition(
        program, compiler.CompileOptions(backend="inductor", split_modules=("OutlierBlock",))
    )


def _instance(tensors: dict[str, torch.Tensor], name: str) -> list[torch.Tensor]:
    prefix = f"{QUANTIZED_PREFIX}{name}/w"
    own = {int(k[len(prefix) :]): v for k, v in tensors.items() if k.startswith(prefix)}
    return [own[j] for j in range(len(own))]


def test_one_program_serves_every_instance_each_with_its_own_fp8_weights_and_scales(plan):
    program, tensors = quantize_fingerprint(plan, BLOCKS)
    exported = torch.export.load(io.BytesIO(program))
    ops = {str(n.target) for n in exported.graph.nodes if n.op == "call_function"}
    # ATen only (a package's program rules), the linears now fp8 GEMMs
    assert "aten._scaled_mm.default" in ops and "aten.linear.default" not in ops
    assert all(op.startswith("aten.") for op in ops)
    first, second = (_instance(tensors, b) for b in BLOCKS[:2])
    assert [t.dtype for t in first].count(torch.float8_e4m3fn) == 2  # both linears of the block
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
        assert 0 < error < 0.1, (name, error)  # fp8: close, not equal


def test_a_block_without_an_aligned_linear_is_refused_by_name():
    _, program, _ = sensitive_case(width=24, blocks=2, hot=1, batch=4, samples=8)  # 24: not 16-aligned
    plan = compiler.partition(
        program, compiler.CompileOptions(backend="inductor", split_modules=("OutlierBlock",))
    )
    with pytest.raises(compiler.errors.QuantizationError, match=r"no linear .* multiples of 16"):
        quantize_fingerprint(plan, ["engine_0"])


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        (
            {"quantization": "dynamic"},
            r"precision fp8 with backend 'inductor' on cpu: .*8\.9\+; use device: cuda",
        ),
        (
            {"device": "cuda"},
            r"fp8 with backend 'inductor' scales activations per row.*quantization: dynamic",
        ),
        (
            {"device": "cuda", "quantization": "dynamic", "partition_precision": {"engine_0": "int8"}},
            r"int8 on the CPU and fp8 on CUDA",
        ),
    ],
)
def test_what_inductor_fp8_cannot_do_is_refused_by_name(settings, match):
    with pytest.raises(PartitionError, match=match):
        compiler.CompileOptions(backend="inductor", precision="fp8", **settings)


def test_inductor_fp8_settings_keep_dedup_and_need_no_calibration():
    options = compiler.CompileOptions(
        backend="inductor", precision="fp8", device="cuda", quantization="dynamic"
    )
    settings = options.quantization_settings("fp8")
    assert settings["scales"] == "refit" and settings["mode"] == "dynamic"
