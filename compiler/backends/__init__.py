"""Engine backends behind one protocol (``compiler.backends.base.EngineBackend``).

``get_backend(name)`` maps a name to a backend instance: ``onnxruntime`` (the embedded default, runs
anywhere), ``tensorrt`` and ``tensorrt-rtx`` (one code path), and ``auto`` (TensorRT where a GPU and
a TensorRT library are present, else ONNX Runtime).
"""

from __future__ import annotations

from functools import cache

from compiler.backends.base import EngineBackend
from compiler.errors import BackendError, BackendUnavailableError

BACKENDS = ("onnxruntime", "tensorrt", "tensorrt-rtx", "auto")


@cache
def get_backend(name: str) -> EngineBackend:
    if name == "onnxruntime":
        from compiler.backends.onnxruntime import OnnxRuntimeBackend

        return OnnxRuntimeBackend()
    if name in ("tensorrt", "tensorrt-rtx"):
        from compiler.backends.tensorrt import TensorRTBackend

        return TensorRTBackend(name)
    if name == "auto":
        for candidate in ("tensorrt", "tensorrt-rtx"):
            try:
                backend = get_backend(candidate)
                backend.check_runnable()  # TensorRT-RTX builds on an H100 but cannot run there
                return backend
            except (BackendUnavailableError, ImportError):
                continue
        return get_backend("onnxruntime")
    raise BackendError(f"unknown backend {name!r}; expected one of {BACKENDS}")
