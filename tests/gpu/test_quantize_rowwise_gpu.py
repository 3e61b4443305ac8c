"""Inductor's quantized GEMMs on CUDA (issue 19): int8 (``torch._int_mm``) and fp8 (``torch._scaled_mm``,
compute capability 8.9+) built and run on the GPU; skips elsewhere with the reason.

    python3 -m pytest -q tests/gpu/test_quantize_rowwise_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import compiler
from benchmarks.quantization import sensitive_case

CUDA = torch.cuda.is_available()
FP8 = CUDA and torch.cuda.get_device_capability() >= (8, 9)
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]


@pytest.mark.parametrize(
    ("precision", "batch"),
    [
        ("int8", 32),
        ("int8", 4),  # 4 rows: cuBLAS's int8 GEMM needs 17, so the graph pads them
        pytest.param(
            "fp8", 32, marks=pytest.mark.skipif(not FP8, reason="fp8 GEMMs need compute capability 8.9+")
        ),
    ],
)
def test_quantized_blocks_build_once_run_on_the_gpu_and_round_trip_stripped(tmp_path, precision, batch):
    model, _, data = sensitive_case(width=256, blocks=4, hot=2, batch=32, samples=8)
    model = model.cuda()
    program = compiler.export(model, (data["x"][0][:batch].cuda(),))
    options = compiler.CompileOptions(
        backend="inductor",
        device="cuda",
        precision=precision,
        quantization="dynamic",
        split_modules=("OutlierBlock",),
        strip_weights=True,
    )
    compiled = compiler.compile(program, options, cache=False)
    # The 10-class head's weight (10 rows) fits neither GEMM's alignment (8, 16): it stays float.
    assert list(compiled.report.quantization["fallbacks"]) == ["engine_4"]
    assert compiled.report.unique_fingerprints == 2  # four blocks, one engine; the head
    x = data["x"][5][:batch].cuda()
    with torch.no_grad():
        expected, actual = model(x), compiled(x)
    assert actual.device.type == "cuda"
    error = float((actual - expected).norm() / expected.norm())
    assert 0 < error < 0.1, error
    compiler.save(compiled, tmp_path / f"{precision}.kiln")
    loaded = compiler.load(tmp_path / f"{precision}.kiln", device="cuda")
    torch.testing.assert_close(loaded(x), actual)


def test_partition_errors_are_measured_where_the_module_replays_cuda_graphs():
    """compare_partitions hooks each partition's module; a CUDA-graph replay calls none of them. Run
    uncaptured, the quantized blocks show their error (repair ranks by it: issue 46 on the H100)."""
    model, _, data = sensitive_case(width=256, blocks=4, hot=2, batch=32, samples=8)
    model = model.cuda()
    program = compiler.export(model, (data["x"][0].cuda(),))
    options = compiler.CompileOptions(
        backend="inductor",
        device="cuda",
        precision="int8",
        quantization="dynamic",
        split_modules=("OutlierBlock",),
    )
    compiled = compiler.compile(program, options, cache=False)
    x = data["x"][1].cuda()
    compiled(x), compiled(x)  # captured and replayed where the module takes CUDA graphs
    table = compiler.compare_partitions(compiled, [x], runs=0)
    quantized = [r for r in table.rows if r.precision == "int8"]
    assert quantized and all(r.rel_l2 > 0 for r in quantized), table.rows
