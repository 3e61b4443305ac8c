"""Engine backends behind one protocol (``compiler.backends.base.EngineBackend``).

``get_backend(name, device="cpu")`` maps a name to a backend instance bound to the device its engines
run on (``CompileOptions.device``): ``onnxruntime`` (the embedded default; CPU, or CUDA where the CUDA
execution provider is installed), ``tensorrt`` and ``tensorrt-rtx`` (one code path, CUDA), ``inductor``
(PyTorch's own compiler, CPU and CUDA) and ``auto`` (on a CUDA device: TensorRT where a library that
runs there is installed, else Inductor; on the CPU: ONNX Runtime).

``trust_engine_code``: whether engine bytes may be run as code. Only Inductor engines carry code (a
compiled graph: pickled Inductor cache entries and kernels); an untrusting Inductor backend compiles
each engine from its program instead, with kiln's own settings (``inductor.options``). TensorRT plans
are deserialized with host code disallowed and ONNX models are data (inline only), so those backends
run the same either way. docs/security.md says who trusts what.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

from compiler.errors import BackendError, BackendUnavailableError

if TYPE_CHECKING:
    from compiler.backends.base import EngineBackend

BACKENDS = ("onnxruntime", "tensorrt", "tensorrt-rtx", "inductor", "auto")
TORCH = "torch"  # the backend of a partition that runs as its own PyTorch submodule (no engine)


def __getattr__(name: str) -> Any:
    # The protocol's module imports torch: only a caller that names it pays for it.
    if name == "EngineBackend":
        from compiler.backends.base import EngineBackend

        return EngineBackend
    raise AttributeError(f"module 'compiler.backends' has no attribute {name!r}")


def get_backend(name: str, device: str = "cpu", *, trust_engine_code: bool = True) -> EngineBackend:
    """The backend ``name`` for models on ``device``; BackendUnavailableError names what is missing."""
    from compiler.device import resolve

    return _backend(name, str(resolve(device)), trust_engine_code)


@cache
def _backend(name: str, device: str, trust_engine_code: bool = True) -> EngineBackend:
    if name == "onnxruntime":
        from compiler.backends.onnxruntime import OnnxRuntimeBackend

        backend = OnnxRuntimeBackend()
        if device != "cpu" and not backend.target_device().startswith("cuda"):
            raise BackendUnavailableError(
                f"backend 'onnxruntime' runs on the CPU only here (providers {backend.providers}); device "
                f"{device!r} needs onnxruntime-gpu, or backend 'inductor' or 'tensorrt'"
            )
        return backend
    if name in ("tensorrt", "tensorrt-rtx"):
        from compiler.backends.tensorrt.builder import TensorRTBackend

        return TensorRTBackend(name)
    if name == "inductor":
        from compiler.backends.inductor.backend import InductorBackend

        return InductorBackend(device, trust_engine_code=trust_engine_code)
    if name == "auto":
        if device == "cpu":
            return _backend("onnxruntime", device, trust_engine_code)
        for candidate in ("tensorrt", "tensorrt-rtx"):
            try:
                backend = _backend(candidate, device, trust_engine_code)
                backend.check_runnable()  # TensorRT-RTX builds on an H100 but cannot run there
                return backend
            except (BackendUnavailableError, ImportError):
                continue
        return _backend("inductor", device, trust_engine_code)
    raise BackendError(f"unknown backend {name!r}; expected one of {BACKENDS}")
