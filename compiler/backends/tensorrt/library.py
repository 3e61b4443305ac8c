"""The TensorRT libraries themselves: which module each backend name imports, the GPU's compute
capability, and the library's log messages.

Guarantees: importing this module imports no TensorRT library and touches no GPU; a missing library
is a :class:`BackendUnavailableError` naming the pip extra that installs it; every message TensorRT
logs reaches the one collector per library, and a :class:`LogWindow` returns only those logged
since it opened (one build, load or refit).
"""

from __future__ import annotations

import functools
import importlib
import threading
from typing import Any

import torch

from compiler.errors import BackendUnavailableError

# name -> (importable module names, tried in order; pip extra that installs the library)
LIBRARIES: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorrt": (("tensorrt", "tensorrt_bindings"), "kiln[tensorrt]"),
    "tensorrt-rtx": (("tensorrt_rtx", "tensorrt_rtx_bindings"), "kiln[tensorrt-rtx]"),
}

# Compute capabilities a TensorRT-RTX engine runs on when none is set at build time
# (TensorRT-RTX docs, "CPU-only AOT": 8.0, 8.6, 8.9, 12.0 and later). sm_90 (H100/H200) is not one.
RTX_DEFAULT_COMPUTE_CAPABILITIES = ("sm_80", "sm_86", "sm_89", "sm_120")


def import_library(name: str) -> Any:
    """The library module of backend ``name`` (BackendUnavailableError naming the extra if absent)."""
    modules, extra = LIBRARIES[name]
    errors = []
    for module in modules:
        try:
            return importlib.import_module(module)
        except ImportError as exc:
            errors.append(f"{module}: {exc}")
    raise BackendUnavailableError(
        f"the {name} backend needs the Python module {modules[0]!r}, which is not "
        "importable "
        f"here ({'; '.join(errors)}); install it with: pip install {extra}"
    )


def current_compute_capability() -> str | None:
    """The current CUDA GPU's compute capability (``sm_90``), or None without a GPU."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


@functools.cache
def log_collector(trt: Any) -> Any:
    """The process-wide logger for one library: TensorRT keeps the first logger a builder, runtime or
    refitter was given and ignores later ones, so per-call loggers would lose every message."""

    class _Collector(trt.ILogger):
        def __init__(self) -> None:
            trt.ILogger.__init__(self)
            self.messages: list[str] = []  # the last 200 warnings and errors
            self.total = 0  # how many were ever logged, so a window knows which are its own
            self.lock = threading.Lock()

        def log(self, severity: Any, msg: str) -> None:
            if severity <= trt.ILogger.WARNING and "logger passed into" not in msg:
                with self.lock:
                    self.messages.append(msg)
                    self.total += 1
                    del self.messages[:-200]

    return _Collector()


class LogWindow:
    """The messages logged since this window opened (for one build, load or refit)."""

    def __init__(self, collector: Any) -> None:
        self.logger = collector
        self._start = collector.total

    def errors(self) -> list[str]:
        with self.logger.lock:
            new = self.logger.total - self._start
            return self.logger.messages[-new:][-20:] if new else []
