"""fp8 on Inductor, built and run on a CUDA GPU of compute capability 8.9+ (issue 19); skips elsewhere
with the reason.

    python3 -m pytest -q tests/gpu/test_quantize_fp8_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import compiler
from benchmarks.quantization import sensitive_case

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
        reason="needs a CUDA GPU of compute capability 8.9+ (fp8 GEMMs)",
    ),
]


def test_fp8_blocks_build_once_run_on_the_gpu_and_round_trip_stripped(tmp_path):
    model, program, data = sensitive_case(width=256, blocks=4, hot=2, batch=32, samples=8)
    model = model.cuda()
    program = compiler.export(model, (data["x"][0].cuda(),))
    options = compiler.CompileOptions(
        backend="inductor",
        device="cuda",
        precision="fp8",
        quantization="dynamic",
        split_modules=("OutlierBlock",),
        strip_weights=True,
    )
    compiled = compiler.compile(program, options, cache=False)
    # The 10-class head's weight (10 rows) does not fit the fp8 GEMM's 16-alignment: it stays float.
    assert list(compiled.report.quantization["fallbacks"]) == ["engine_4"]
    assert compiled.report.unique_fingerprints == 2  # four blocks, one engine; the head
    x = data["x"][5].cuda()
    with torch.no_grad():
        expected, actual = model(x), compiled(x)
    assert actual.device.type == "cuda"
    error = float((actual - expected).norm() / expected.norm())
    assert 0 < error < 0.1, error
    compiler.save(compiled, tmp_path / "fp8.kiln")
    loaded = compiler.load(tmp_path / "fp8.kiln", device="cuda")
    torch.testing.assert_close(loaded(x), actual)
