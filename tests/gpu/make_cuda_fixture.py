"""Run on the GPU machine: writes the CUDA package that tests/test_runtime_device.py loads on a machine
without a GPU ("a package moved to a machine without a GPU", issue 15): the example MLP with its custom
op, Inductor engines built for cuda:0, signed by nothing, saved with this machine's torch.

    python3 tests/gpu/make_cuda_fixture.py $OUT/mlp-cuda-inductor.kiln

Copy the folder to tests/fixtures/packages/ and commit it.
"""

from __future__ import annotations

import sys

import torch

import compiler
from compiler.device import to_device
from zoo.models import mlp_with_fallback


def main(path: str) -> None:
    case = mlp_with_fallback(width=16)
    model, args, kwargs = to_device(case.model, case.args, case.kwargs, device="cuda:0")
    program = compiler.export(model, args, kwargs, dynamic_shapes=case.dynamic_shapes)
    compiled = compiler.compile(program, backend="inductor", device="cuda:0", cache=False)
    assert any(a.backend == "inductor" for a in compiled.engines.values()), compiled.report.build_failures
    torch.testing.assert_close(compiled(*args, **kwargs), model(*args, **kwargs), rtol=1e-4, atol=1e-4)
    info = compiler.save(compiled, path)
    print(path, info.manifest.engine_target, torch.__version__)


if __name__ == "__main__":
    main(sys.argv[1])
