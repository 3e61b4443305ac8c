"""Engine backends behind one protocol (``compiler.backends.base.EngineBackend``).

``get_backend(name, device="cpu")`` maps a name to a backend instance bound to the device its engines
run on (``CompileOptions.device``), made as the name's record in :mod:`compiler.backends.capabilities`
says: ``onnxruntime`` (the embedded default; CPU, or CUDA where the CUDA execution provider is
installed), ``tensorrt`` and ``tensorrt-rtx`` (one code path, CUDA), ``inductor`` (PyTorch's own
compiler, CPU and CUDA) and ``auto`` (its record's ``choices``: on a CUDA device TensorRT where a
library that runs there is installed, else Inductor; on the CPU ONNX Runtime).

``trust_engine_code``: whether engine bytes may be run as code. Only Inductor engines carry code (a
compiled graph: pickled Inductor cache entries and kernels); an untrusting Inductor backend compiles
each engine from its program instead, with kiln's own settings (``inductor.options``). TensorRT plans
are deserialized with host code disallowed and ONNX models are data (inline only), so those backends
run the same either way. docs/security.md says who trusts what.
"""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING, Any

from compiler.backends.capabilities import backend_names, capabilities, is_backend
from compiler.errors import BackendError, BackendUnavailableError

if TYPE_CHECKING:
    from compiler.backends.base import EngineBackend

TORCH = "torch"  # the backend of a partition that runs as its own PyTorch submodule (no engine)


def __getattr__(name: str) -> Any:
    # The protocol's module imports torch: only a caller that names it pays for it. BACKENDS is read
    # from the capability table when asked, so a backend registered since is in it.
    if name == "EngineBackend":
        from compiler.backends.base import EngineBackend

        return EngineBackend
    if name == "BACKENDS":
        return backend_names()
    raise AttributeError(f"module 'compiler.backends' has no attribute {name!r}")


def get_backend(name: str, device: str = "cpu", *, trust_engine_code: bool = True) -> EngineBackend:
    """The backend ``name`` for models on ``device``; BackendUnavailableError names what is missing."""
    from compiler.device import resolve

    return _backend(name, str(resolve(device)), trust_engine_code)


@cache
def _backend(name: str, device: str, trust_engine_code: bool = True) -> EngineBackend:
    if not is_backend(name):
        raise BackendError(f"unknown backend {name!r}; expected one of {backend_names()}")
    record = capabilities(name)
    if not record.choices:
        return record.make(device, trust_engine_code)
    *first, last = record.choices[device.split(":")[0]]
    for candidate in first:  # the first that builds here and whose engines also run here
        try:
            backend = _backend(candidate, device, trust_engine_code)
            backend.check_runnable()  # TensorRT-RTX builds on an H100 but cannot run there
            return backend
        except (BackendUnavailableError, ImportError):
            continue
    return _backend(last, device, trust_engine_code)
