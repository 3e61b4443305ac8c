"""The Triton + eager PyTorch arm of ``benchmarks/triton_serving.py``: kiln's Python backend runtime
(the same request checks, batching and DLPack hand-over as ``serving/triton/backend/model.py``) around
the benchmark's eager module instead of ``compiler.load``. Copied as ``model.py`` into the benchmark's
own repository folder; never part of a kiln repository.
"""

import os
import site
import sys

_before = list(sys.path)
for _path in [p for p in os.environ.get("KILN_TRITON_PYTHONPATH", "").split(os.pathsep) if p]:
    site.addsitedir(_path)
sys.path[:] = [p for p in sys.path if p not in _before] + _before

import triton_python_backend_utils as pb_utils  # noqa: E402

from serving.triton.runtime import ServedRuntime  # noqa: E402


def _eager(package_dir, device, served):
    import compiler
    from benchmarks.triton_serving import bench_model

    return bench_model(0).to(device).eval(), compiler.read_manifest(package_dir).input_specs


class TritonPythonModel:
    def initialize(self, args):
        self.runtime = ServedRuntime.from_triton_args(args, pb_utils, load=_eager)

    def execute(self, requests):
        return self.runtime.execute(requests)
