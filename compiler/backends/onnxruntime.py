"""ONNX Runtime: the embedded default backend (CPU everywhere; CUDA EP where installed).

The "engine" is the lowered ONNX model, checked by creating a session once at build time. Weights
are initializers with canonical names; a weight-stripped engine keeps each initializer's name, shape
and dtype but not its bytes, and loading fills them in (refit), so stripped and full engines run the
very same graph and give bit-identical outputs.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from functools import cached_property
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from onnx import numpy_helper

from compiler.backends.base import BuildSettings, EngineIO, RecordedBackend, is_weight_name, to_numpy
from compiler.backends.onnx_inline import check_self_contained
from compiler.backends.onnx_support import onnx_exportable
from compiler.errors import (
    BackendUnavailableError,
    BuildSettingsError,
    EngineBuildError,
    InputSpecError,
    RefitError,
    UnsafeEngineError,
)


class OnnxRuntimeEngine:
    """A loaded engine: torch tensors in, torch tensors out (numpy views on CPU, no copies)."""

    def __init__(self, session: ort.InferenceSession, io: EngineIO):
        self.session = session
        self.io = io
        self._input_names = [spec.name for spec in io.inputs]

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for name, t in zip(self._input_names, inputs, strict=False):
            if t.device.type != "cpu":  # never copy to the host and answer on another device than asked
                raise InputSpecError(
                    f"ONNX Runtime engine input {name!r} is on {t.device}; this engine runs on the CPU"
                )
        feed = {
            name: t.detach().contiguous().cpu().numpy()
            for name, t in zip(self._input_names, inputs, strict=True)
        }
        outputs = self.session.run(None, feed)
        return tuple(torch.from_numpy(np.ascontiguousarray(out)) for out in outputs)


def create(name: str, device: str, trust_engine_code: bool) -> OnnxRuntimeBackend:
    """Its record's maker (compiler.backends.capabilities): ONNX models are data, so trust changes nothing."""
    backend = OnnxRuntimeBackend()
    if device != "cpu" and not backend.engine_target().startswith("cuda"):
        raise BackendUnavailableError(
            f"backend 'onnxruntime' runs on the CPU only here (providers {backend.providers}); device "
            f"{device!r} needs onnxruntime-gpu, or backend 'inductor' or 'tensorrt'"
        )
    return backend


class OnnxRuntimeBackend(RecordedBackend):
    name = "onnxruntime"

    def library_version(self) -> str:
        return ort.__version__

    def engine_target(self) -> str:
        return "cuda" if "CUDAExecutionProvider" in self.providers else "cpu"

    @cached_property
    def providers(self) -> list[str]:
        available = ort.get_available_providers()
        return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available]

    def supports(self, target: Any) -> bool:
        # ONNX Runtime runs every ONNX operator, so an ATen op is supported iff the torch.onnx
        # exporter has a translation for it.
        return onnx_exportable(target)

    def build(
        self,
        onnx_model: bytes,
        io: EngineIO,
        settings: BuildSettings,
        *,
        partition: str | None = None,
        cache_dir: str | os.PathLike | None = None,  # ONNX Runtime keeps no build-time cache
    ) -> bytes:
        model = onnx.load_from_string(onnx_model)
        intra_op_threads()  # a bad setting is the operator's error, not this partition's
        try:
            self._session(model.SerializeToString())
        except Exception as exc:  # onnxruntime raises its own Fail/InvalidGraph types
            raise EngineBuildError(
                f"ONNX Runtime rejected partition {partition or model.graph.name}: {exc}",
                partition=partition,
                node=_error_node(str(exc), model),
            ) from exc
        check_self_contained(model)  # what a load will demand: kiln never writes data outside an engine
        if settings.strip_weights:
            for init in _weights(model):
                _strip(init)
        return model.SerializeToString()

    def load(
        self,
        engine: bytes,
        io: EngineIO,
        weights: Mapping[str, torch.Tensor] | None,
        *,
        siblings: int = 0,
        cache: object = None,  # keeps nothing compiled at load
    ) -> OnnxRuntimeEngine:
        model = _parse(engine)
        supplied: dict[str, np.ndarray] = {}
        if weights is not None or _is_stripped(model):
            arrays = _checked_weights(model, weights or {})
            # Float weights come from memory; integer ones (index buffers, which shape inference may
            # read) and bfloat16 (no numpy type ONNX Runtime takes) are written into the model.
            supplied = {n: a for n, a in arrays.items() if a.dtype.kind == "f" and a.dtype.name != "bfloat16"}
            _write(model, {n: a for n, a in arrays.items() if n not in supplied})
            for init in _weights(model):
                if init.name in supplied:
                    _strip(init)
        check_self_contained(model, supplied=frozenset(supplied))
        constants = {init.name for init in model.graph.initializer}
        takes = [i.name for i in model.graph.input if i.name not in constants]
        gives = [o.name for o in model.graph.output]
        if takes != [s.name for s in io.inputs] or len(gives) != len(io.output_names):
            raise UnsafeEngineError(
                f"ONNX engine takes {takes} and gives {len(gives)} outputs; its record says "
                f"{[s.name for s in io.inputs]} and {len(io.output_names)}"
            )
        try:
            session = self._session(model.SerializeToString(), supplied, spin=siblings == 0)
        except Exception:  # a weight some shape inference reads: every weight written in, as before
            if not supplied:
                raise
            _write(model, supplied)
            session = self._session(model.SerializeToString(), spin=siblings == 0)
        return OnnxRuntimeEngine(session, io)

    def refit(self, engine: bytes, weights: Mapping[str, torch.Tensor]) -> bytes:
        model = _parse(engine)
        _fill(model, weights)
        return model.SerializeToString()

    def _session(
        self, model_bytes: bytes, weights: Mapping[str, np.ndarray] | None = None, *, spin: bool = True
    ) -> ort.InferenceSession:
        """A session for the model; ``weights`` (name -> array) fill its weight-stripped initializers from
        memory: ONNX Runtime copies them in before optimizing, as if they were in the model, without a
        serialize and parse of the whole model (BERT-base: 2.5 s -> 0.5 s on a 2-core CPU).

        ``spin``: whether the session's idle intra-op threads busy-wait for the next call. Alone in a
        module that wins a little (0.92x the latency of sleeping threads at batch 1 on 2 cores); where a
        module runs several sessions one after another, each one's spinning threads take the cores from
        the next (BERT split per layer: 3.1x slower at batch 1), so engines with siblings sleep
        (benchmarks/ort_threads.py)."""
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.log_severity_level = 3
        options.intra_op_num_threads = intra_op_threads()
        if not spin:
            options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        if weights:
            names = list(weights)
            options.add_external_initializers(
                names, [ort.OrtValue.ortvalue_from_numpy(weights[n]) for n in names]
            )
        return ort.InferenceSession(model_bytes, options, providers=self.providers)


def intra_op_threads() -> int:
    """``$KILN_ORT_THREADS``: threads per ONNX Runtime session (0, the default: one per physical core,
    ONNX Runtime's own choice). On a many-core host small graphs can lose more to waking threads for
    each node than they gain (benchmarks/quantization.py --ort-threads)."""
    text = os.environ.get("KILN_ORT_THREADS", "").strip()
    if not text:
        return 0
    if not text.isdigit() or int(text) > 4096:
        raise BuildSettingsError(
            f"KILN_ORT_THREADS={text!r}: expected a thread count (0: ONNX Runtime's choice)"
        )
    return int(text)


def _parse(engine: bytes) -> onnx.ModelProto:
    try:
        return onnx.load_from_string(engine)
    except Exception as exc:  # protobuf's DecodeError
        raise UnsafeEngineError(f"not an ONNX engine: {type(exc).__name__}: {exc}") from exc


def _error_node(text: str, model: onnx.ModelProto) -> str | None:
    """The node an ONNX Runtime error names, with its op type: ``n1 (Gemm)``.

    Errors say ``Node (n1) ...`` or ``... for Gemm(13) node with name 'n1'``; a node its optimizer made
    carries a suffix (``n2/GemmTransposeFusion/``) or no name, and then the op type is what is known.
    """
    found = re.search(r"[Nn]ode \(([^)]*)\)", text)
    if found:
        name, op = found.group(1), None
    else:
        found = re.search(r"for (\w+)\(\d+\) node with name '([^']*)'", text)
        if not found:
            return None
        op, name = found.group(1), found.group(2)
    base = name.split("/")[0]
    op = next((n.op_type for n in model.graph.node if base and n.name == base), op)
    if not base:
        return op
    return f"{base} ({op})" if op else base


def _weights(model: onnx.ModelProto) -> list[onnx.TensorProto]:
    return [init for init in model.graph.initializer if is_weight_name(init.name)]


def _strip(init: onnx.TensorProto) -> None:
    for attr in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
        init.ClearField(attr)
    # Marked external with no location: the bytes come from refit at load, from nowhere on disk.
    init.data_location = onnx.TensorProto.EXTERNAL
    del init.external_data[:]


def strip_engine(engine: bytes) -> bytes:
    """The engine without its weights' bytes (names, shapes and dtypes kept), as a weight-stripped build
    makes it: what a package stores, whose load passes every engine its weights (capabilities'
    ``package_strip``)."""
    model = _parse(engine)
    for init in _weights(model):
        _strip(init)
    return model.SerializeToString()


def _is_stripped(model: onnx.ModelProto) -> bool:
    return any(init.data_location == onnx.TensorProto.EXTERNAL for init in _weights(model))


def _checked_weights(model: onnx.ModelProto, weights: Mapping[str, torch.Tensor]) -> dict[str, np.ndarray]:
    """The weights as arrays, checked against the model's weight initializers (names, shapes, dtypes)."""
    inits = {init.name: init for init in _weights(model)}
    missing = sorted(set(inits) - set(weights))
    unknown = sorted(set(weights) - set(inits))
    if missing or unknown:
        raise RefitError(f"refit weights do not match the engine: missing {missing}, unexpected {unknown}")
    arrays = {}
    for name, tensor in weights.items():
        init = inits[name]
        expected_dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(init.data_type))
        array = arrays[name] = to_numpy(tensor)
        if tuple(array.shape) != tuple(init.dims) or array.dtype != expected_dtype:
            raise RefitError(
                f"weight {name!r}: expected shape {tuple(init.dims)} dtype {expected_dtype.name}, got "
                f"shape {tuple(array.shape)} dtype {array.dtype.name}"
            )
    return arrays


def _fill(model: onnx.ModelProto, weights: Mapping[str, torch.Tensor]) -> None:
    """Put weights into the model's initializers, checking names, shapes and dtypes first."""
    _write(model, _checked_weights(model, weights))


def _write(model: onnx.ModelProto, arrays: Mapping[str, np.ndarray]) -> None:
    """Write ``arrays`` (checked already) into the weight initializers of those names."""
    for init in _weights(model):
        if init.name in arrays:
            filled = numpy_helper.from_array(arrays[init.name], init.name)
            init.Clear()
            init.CopyFrom(filled)
