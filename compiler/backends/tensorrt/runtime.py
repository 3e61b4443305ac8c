"""Running TensorRT engines: deserializing a plan, refitting its weights in place, and the callable
:class:`TensorRTEngine`.

Guarantees: a plan is deserialized only after its kiln header passed
:func:`~compiler.backends.tensorrt.engine_format.check_engine_compatible` (the caller's job), and
the library's own validity check where it has one; refit checks names, shapes and dtypes against
the header before TensorRT sees a weight, and fails rather than leave any weight unset; an engine
call checks every input against its spec and runs on the current torch CUDA stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from compiler.backends.base import EngineIO
from compiler.backends.tensorrt.build_settings import choose_profile
from compiler.backends.tensorrt.engine_format import check_refit_weights
from compiler.backends.tensorrt.library import LogWindow, log_collector
from compiler.errors import BackendError, EngineCompatibilityError, InputSpecError, RefitError
from compiler.inputs.specs import dtype_name

_TRT_DTYPE = {
    "float32": lambda trt: trt.DataType.FLOAT,
    "float16": lambda trt: trt.DataType.HALF,
    "bfloat16": lambda trt: trt.DataType.BF16,
    "int32": lambda trt: trt.DataType.INT32,
    "int64": lambda trt: trt.DataType.INT64,
    "int8": lambda trt: trt.DataType.INT8,
    "uint8": lambda trt: trt.DataType.UINT8,
    "bool": lambda trt: trt.DataType.BOOL,
    "float8_e4m3fn": lambda trt: trt.DataType.FP8,
}
_TORCH_DTYPE = {
    "FLOAT": torch.float32,
    "HALF": torch.float16,
    "BF16": torch.bfloat16,
    "INT32": torch.int32,
    "INT64": torch.int64,
    "INT8": torch.int8,
    "UINT8": torch.uint8,
    "BOOL": torch.bool,
    "FP8": torch.float8_e4m3fn,
}


def deserialize(
    trt: Any, backend: str, plan: memoryview, compute_capability: str
) -> tuple[Any, Any, LogWindow]:
    """(runtime, CUDA engine, log window) of a plan whose header fits this library and GPU; ``backend``
    and ``compute_capability`` name them in errors. The engine must not outlive its runtime."""
    version = str(trt.__version__)
    logger = LogWindow(log_collector(trt))
    runtime = trt.Runtime(logger.logger)
    if hasattr(runtime, "engine_host_code_allowed"):
        # A version-compatible plan embeds a runtime library (host code): packages are data, so never.
        runtime.engine_host_code_allowed = False
    if hasattr(runtime, "get_engine_validity"):
        validity, diagnostics = runtime.get_engine_validity(plan)
        if validity != trt.EngineValidity.VALID:
            raise EngineCompatibilityError(
                f"{backend} {version} reports this engine {validity.name} on {compute_capability} "
                f"(diagnostics {diagnostics}): {'; '.join(logger.errors()) or 'no message'}; "
                "rebuild it here"
            )
    cuda_engine = runtime.deserialize_cuda_engine(plan)
    if cuda_engine is None:
        raise EngineCompatibilityError(
            f"{backend} could not deserialize the engine on {compute_capability}: "
            f"{'; '.join(logger.errors()) or 'no message'}"
        )
    return runtime, cuda_engine, logger


def refit_in_place(
    trt: Any, backend: str, header: Mapping, cuda_engine: Any, logger: LogWindow, weights: Mapping
) -> None:
    """Put ``weights`` (canonical name -> tensor) into a deserialized engine, checked against its
    header first; RefitError for an engine built without refit or weights it does not take."""
    if header.get("refit", "none") == "none" or not cuda_engine.refittable:
        raise RefitError(
            "this engine was built without refit (options['refit']='none'); rebuild to change weights"
        )
    check_refit_weights(
        header["weights"], weights, require_all=header["refit"] != "all" or header["stripped"]
    )
    refitter = trt.Refitter(cuda_engine, logger.logger)
    host = {}  # keeps the tensors alive until refit_cuda_engine returns
    for name, tensor in weights.items():
        host[name] = tensor.detach().to("cpu").contiguous()
        value = trt.Weights(
            _TRT_DTYPE[dtype_name(tensor.dtype)](trt), host[name].data_ptr(), host[name].numel()
        )
        if not refitter.set_named_weights(name, value):
            raise RefitError(
                f"{backend} rejected weights {name!r}: {'; '.join(logger.errors()) or 'no message'}"
            )
    missing = [m for m in refitter.get_missing_weights() if m]
    if missing:
        raise RefitError(f"refit would leave weights {sorted(missing)} unset; give them too")
    if not refitter.refit_cuda_engine():
        raise RefitError(f"{backend} refit failed: {'; '.join(logger.errors()) or 'no message'}")


class TensorRTEngine:
    """A deserialized engine with one execution context: CUDA tensors in, CUDA tensors out, on the
    current torch CUDA stream."""

    def __init__(
        self, trt: Any, runtime: Any, cuda_engine: Any, io: EngineIO, *, profiles: list | None = None
    ) -> None:
        self._runtime = runtime  # the engine must not outlive its runtime
        # The header's optimization profiles ({input: [min, opt, max]} each; absent: the one declared).
        self._profiles = [
            {name: tuple(tuple(s) for s in bounds) for name, bounds in p.items()} for p in profiles or ()
        ]
        # No list: the engine's one profile (a header that drops the list of a multi-profile plan is refused).
        if (len(self._profiles) or 1) != cuda_engine.num_optimization_profiles:
            raise EngineCompatibilityError(
                f"engine header lists {len(self._profiles)} optimization profiles, the plan has "
                f"{cuda_engine.num_optimization_profiles}"
            )
        self._active = 0  # a new context starts in profile 0
        self._engine = cuda_engine
        self.io = io
        names = [cuda_engine.get_tensor_name(i) for i in range(cuda_engine.num_io_tensors)]
        inputs = [n for n in names if cuda_engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        outputs = [n for n in names if cuda_engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
        if set(inputs) != {s.name for s in io.inputs} or set(outputs) != set(io.output_names):
            raise EngineCompatibilityError(
                f"engine has inputs {inputs} and outputs {outputs}; EngineIO declares "
                f"{[s.name for s in io.inputs]} and {list(io.output_names)}"
            )
        self._out_dtypes = {n: _TORCH_DTYPE[cuda_engine.get_tensor_dtype(n).name] for n in outputs}
        self._context = cuda_engine.create_execution_context()
        if self._context is None:
            raise BackendError("TensorRT could not create an execution context (out of GPU memory?)")

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        specs = self.io.inputs
        if len(inputs) != len(specs):
            raise InputSpecError(
                f"engine expects {len(specs)} inputs {[s.name for s in specs]}, got {len(inputs)}"
            )
        device = torch.device("cuda", torch.cuda.current_device())
        ctx = self._context
        stream = torch.cuda.current_stream(device)
        if self._profiles:
            try:
                chosen = choose_profile(
                    self._profiles, {s.name: tuple(v.shape) for s, v in zip(specs, inputs, strict=True)}
                )
            except ValueError as exc:
                raise InputSpecError(str(exc)) from None
            if chosen != self._active:
                if not ctx.set_optimization_profile_async(chosen, stream.cuda_stream):
                    raise BackendError(f"TensorRT could not switch to optimization profile {chosen}")
                self._active = chosen
        bound = []
        for spec, value in zip(specs, inputs, strict=True):
            spec.check(value)
            value = value.to(device).contiguous()
            bound.append(value)
            if not ctx.set_input_shape(spec.name, tuple(value.shape)):
                raise InputSpecError(f"engine rejected shape {tuple(value.shape)} for input {spec.name!r}")
            ctx.set_tensor_address(spec.name, value.data_ptr())
        outputs = []
        for name in self.io.output_names:
            shape = tuple(ctx.get_tensor_shape(name))
            if any(d < 0 for d in shape):
                raise BackendError(
                    f"output {name!r} has a data-dependent shape {shape}; kiln engines need shapes "
                    "known from the inputs"
                )
            out = torch.empty(shape, dtype=self._out_dtypes[name], device=device)
            ctx.set_tensor_address(name, out.data_ptr())
            outputs.append(out)
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise BackendError("TensorRT failed to enqueue the engine (execute_async_v3 returned False)")
        return tuple(outputs)
