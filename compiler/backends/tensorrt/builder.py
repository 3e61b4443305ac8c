"""TensorRT and TensorRT-RTX engines: one code path for both libraries (same Python API).

``TensorRTBackend("tensorrt")`` drives NVIDIA TensorRT 10/11 (``pip install kiln[tensorrt]``),
``TensorRTBackend("tensorrt-rtx")`` drives TensorRT for RTX (``pip install kiln[tensorrt-rtx]``).
Constructing a backend imports the library and needs a CUDA GPU (BackendUnavailableError
otherwise); the op table (:func:`tensorrt_supports`) needs neither. ``check_runnable()`` says
whether engines built here can also run here (TensorRT-RTX builds on an H100 but refuses to run
on sm_90).

Build: ONNX parser -> strongly typed network (precision is already in the graph) -> one
optimization profile from the EngineIO specs -> refittable engine whose refittable weights are
exactly the canonical initializers ``w0, w1, ...`` (REFIT_INDIVIDUAL), stripped of them
(STRIP_PLAN) when ``settings.strip_weights``, and then xz-compressed (what a stripped plan keeps is
kernel code, which compresses ~70x). Engine bytes carry a small kiln header (library,
version, target compute capabilities, canonical weight shapes/dtypes) so a wrong engine fails with
:class:`EngineCompatibilityError` and wrong weights with :class:`RefitError` before TensorRT sees
them, and both can be checked without a GPU.

Supported ops (``supports``): the ATen overloads that the torch.onnx exporter translates (the set
ONNX Runtime uses) minus those whose translation uses an ONNX op that TensorRT's ONNX parser
rejects. The rejected ONNX ops are :data:`PARSER_REJECTED_ONNX_OPS`, recorded from
``OnnxParser.supports_operator`` over every default-domain ONNX op (TensorRT-RTX 1.7.1;
``tests/test_tensorrt_backend.py`` re-checks it against any installed library), and which ONNX ops
an ATen overload's translation uses is read from the exporter's own torchlib functions
(over-approximated across dtype branches, so doubt means fallback). Exceptions, each checked on
the zoo: sequence ops the exporter's optimizer folds into Split/Concat; bitwise ops, which are
And/Or/Not on bool masks; ops the exporter decomposes first, judged by their op family. The H100
proof (``benchmarks/tensorrt_rtx_build_proof.py``) parses and builds every zoo partition with it.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import lzma
import os
import re
import struct
import threading
import types
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from compiler.atomic import write_bytes_atomic
from compiler.backends.base import BuildSettings, EngineIO
from compiler.errors import (
    BackendError,
    BackendUnavailableError,
    BuildSettingsError,
    EngineBuildError,
    EngineCompatibilityError,
    InputSpecError,
    RefitError,
)
from compiler.specs import dtype_name

# name -> (importable module names, tried in order; pip extra that installs the library)
LIBRARIES: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorrt": (("tensorrt", "tensorrt_bindings"), "kiln[tensorrt]"),
    "tensorrt-rtx": (("tensorrt_rtx", "tensorrt_rtx_bindings"), "kiln[tensorrt-rtx]"),
}

# Compute capabilities a TensorRT-RTX engine runs on when no target is set at build time
# (TensorRT-RTX docs, "CPU-only AOT": 8.0, 8.6, 8.9, 12.0 and later). sm_90 (H100/H200) is not one.
RTX_DEFAULT_TARGETS = ("sm_80", "sm_86", "sm_89", "sm_120")

# ONNX ops (default domain) for which TensorRT-RTX 1.7.1's ``OnnxParser.supports_operator`` is False.
PARSER_REJECTED_ONNX_OPS = frozenset(
    {
        "AffineGrid", "Bernoulli", "BitCast", "BitShift", "BitwiseAnd", "BitwiseNot", "BitwiseOr",
        "BitwiseXor", "CenterCropPad", "Col2Im", "Compress", "ConcatFromSequence", "ConvInteger",
        "CumProd", "DFT", "DeformConv", "Det", "DynamicQuantizeLinear", "ImageDecoder", "MatMulInteger",
        "MaxRoiPool", "MaxUnpool", "MelWeightMatrix", "Multinomial", "NegativeLogLikelihoodLoss",
        "Optional", "OptionalGetElement", "OptionalHasElement", "QLinearConv", "QLinearMatMul",
        "RegexFullMatch", "SequenceAt", "SequenceConstruct", "SequenceEmpty", "SequenceErase",
        "SequenceInsert", "SequenceLength", "SequenceMap", "SoftmaxCrossEntropyLoss", "SplitToSequence",
        "StringConcat", "StringNormalizer", "StringSplit", "SwiGLU", "TfIdfVectorizer", "Unique",
    }
)  # fmt: skip

# torchlib writes split/unbind/stack/getitem with sequence ops, but the exporter's optimizer rewrites
# them to Split/Slice/Concat whenever the list length is static (checked by exporting them), which is
# the case after torch.export. A dynamic-length list still fails the parser, naming the node.
EXPORTER_FOLDED_SEQUENCE_OPS = frozenset(
    {"SplitToSequence", "ConcatFromSequence", "SequenceAt", "SequenceConstruct"}
)

# Bitwise ops translate to And/Or/Xor/Not on bool tensors (attention masks in every transformer) and
# to BitwiseAnd/... on integers. The op table sees targets, not dtypes, so it takes them: the rare
# integer case fails the build with the node named rather than splitting every BERT and GPT-2.
_BOOL_BITWISE = frozenset(
    f"aten::bitwise_{op}.{overload}"
    for op in ("and", "or", "xor")
    for overload in ("Tensor", "Scalar", "Scalar_Tensor")
) | {"aten::bitwise_not"}

_MAGIC = b"KILNTRT1"
_HEADER_FORMAT = 1
_CANONICAL_WEIGHT = re.compile(r"^w(\d+)$")
REFIT_MODES = ("weights", "all", "identical", "none")
BACKEND_OPTIONS = frozenset({"refit"})  # the keys of CompileOptions.backend_options TensorRT reads


# ----------------------------------------------------------------------------------------------
# Pure helpers: no TensorRT, no GPU (tested on CPU)
# ----------------------------------------------------------------------------------------------


def profile_shapes(io: EngineIO) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """The one optimization profile (min, opt, max per input) an engine is built with."""
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
    for spec in io.inputs:
        if spec.name in shapes:
            raise InputSpecError(f"engine input {spec.name!r} is listed twice; input names must be unique")
        lo, opt, hi = tuple(spec.min_shape), tuple(spec.opt_shape), tuple(spec.max_shape)
        if not len(lo) == len(opt) == len(hi):
            raise InputSpecError(f"input {spec.name!r}: min/opt/max ranks differ: {lo}, {opt}, {hi}")
        for axis, (a, b, c) in enumerate(zip(lo, opt, hi, strict=True)):
            if not 0 <= a <= b <= c:
                raise InputSpecError(
                    f"input {spec.name!r} axis {axis}: an optimization profile needs 0 <= min <= opt <= max, "
                    f"got min={a} opt={b} max={c}"
                )
        shapes[spec.name] = (lo, opt, hi)
    return shapes


def refit_mode(settings: BuildSettings) -> str:
    """How weights are made refittable: ``weights`` (default: exactly the canonical ``w*`` initializers),
    ``all`` (every weight, BuilderFlag.REFIT), ``identical`` (REFIT_IDENTICAL: only the build's own
    weights may be put back, so the engine must not be shared by instances with other weights) or
    ``none``."""
    unknown = sorted(set(settings.options) - BACKEND_OPTIONS)
    if unknown:
        raise BuildSettingsError(
            f"unknown backend_options {unknown} for TensorRT; it takes {sorted(BACKEND_OPTIONS)}"
        )
    mode = settings.options.get("refit", "weights")
    if mode not in REFIT_MODES:
        raise BuildSettingsError(f"settings.options['refit'] is {mode!r}; expected one of {REFIT_MODES}")
    if settings.strip_weights and mode == "none":
        raise BuildSettingsError(
            "strip_weights needs a refittable engine (weights go back in by refit), but options['refit'] "
            "is 'none'; drop one of the two"
        )
    return mode


def builder_flag_names(settings: BuildSettings) -> tuple[str, ...]:
    """BuilderFlag members a build sets for these settings, in a stable order.

    Stripped engines use STRIP_PLAN with REFIT_INDIVIDUAL, not REFIT_IDENTICAL: one engine serves
    every dedup instance and cache user of its fingerprint, each with other weights, and
    REFIT_IDENTICAL lets the builder assume the build's own values (it was 1.1% of an MLP's full
    size against 1.6%, on the H100; not worth wrong results)."""
    mode = refit_mode(settings)
    flags = {"weights": ["REFIT_INDIVIDUAL"], "all": ["REFIT"], "identical": ["REFIT_IDENTICAL"], "none": []}[
        mode
    ]
    if settings.strip_weights:
        flags.append("STRIP_PLAN")
    return tuple(flags)


def canonical_weights(model: Any) -> dict[str, dict[str, Any]]:
    """Canonical weights of a lowered ONNX model (initializers ``w0..wN``): name -> shape and dtype,
    in index order. Other initializers are constants of the structure and stay in the engine."""
    import onnx
    from onnx import helper

    found: dict[int, dict[str, Any]] = {}
    for init in model.graph.initializer:
        match = _CANONICAL_WEIGHT.match(init.name)
        if match is None:
            continue
        np_dtype = helper.tensor_dtype_to_np_dtype(init.data_type)
        torch_name = {
            "float32": "float32",
            "float16": "float16",
            "int64": "int64",
            "int32": "int32",
            "int8": "int8",
            "uint8": "uint8",
            "bool": "bool",
            "float64": "float64",
        }.get(str(np_dtype))
        if init.data_type == onnx.TensorProto.BFLOAT16:
            torch_name = "bfloat16"
        if torch_name is None:
            raise EngineBuildError(f"weight {init.name!r} has ONNX dtype {np_dtype}, which kiln cannot refit")
        found[int(match.group(1))] = {
            "name": init.name,
            "shape": [int(d) for d in init.dims],
            "dtype": torch_name,
        }
    return {found[i]["name"]: {"shape": found[i]["shape"], "dtype": found[i]["dtype"]} for i in sorted(found)}


def unfold_batch_norm(model: Any) -> int:
    """Rewrite inference BatchNormalization nodes whose parameters are canonical weights into
    Sub/Div/Mul/Add (in place); returns how many. TensorRT's ONNX parser folds a BatchNormalization's
    scale, bias, mean and variance into new unnamed weights, so they could be neither marked
    refittable nor refitted by name; as elementwise operands they stay named weights (and TensorRT
    still fuses the arithmetic into the convolution)."""
    import onnx
    from onnx import helper, numpy_helper

    canonical = set(canonical_weights(model))
    if not any(n.op_type == "BatchNormalization" and set(n.input[1:]) & canonical for n in model.graph.node):
        return 0
    inferred = onnx.shape_inference.infer_shapes(model)
    ranks = {
        v.name: len(v.type.tensor_type.shape.dim)
        for v in [*inferred.graph.value_info, *inferred.graph.input]
        if v.type.tensor_type.HasField("shape")
    }
    dtypes = {i.name: i.data_type for i in model.graph.initializer}
    nodes, count = [], 0
    for node in model.graph.node:
        if (
            node.op_type != "BatchNormalization"
            or not set(node.input[1:]) & canonical
            or len(node.output) != 1
        ):
            nodes.append(node)
            continue
        count += 1
        x, scale, bias, mean, var = node.input
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        rank = ranks.get(x, 4)
        tag = f"kiln_bn{count}"
        shape = numpy_helper.from_array(
            np.array([-1] + [1] * max(rank - 2, 0), dtype=np.int64), f"{tag}_shape"
        )
        eps_t = helper.make_tensor(f"{tag}_eps", dtypes.get(var, onnx.TensorProto.FLOAT), [], [eps])
        model.graph.initializer.extend([shape, eps_t])
        for name in (scale, bias, mean, var):
            nodes.append(
                helper.make_node("Reshape", [name, shape.name], [f"{tag}_{name}"], name=f"{tag}_r_{name}")
            )
        nodes += [
            helper.make_node("Add", [f"{tag}_{var}", eps_t.name], [f"{tag}_ve"], name=f"{tag}_add_eps"),
            helper.make_node("Sqrt", [f"{tag}_ve"], [f"{tag}_sd"], name=f"{tag}_sqrt"),
            helper.make_node("Sub", [x, f"{tag}_{mean}"], [f"{tag}_xc"], name=f"{tag}_sub"),
            helper.make_node("Div", [f"{tag}_xc", f"{tag}_sd"], [f"{tag}_xn"], name=f"{tag}_div"),
            helper.make_node("Mul", [f"{tag}_xn", f"{tag}_{scale}"], [f"{tag}_xs"], name=f"{tag}_mul"),
            helper.make_node(
                "Add", [f"{tag}_xs", f"{tag}_{bias}"], [node.output[0]], name=node.name or f"{tag}_out"
            ),
        ]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return count


def check_refit_weights(
    declared: Mapping[str, Mapping[str, Any]], weights: Mapping[str, torch.Tensor], *, require_all: bool
) -> None:
    """RefitError unless ``weights`` names only declared weights with their shapes and dtypes (and,
    when ``require_all``, names every one of them)."""
    unknown = sorted(set(weights) - set(declared))
    if unknown:
        raise RefitError(f"unknown weights {unknown}; this engine's refittable weights are {list(declared)}")
    if require_all:
        missing = [name for name in declared if name not in weights]
        if missing:
            raise RefitError(f"weights {missing} are missing; this engine needs all of {list(declared)}")
    for name, tensor in weights.items():
        want = declared[name]
        if not isinstance(tensor, torch.Tensor):
            raise RefitError(f"weight {name!r}: expected a torch.Tensor, got {type(tensor).__name__}")
        if list(tensor.shape) != list(want["shape"]):
            raise RefitError(
                f"weight {name!r}: expected shape {tuple(want['shape'])}, got {tuple(tensor.shape)}"
            )
        got = dtype_name(tensor.dtype)
        if got != want["dtype"]:
            raise RefitError(f"weight {name!r}: expected dtype {want['dtype']}, got {got}")


def encode_engine(header: Mapping[str, Any], plan: bytes, *, compress: bool = False) -> bytes:
    """kiln engine bytes: magic, header length, JSON header, then the TensorRT plan, as it is or
    xz-compressed (``compress``; the header's ``plan_encoding`` says which).

    Stripped plans are compressed: what stays in them is kernel code (PTX and one cubin per target
    for every fused kernel) and the graph, which compress ~70x (a 3.6 MB stripped BERT plan to 47
    KB on TensorRT-RTX 1.7), while a full plan is mostly weights, which do not compress."""
    body = lzma.compress(plan, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64) if compress else bytes(plan)
    meta = {**header, "plan_encoding": "xz" if compress else "raw"}
    text = json.dumps(meta, sort_keys=True, separators=(",", ":")).encode()
    return _MAGIC + struct.pack("<I", len(text)) + text + body


def decode_engine(engine: bytes) -> tuple[dict[str, Any], memoryview]:
    """(header, plan) of kiln engine bytes, the plan decompressed; EngineCompatibilityError for
    anything else (foreign bytes, a corrupt header or a corrupt compressed plan)."""
    view = memoryview(engine)
    if len(view) < len(_MAGIC) + 4 or bytes(view[: len(_MAGIC)]) != _MAGIC:
        raise EngineCompatibilityError(
            "these bytes are not a kiln TensorRT engine (no KILNTRT1 header); rebuild the engine with kiln"
        )
    (size,) = struct.unpack("<I", view[len(_MAGIC) : len(_MAGIC) + 4])
    start = len(_MAGIC) + 4
    try:
        header = json.loads(bytes(view[start : start + size]))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise EngineCompatibilityError(f"kiln TensorRT engine header is corrupt: {exc}") from exc
    if header.get("format") != _HEADER_FORMAT:
        raise EngineCompatibilityError(
            f"kiln TensorRT engine header format {header.get('format')!r}; this kiln reads {_HEADER_FORMAT}"
        )
    body = view[start + size :]
    encoding = header.get("plan_encoding", "raw")  # engines from before compression carry no key
    if encoding == "raw":
        return header, body
    if encoding != "xz":
        raise EngineCompatibilityError(
            f"kiln TensorRT engine plan encoding {encoding!r}; this kiln reads 'raw' and 'xz'"
        )
    try:
        return header, memoryview(lzma.decompress(body, format=lzma.FORMAT_XZ))
    except lzma.LZMAError as exc:
        raise EngineCompatibilityError(
            f"kiln TensorRT engine plan is corrupt (xz: {exc}); rebuild the engine"
        ) from exc


def check_engine_compatible(
    header: Mapping[str, Any], backend: str, version: str, device: str | None
) -> None:
    """EngineCompatibilityError unless an engine with ``header`` can run with this library and device
    (``device`` like ``sm_86``; ``None`` skips the device check)."""
    if header.get("backend") != backend or header.get("library_version") != version:
        raise EngineCompatibilityError(
            f"engine was built by {header.get('backend')} {header.get('library_version')}, "
            f"but this backend is "
            f"{backend} {version}; rebuild it here (engines are not portable across libraries or versions)"
        )
    if device is None:
        return
    targets = list(header.get("targets", []))
    later = header.get("targets_and_later", False) and _cc(device) >= max(_cc(t) for t in targets)
    if device not in targets and not later:
        text = ", ".join(targets) + (" and later" if header.get("targets_and_later") else "")
        raise EngineCompatibilityError(
            f"engine was built for {text}; this GPU is {device}; rebuild it for {device}"
        )


def _cc(sm: str) -> int:
    return int(sm.removeprefix("sm_"))


def _error_node(text: str, node_names: Sequence[str]) -> str | None:
    """The ONNX node a TensorRT error message names (layers carry their node's name), longest first
    so that ``node_linear_1`` wins over ``node_linear``."""
    for name in sorted((n for n in node_names if n), key=len, reverse=True):
        if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text):
            return name
    return None


# ----------------------------------------------------------------------------------------------
# Supported ops: torch.onnx translations minus ONNX ops TensorRT's parser rejects
# ----------------------------------------------------------------------------------------------

_OP_CALL = re.compile(r"\b(?:op|opset\d+)\.([A-Z][A-Za-z0-9]*)\(")
_NAME_CALL = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\(")


def _onnx_registry() -> Any:
    from compiler import onnx_support

    return onnx_support._registry()  # the one registry ONNX Runtime's op table comes from


def _function_onnx_ops(fn: Any, seen: dict[int, frozenset[str]]) -> frozenset[str]:
    """ONNX ops a torchlib function may emit: its own ``op.X(...)`` calls plus those of the torchlib
    helpers it calls (an over-approximation across dtype branches, which only errs towards fallback)."""
    key = id(fn)
    if key in seen:
        return seen[key]
    seen[key] = frozenset()  # cycles
    ops: set[str] = set()
    kind = type(fn).__name__
    if kind == "OnnxFunction":
        try:
            ops = {node.op_type for node in fn.to_function_proto().node}
            seen[key] = frozenset(ops)
            return seen[key]
        except Exception:  # fall back to reading the source
            fn = getattr(fn, "function", fn)
    if kind == "TracedOnnxFunction":
        fn = fn.func
    if isinstance(fn, types.FunctionType):
        try:
            source = inspect.getsource(fn)
        except (OSError, TypeError):
            source = ""
        ops.update(_OP_CALL.findall(source))
        for name in set(_NAME_CALL.findall(source)):
            helper = fn.__globals__.get(name)
            if helper is None or helper is fn:
                continue
            if type(helper).__name__ in ("OnnxFunction", "TracedOnnxFunction") or (
                isinstance(helper, types.FunctionType)
                and ("onnxscript" in helper.__module__ or "torch.onnx" in helper.__module__)
            ):
                ops |= _function_onnx_ops(helper, seen)
    seen[key] = frozenset(ops)
    return seen[key]


_OPS_SEEN: dict[int, frozenset[str]] = {}


@functools.cache
def _onnx_ops_by_name(name: Any) -> frozenset[str] | None:
    decomps = _onnx_registry().functions.get(name, [])
    # complex-number variants only matter for complex tensors, which kiln's engines never take
    decomps = [d for d in decomps if not d.is_complex] or decomps
    if not decomps:
        return None
    ops: set[str] = set()
    for decomp in decomps:
        ops |= _function_onnx_ops(decomp.onnx_function, _OPS_SEEN)
    return frozenset(ops)


def onnx_ops_for(target: Any) -> frozenset[str] | None:
    """ONNX ops the torch.onnx exporter may translate an fx node target into: from its torchlib
    function when it has one, empty when the exporter decomposes the op first (into ATen ops that
    then have translations); None if it has no translation at all (the same test as ONNX Runtime's
    table, ``compiler.onnx_support``)."""
    from compiler.onnx_support import SYMBOLIC_OPS, onnx_exportable

    if target in SYMBOLIC_OPS:
        return frozenset({"Shape", "Gather", "Add", "Sub", "Mul", "Div", "Neg", "Mod"})
    if not onnx_exportable(target):
        return None
    return _onnx_ops_by_name(target.name()) or frozenset()


@functools.cache
def _rejected_families() -> dict[str, tuple[str, ...]]:
    """Base op names (``nll_loss``, ``unique``...) whose direct translations TensorRT rejects, with the
    ONNX ops to blame. A decomposed overload of the same family (``aten.unique.default``) lands
    there too, so it is refused with them rather than failing the build later."""
    families: dict[str, set[str]] = {}
    for name in _onnx_registry().functions:
        if not isinstance(name, str) or not name.startswith("aten::"):
            continue
        ops = _onnx_ops_by_name(name) or frozenset()
        bad = (ops - EXPORTER_FOLDED_SEQUENCE_OPS) & PARSER_REJECTED_ONNX_OPS
        if bad and name not in _BOOL_BITWISE:
            families.setdefault(name.split(".")[0][len("aten::") :], set()).update(bad)
    return {family: tuple(sorted(bad)) for family, bad in families.items()}


def unsupported_reason(target: Any) -> str | None:
    """Why TensorRT cannot take an op (None when it can): no ONNX translation, or the ONNX ops its
    translation uses that TensorRT's ONNX parser rejects."""
    ops = onnx_ops_for(target)
    if ops is None:
        return "no ONNX translation in the torch.onnx exporter"
    if not isinstance(target, torch._ops.OpOverload) or target.name() in _BOOL_BITWISE:
        return None  # symbolic shape math; And/Or/Xor/Not on bool masks (integers fail the parser, named)
    rejected = sorted((ops - EXPORTER_FOLDED_SEQUENCE_OPS) & PARSER_REJECTED_ONNX_OPS)
    if rejected:
        return f"its ONNX translation uses {rejected}, which TensorRT's ONNX parser does not support"
    family = target.name().split(".")[0].removeprefix("aten::")
    if not ops and family in _rejected_families():
        return (
            f"it decomposes like aten::{family}, whose ONNX translation uses "
            f"{list(_rejected_families()[family])}, which TensorRT's ONNX parser does not support"
        )
    return None


def tensorrt_supports(target: Any) -> bool:
    """Whether an ATen op overload can go into a TensorRT / TensorRT-RTX engine."""
    return unsupported_reason(target) is None


# ----------------------------------------------------------------------------------------------
# The backend
# ----------------------------------------------------------------------------------------------


@functools.cache
def _collector(trt: Any) -> Any:
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


class _LogWindow:
    """The messages logged since this window opened (for one build, load or refit)."""

    def __init__(self, collector: Any) -> None:
        self.logger = collector
        self._start = collector.total

    def errors(self) -> list[str]:
        with self.logger.lock:
            new = self.logger.total - self._start
            return self.logger.messages[-new:][-20:] if new else []


def _current_sm() -> str | None:
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


class TensorRTBackend:
    """EngineBackend for ``tensorrt`` (TensorRT 10/11) and ``tensorrt-rtx`` (TensorRT for RTX).

    Construction imports the library and needs a CUDA GPU (BackendUnavailableError otherwise, so
    that ``auto`` falls back to ONNX Runtime). ``require_gpu=False`` allows TensorRT-RTX's CPU-only
    ahead-of-time builds of non-refittable engines (``options['refit']='none'``) and parsing.
    ``timing_cache_dir``: where the builder's timing cache persists across builds and processes
    (TensorRT only; TensorRT-RTX's timing cache is a no-op that would also force a GPU query).
    ``compute_capabilities``: one TensorRT-RTX target such as ``("sm_89",)``; by default the
    library's portable set (:data:`RTX_DEFAULT_TARGETS` and later). TensorRT-RTX 1.7.1 fails to
    build for several explicit targets at once (Myelin ``sm_vers_.size() == 1``), so kiln takes one.
    """

    def __init__(
        self,
        name: str = "tensorrt",
        *,
        timing_cache_dir: str | os.PathLike | None = None,
        compute_capabilities: Sequence[str] | None = None,
        require_gpu: bool = True,
    ) -> None:
        if name not in LIBRARIES:
            raise BackendError(f"unknown TensorRT backend {name!r}; expected one of {sorted(LIBRARIES)}")
        self.name = name
        self.rtx = name == "tensorrt-rtx"
        self.timing_cache_dir = Path(timing_cache_dir) if timing_cache_dir is not None else None
        if compute_capabilities is not None and not self.rtx:
            raise BackendError("compute_capabilities is a TensorRT-RTX setting; TensorRT builds for this GPU")
        self.compute_capabilities = tuple(compute_capabilities) if compute_capabilities else None
        for cc in self.compute_capabilities or ():
            if not re.fullmatch(r"sm_\d+", cc):
                raise BackendError(f"compute capability {cc!r}: expected the form 'sm_86'")
        if self.compute_capabilities and len(self.compute_capabilities) != 1:
            raise BackendError(
                f"compute_capabilities {self.compute_capabilities}: TensorRT-RTX builds for one explicit "
                "target "
                "at a time (or, with none given, for its portable default set)"
            )
        self._module: Any = None
        self.trt  # noqa: B018 - import now: a missing library must fail here, not at the first build
        if require_gpu:
            self._require_gpu("this backend")

    # -- library and device ------------------------------------------------------------------

    @property
    def trt(self) -> Any:
        """The imported library module (BackendUnavailableError naming the extra if absent)."""
        if self._module is None:
            modules, extra = LIBRARIES[self.name]
            errors = []
            for module in modules:
                try:
                    self._module = importlib.import_module(module)
                    break
                except ImportError as exc:
                    errors.append(f"{module}: {exc}")
            else:
                raise BackendUnavailableError(
                    f"the {self.name} backend needs the Python module {modules[0]!r}, which is not "
                    "importable "
                    f"here ({'; '.join(errors)}); install it with: pip install {extra}"
                )
        return self._module

    def _require_gpu(self, what: str) -> str:
        sm = _current_sm()
        if sm is None:
            raise BackendUnavailableError(
                f"{what} ({self.name}) needs a CUDA GPU, and torch sees none here "
                "(torch.cuda.is_available() "
                "is False); use the onnxruntime backend or run on a GPU machine"
            )
        return sm

    def check_runnable(self) -> None:
        """BackendUnavailableError unless engines built now can also run on this machine's GPU
        (TensorRT-RTX 1.7 builds on an H100 but its runtime refuses sm_90)."""
        sm = self._require_gpu(f"running {self.name} engines")
        targets, later = self._targets()
        if sm not in targets and not (later and _cc(sm) >= max(_cc(t) for t in targets)):
            listed = ", ".join(targets) + (" and later" if later else "")
            raise BackendUnavailableError(f"{self.name} engines run on {listed}; this GPU is {sm}")

    def library_version(self) -> str:
        return str(self.trt.__version__)

    def _targets(self) -> tuple[list[str], bool]:
        """Compute capabilities engines built now run on, and whether later ones are included."""
        if self.rtx:
            if self.compute_capabilities:
                return list(self.compute_capabilities), False
            return list(RTX_DEFAULT_TARGETS), True
        return [self._require_gpu("building an engine")], False

    def target_device(self) -> str:
        targets, later = self._targets()
        return "cuda:" + "+".join(targets) + ("+" if later else "")

    def supports(self, target: Any) -> bool:
        return tensorrt_supports(target)

    def _logger(self) -> _LogWindow:
        return _LogWindow(_collector(self.trt))

    # -- build ---------------------------------------------------------------------------------

    def build(
        self,
        onnx_model: bytes,
        io: EngineIO,
        settings: BuildSettings,
        *,
        partition: str | None = None,
        cache_dir: str | os.PathLike | None = None,
    ) -> bytes:
        """Engine bytes for a lowered partition (kiln header + TensorRT plan).

        ``partition`` names the partition in errors; by default the ONNX graph's name. ``cache_dir``
        (the engine cache's directory) keeps the timing cache in ``<cache_dir>/timing`` unless the
        backend was given a ``timing_cache_dir``.
        """
        import onnx

        model = onnx.load_model_from_string(bytes(onnx_model))
        partition = partition or model.graph.name or None
        node_names = [n.name for n in model.graph.node]
        flag_names = builder_flag_names(settings)
        shapes = profile_shapes(io)
        weights = canonical_weights(model)
        trt = self.trt
        # TensorRT-RTX compiles ahead of time without a GPU, except refittable engines (its Myelin
        # JIT then queries the device, seen on TensorRT-RTX 1.7.1); TensorRT always needs one.
        if not self.rtx or flag_names:
            self._require_gpu(f"building a{' refittable' if flag_names else 'n'} engine")
        if flag_names and unfold_batch_norm(model):  # refit needs BatchNorm weights by name
            onnx_model = model.SerializeToString()
        logger, builder, network, _parser = self._parsed(onnx_model, io, partition)

        config = builder.create_builder_config()
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
        if settings.workspace_bytes is not None:
            if settings.workspace_bytes <= 0:
                raise BuildSettingsError(f"workspace_bytes must be positive, got {settings.workspace_bytes}")
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(settings.workspace_bytes))
        if settings.optimization_level is not None:
            if not 0 <= settings.optimization_level <= 5:
                raise BuildSettingsError(
                    "optimization_level must be 0..5 (TensorRT builder levels), "
                    f"got {settings.optimization_level}"
                )
            config.builder_optimization_level = int(settings.optimization_level)
        for flag in flag_names:
            config.set_flag(getattr(trt.BuilderFlag, flag))
        if "REFIT_INDIVIDUAL" in flag_names:
            for name in weights:
                if not network.mark_weights_refittable(name):
                    raise EngineBuildError(
                        f"partition {partition}: weight {name!r} cannot be made refittable "
                        "(TensorRT does not "
                        "see it as weights; is it used as a shape?)",
                        partition=partition,
                    )
        targets, later = self._targets()
        if self.rtx and self.compute_capabilities:
            config.num_compute_capabilities = len(targets)
            for i, cc in enumerate(targets):
                member = getattr(trt.ComputeCapability, "SM" + cc.removeprefix("sm_"), None)
                if member is None:
                    raise BuildSettingsError(f"{self.name} {self.library_version()} cannot target {cc}")
                config.set_compute_capability(member, i)
        timing_dir = self.timing_cache_dir or (Path(cache_dir) / "timing" if cache_dir else None)
        timing_path = self._load_timing_cache(config, targets[0], timing_dir)

        plan = builder.build_serialized_network(network, config)
        if plan is None:
            text = "\n".join(logger.errors()) or "no message from TensorRT"
            node = _error_node(text, node_names)
            where = f" at node {node!r}" if node else ""
            raise EngineBuildError(
                f"{self.name} could not build partition {partition}{where}: {text}",
                partition=partition,
                node=node,
            )
        if timing_path is not None:
            write_bytes_atomic(timing_path, bytes(memoryview(config.get_timing_cache().serialize())))
        header = {
            "format": _HEADER_FORMAT,
            "backend": self.name,
            "library_version": self.library_version(),
            "targets": targets,
            "targets_and_later": later,
            "stripped": bool(settings.strip_weights),
            "refit": refit_mode(settings),
            "weights": weights,
            "inputs": [s.name for s in io.inputs],
            "outputs": list(io.output_names),
        }
        return encode_engine(header, bytes(memoryview(plan)), compress=bool(settings.strip_weights))

    def parse(self, onnx_model: bytes, io: EngineIO, *, partition: str | None = None) -> int:
        """Parse a lowered partition into a strongly typed network without building it (no GPU
        needed): the number of network layers, or EngineBuildError naming the rejected nodes."""
        return self._parsed(onnx_model, io, partition)[2].num_layers

    def _parsed(self, onnx_model: bytes, io: EngineIO, partition: str | None) -> tuple[Any, Any, Any, Any]:
        trt = self.trt
        shapes = profile_shapes(io)
        logger = self._logger()
        builder = trt.Builder(logger.logger)
        flags = 0
        if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):  # TensorRT >= 9
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger.logger)
        if not parser.parse(bytes(onnx_model)):
            raise self._parse_error(parser, partition)
        self._check_network_io(network, io, shapes, partition)
        return logger, builder, network, parser  # the parser owns weights the network points at

    def _parse_error(self, parser: Any, partition: str | None) -> EngineBuildError:
        problems, first = [], None
        for i in range(parser.num_errors):
            err = parser.get_error(i)
            node = err.node_name() or None
            first = first or node
            problems.append(f"node {node!r} ({err.node_operator() or '?'}): {err.desc()} [{err.code()}]")
        text = "; ".join(problems) or "no parser error recorded"
        return EngineBuildError(
            f"{self.name}'s ONNX parser rejected partition {partition}: {text}",
            partition=partition,
            node=first,
        )

    def _check_network_io(self, network: Any, io: EngineIO, shapes: Mapping, partition: str | None) -> None:
        inputs = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
        outputs = [network.get_output(i).name for i in range(network.num_outputs)]
        if set(inputs) != set(shapes) or set(outputs) != set(io.output_names):
            raise EngineBuildError(
                f"partition {partition}: the ONNX graph has inputs {sorted(inputs)} and outputs "
                f"{outputs}, but "
                f"its EngineIO declares inputs {list(shapes)} and outputs {list(io.output_names)}",
                partition=partition,
            )
        for name, (lo, _opt, hi) in shapes.items():
            dims = tuple(inputs[name].shape)
            bad = len(dims) != len(lo) or any(
                d >= 0 and not a <= d <= b for d, a, b in zip(dims, lo, hi, strict=False)
            )
            if bad:
                raise InputSpecError(
                    f"partition {partition}: input {name!r} has shape {dims} in the ONNX graph "
                    "(-1 = dynamic), "
                    f"which the spec range min {lo} max {hi} does not fit"
                )

    def _load_timing_cache(self, config: Any, target: str, directory: Path | None) -> Path | None:
        if self.rtx or directory is None:
            return None
        path = directory / f"{self.name}-{self.library_version()}-{target}.timing"
        blob = path.read_bytes() if path.is_file() else b""
        cache = config.create_timing_cache(blob)
        if cache is None and blob:  # an unreadable cache file only costs tuning time: start afresh
            cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
        return path

    # -- runtime ---------------------------------------------------------------------------------

    def _deserialize(self, engine: bytes) -> tuple[dict[str, Any], Any, Any, Any]:
        header, plan = decode_engine(engine)
        sm = self._require_gpu("running an engine")
        check_engine_compatible(header, self.name, self.library_version(), sm)
        trt = self.trt
        logger = self._logger()
        runtime = trt.Runtime(logger.logger)
        if hasattr(runtime, "get_engine_validity"):
            validity, diagnostics = runtime.get_engine_validity(plan)
            if validity != trt.EngineValidity.VALID:
                raise EngineCompatibilityError(
                    f"{self.name} {self.library_version()} reports this engine {validity.name} on {sm} "
                    f"(diagnostics {diagnostics}): {'; '.join(logger.errors()) or 'no message'}; "
                    "rebuild it here"
                )
        cuda_engine = runtime.deserialize_cuda_engine(plan)
        if cuda_engine is None:
            raise EngineCompatibilityError(
                f"{self.name} could not deserialize the engine on {sm}: "
                f"{'; '.join(logger.errors()) or 'no message'}"
            )
        return header, runtime, cuda_engine, logger

    def _refit_in_place(self, header: Mapping, cuda_engine: Any, logger: Any, weights: Mapping) -> None:
        if header.get("refit", "none") == "none" or not cuda_engine.refittable:
            raise RefitError(
                "this engine was built without refit (options['refit']='none'); rebuild to change weights"
            )
        check_refit_weights(
            header["weights"], weights, require_all=header["refit"] != "all" or header["stripped"]
        )
        trt = self.trt
        refitter = trt.Refitter(cuda_engine, logger.logger)
        host = {}  # keeps the tensors alive until refit_cuda_engine returns
        for name, tensor in weights.items():
            host[name] = tensor.detach().to("cpu").contiguous()
            value = trt.Weights(
                _TRT_DTYPE[dtype_name(tensor.dtype)](trt), host[name].data_ptr(), host[name].numel()
            )
            if not refitter.set_named_weights(name, value):
                raise RefitError(
                    f"{self.name} rejected weights {name!r}: {'; '.join(logger.errors()) or 'no message'}"
                )
        missing = [m for m in refitter.get_missing_weights() if m]
        if missing:
            raise RefitError(f"refit would leave weights {sorted(missing)} unset; give them too")
        if not refitter.refit_cuda_engine():
            raise RefitError(f"{self.name} refit failed: {'; '.join(logger.errors()) or 'no message'}")

    def load(self, engine: bytes, io: EngineIO, weights: Mapping[str, torch.Tensor] | None) -> TensorRTEngine:
        header, runtime, cuda_engine, logger = self._deserialize(engine)
        if weights:
            self._refit_in_place(header, cuda_engine, logger, weights)
        elif header["stripped"] and header["weights"]:
            raise RefitError(
                f"this engine is weight-stripped; load it with its weights {list(header['weights'])}"
            )
        return TensorRTEngine(self.trt, runtime, cuda_engine, io)

    def refit(self, engine: bytes, weights: Mapping[str, torch.Tensor]) -> bytes:
        header, _runtime, cuda_engine, logger = self._deserialize(engine)
        self._refit_in_place(header, cuda_engine, logger, weights)
        config = cuda_engine.create_serialization_config()
        config.clear_flag(self.trt.SerializationFlag.EXCLUDE_WEIGHTS)  # a refit engine carries its weights
        plan = cuda_engine.serialize_with_config(config)
        return encode_engine({**header, "stripped": False}, bytes(memoryview(plan)))


_TRT_DTYPE = {
    "float32": lambda trt: trt.DataType.FLOAT,
    "float16": lambda trt: trt.DataType.HALF,
    "bfloat16": lambda trt: trt.DataType.BF16,
    "int32": lambda trt: trt.DataType.INT32,
    "int64": lambda trt: trt.DataType.INT64,
    "int8": lambda trt: trt.DataType.INT8,
    "uint8": lambda trt: trt.DataType.UINT8,
    "bool": lambda trt: trt.DataType.BOOL,
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
}


class TensorRTEngine:
    """A deserialized engine with one execution context: CUDA tensors in, CUDA tensors out, on the
    current torch CUDA stream."""

    def __init__(self, trt: Any, runtime: Any, cuda_engine: Any, io: EngineIO) -> None:
        self._runtime = runtime  # the engine must not outlive its runtime
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
        stream = torch.cuda.current_stream(device)
        if not ctx.execute_async_v3(stream.cuda_stream):
            raise BackendError("TensorRT failed to enqueue the engine (execute_async_v3 returned False)")
        return tuple(outputs)
