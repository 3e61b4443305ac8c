"""Which ATen ops go into a TensorRT / TensorRT-RTX engine: the op support table.

Supported ops: the ATen overloads that the torch.onnx exporter translates (the set ONNX Runtime
uses) minus those whose translation uses an ONNX op that TensorRT's ONNX parser rejects. The
rejected ONNX ops are :data:`PARSER_REJECTED_ONNX_OPS`, recorded from
``OnnxParser.supports_operator`` over every default-domain ONNX op (TensorRT-RTX 1.7.1;
``tests/backends/tensorrt/test_tensorrt_backend.py`` re-checks it against any installed library), and
which ONNX ops an ATen overload's translation uses is read from the exporter's own torchlib functions
(over-approximated across dtype branches, so doubt means fallback). Exceptions, each checked on the
zoo: sequence ops the exporter's optimizer folds into Split/Concat; bitwise ops, which are
And/Or/Not on bool masks; ops the exporter decomposes first, judged by their op family. The H100
proof (``benchmarks/tensorrt_rtx_build_proof.py``) parses and builds every zoo partition with it.

Guarantees: needs neither TensorRT nor a GPU (the partitioner asks it on any machine); an op with
no ONNX translation is never supported; every refusal has a reason (:func:`unsupported_reason`).
"""

from __future__ import annotations

import functools
import inspect
import re
import types
from typing import Any

import torch

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
# to BitwiseAnd/... on integers. The op table sees ops, not dtypes, so it takes them: the rare
# integer case fails the build with the node named rather than splitting every BERT and GPT-2.
_BOOL_BITWISE = frozenset(
    f"aten::bitwise_{op}.{overload}"
    for op in ("and", "or", "xor")
    for overload in ("Tensor", "Scalar", "Scalar_Tensor")
) | {"aten::bitwise_not"}


_OP_CALL = re.compile(r"\b(?:op|opset\d+)\.([A-Z][A-Za-z0-9]*)\(")
_NAME_CALL = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\(")


def _onnx_registry() -> Any:
    from compiler.backends import onnx_support

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


def onnx_ops_for(aten_op: Any) -> frozenset[str] | None:
    """ONNX ops the torch.onnx exporter may translate an ATen op (an fx node's ``target``) into:
    from its torchlib function when it has one, empty when the exporter decomposes the op first
    (into ATen ops that then have translations); None if it has no translation at all (the same
    test as ONNX Runtime's table, ``compiler.backends.onnx_support``)."""
    from compiler.backends.onnx_support import onnx_exportable
    from compiler.program.symbolic import SYMBOLIC_OPS

    if aten_op in SYMBOLIC_OPS:
        return frozenset({"Shape", "Gather", "Add", "Sub", "Mul", "Div", "Neg", "Mod"})
    if not onnx_exportable(aten_op):
        return None
    return _onnx_ops_by_name(aten_op.name()) or frozenset()


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


def unsupported_reason(aten_op: Any) -> str | None:
    """Why TensorRT cannot take an op (None when it can): no ONNX translation, or the ONNX ops its
    translation uses that TensorRT's ONNX parser rejects."""
    ops = onnx_ops_for(aten_op)
    if ops is None:
        return "no ONNX translation in the torch.onnx exporter"
    if not isinstance(aten_op, torch._ops.OpOverload) or aten_op.name() in _BOOL_BITWISE:
        return None  # symbolic shape math; And/Or/Xor/Not on bool masks (integers fail the parser, named)
    rejected = sorted((ops - EXPORTER_FOLDED_SEQUENCE_OPS) & PARSER_REJECTED_ONNX_OPS)
    if rejected:
        return f"its ONNX translation uses {rejected}, which TensorRT's ONNX parser does not support"
    family = aten_op.name().split(".")[0].removeprefix("aten::")
    if not ops and family in _rejected_families():
        return (
            f"it decomposes like aten::{family}, whose ONNX translation uses "
            f"{list(_rejected_families()[family])}, which TensorRT's ONNX parser does not support"
        )
    return None


def tensorrt_supports(aten_op: Any) -> bool:
    """Whether an ATen op overload can go into a TensorRT / TensorRT-RTX engine."""
    return unsupported_reason(aten_op) is None
