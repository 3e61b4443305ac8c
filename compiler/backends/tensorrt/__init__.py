"""TensorRT and TensorRT-RTX engines: one code path for both libraries (same Python API).

``TensorRTBackend("tensorrt")`` drives NVIDIA TensorRT 10/11 (``pip install kiln[tensorrt]``),
``TensorRTBackend("tensorrt-rtx")`` drives TensorRT for RTX (``pip install kiln[tensorrt-rtx]``).
Constructing a backend imports the library and needs a CUDA GPU (BackendUnavailableError
otherwise); the op table (:func:`tensorrt_supports`) needs neither. ``check_runnable()`` says
whether engines built here can also run here (TensorRT-RTX builds on an H100 but refuses to run
on sm_90).

Words: the *engine target* is what an engine is built for, the GPU compute capabilities it runs on
(``cuda:sm_90``; :class:`EngineTarget`); ``target_device()`` is the backend protocol's name for it.
The *device* is where a model runs (``cuda:1``), which is not decided here.

One module per job; the first three call into TensorRT, the other four run (and are tested) on
any CPU without it:

- ``builder``: :class:`TensorRTBackend`: parse, build (profile, flags, timing cache), load, refit.
- ``runtime``: deserializing and refitting plans, and the callable :class:`TensorRTEngine`.
- ``library``: importing the library, the GPU's compute capability, TensorRT's log messages.
- ``support``: the op table: which ATen ops go into an engine, and why not.
- ``engine_format``: kiln's engine file (header + xz-compressed stripped plan) and its checks.
- ``onnx_rewrites``: canonical weights and the rewrites that keep them refittable.
- ``build_settings``: optimization profile, refit mode and builder flags from kiln's settings.
"""

from compiler.backends.tensorrt.build_settings import (
    BACKEND_OPTIONS,
    REFIT_MODES,
    builder_flag_names,
    profile_shapes,
    refit_mode,
)
from compiler.backends.tensorrt.builder import TensorRTBackend
from compiler.backends.tensorrt.engine_format import (
    EngineTarget,
    check_engine_compatible,
    check_header,
    check_refit_weights,
    decode_engine,
    encode_engine,
)
from compiler.backends.tensorrt.library import LIBRARIES, RTX_DEFAULT_COMPUTE_CAPABILITIES
from compiler.backends.tensorrt.onnx_rewrites import canonical_weights, unfold_batch_norm
from compiler.backends.tensorrt.runtime import TensorRTEngine
from compiler.backends.tensorrt.support import (
    EXPORTER_FOLDED_SEQUENCE_OPS,
    PARSER_REJECTED_ONNX_OPS,
    onnx_ops_for,
    tensorrt_supports,
    unsupported_reason,
)

__all__ = [
    "BACKEND_OPTIONS",
    "EXPORTER_FOLDED_SEQUENCE_OPS",
    "LIBRARIES",
    "PARSER_REJECTED_ONNX_OPS",
    "REFIT_MODES",
    "RTX_DEFAULT_COMPUTE_CAPABILITIES",
    "EngineTarget",
    "TensorRTBackend",
    "TensorRTEngine",
    "builder_flag_names",
    "canonical_weights",
    "check_engine_compatible",
    "check_header",
    "check_refit_weights",
    "decode_engine",
    "encode_engine",
    "onnx_ops_for",
    "profile_shapes",
    "refit_mode",
    "tensorrt_supports",
    "unfold_batch_norm",
    "unsupported_reason",
]
