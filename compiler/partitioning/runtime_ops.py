"""What a package's runtime graph may call: one table of operators, and the rule every call is held to.

A runtime graph (``compiler.partitioning.runtime_graph``) is package data that becomes a torch.fx
graph, which fx turns into Python source and runs. Read untrusted, it may therefore only describe
calls kiln could have written itself:

* **targets** from :data:`ATEN_OPS`: pure tensor operators that kiln's partitioner leaves to PyTorch
  (ops an engine does not take, ``torch_executed_ops``, shape arithmetic) or that run a partition whose
  engine build fell back. Nothing with a path, file, storage, stream or generator argument
  (``from_file``, ``save``, ``_load*``), nothing that mutates (in-place and ``out=`` forms, ``set_``,
  ``resize_``), nothing that reads memory unchecked (``as_strided``, ``_unsafe_index*``, ``empty*``),
  no assertion or print with a message. An operator of another namespace is a user's custom op: it
  resolves only once the op-module rule imported its module (``compiler.program.module_policy``) and only if
  its schema takes no string (torch's own namespaces, :data:`TORCH_NAMESPACES`, are refused);
* **arguments** bound to the operator's schema as torch would bind them: each keyword is one of the
  schema's argument names, each value has its argument's type, a string only where
  :data:`STRING_ARGUMENTS` lists the argument and its values;
* **Python operators** only for tuple indexing and integer shape arithmetic (:data:`PYTHON_OPERATORS`),
  the arithmetic bounded: integers in and out within +-2**63 (:data:`INT_BOUND`).

A graph calling anything else is not written as a runtime graph (its package loads from the program,
as torch.export reads it) and is refused when read (``PackageCorruptError``).
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from compiler.errors import RuntimeGraphBoundError

# Integers a runtime graph's arithmetic may take and give: a size, stride, offset or index is an int64.
INT_BOUND = 2**63


def _bounded(name: str) -> Callable[..., Any]:
    """``operator.<name>`` whose integer operands and result lie within +-:data:`INT_BOUND` (Python's
    integers do not overflow: ``pow(7, 10**8)`` and a few squarings grow without end, in time and
    memory). Anything else is a :class:`RuntimeGraphBoundError`, for ``pow`` before it computes."""
    raw = getattr(operator, name)

    def call(*args: Any) -> Any:
        for value in args:
            if isinstance(value, int) and abs(value) > INT_BOUND:
                raise _bound_error(name, args, "takes an integer beyond +-2**63")
        if name == "pow" and len(args) == 2 and all(isinstance(v, int) for v in args):
            base, exponent = args
            if abs(base) > 1 and exponent > 63:  # |base| >= 2: the result is beyond 2**63 already
                raise _bound_error(name, args, "would give an integer beyond +-2**63")
        try:
            result = raw(*args)
        except (OverflowError, ZeroDivisionError) as exc:
            raise _bound_error(name, args, f"fails ({exc})") from None
        if isinstance(result, int) and abs(result) > INT_BOUND:
            raise _bound_error(name, args, "gives an integer beyond +-2**63")
        return result

    call.__name__ = call.__qualname__ = f"bounded_{name}"  # fx names the global it calls after it
    call.__module__ = __name__
    return call


def _bound_error(name: str, args: tuple, what: str) -> RuntimeGraphBoundError:
    shown = ", ".join(f"{v!r:.30}" if not isinstance(v, int) else str(v) for v in args)
    return RuntimeGraphBoundError(
        f"the package's runtime graph calls operator.{name}({shown}), which {what}: no shape, size or "
        "index needs it (docs/security.md, runtime graph bounds); refused"
    )


# Tuple indexing of multi-output nodes and arithmetic on symbolic sizes, by the name the file uses. A
# graph read from a package calls the bounded forms; one kiln traced calls operator's own (both are
# written under operator's name).
_ARITHMETIC = ("add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow")
PYTHON_OPERATORS: Mapping[str, Callable[..., Any]] = {
    "operator.getitem": operator.getitem,
    **{f"operator.{name}": _bounded(name) for name in _ARITHMETIC},
}
_TRACED_OPERATORS: Mapping[str, Callable[..., Any]] = {
    f"operator.{name}": getattr(operator, name) for name in ("getitem", *_ARITHMETIC)
}

# ATen operator packets (every overload that passes the schema rule below). Grouped by why a split
# graph holds them; each is a function of its tensor and scalar arguments alone.
ATEN_OPS = frozenset(
    {
        # shapes: symbolic sizes, views and reshapes (torch checks every view against its storage)
        *("sym_size", "sym_numel", "sym_stride", "sym_storage_offset", "view", "reshape", "_unsafe_view"),
        *("view_as", "reshape_as", "permute", "transpose", "t", "expand", "expand_as", "squeeze"),
        *("unsqueeze", "flatten", "unflatten", "movedim", "contiguous", "clone", "detach", "alias"),
        *("lift_fresh_copy", "to", "_to_copy", "type_as", "copy", "repeat", "repeat_interleave", "tile"),
        *("flip", "roll", "narrow", "select", "slice", "split", "split_with_sizes", "chunk", "unbind"),
        *("tensor_split", "cat", "concat", "concatenate", "stack", "pixel_shuffle", "pixel_unshuffle"),
        # bounds-checked indexing (index_copy: a KV cache's update, compiler.generation)
        *("index", "index_select", "index_copy", "gather", "take", "embedding", "index_put"),
        *("scatter", "scatter_add", "scatter_reduce", "masked_fill", "masked_select", "where", "nonzero"),
        *("one_hot", "tril", "triu"),
        # tensors made from sizes and values (never uninitialised memory)
        *("arange", "full", "full_like", "zeros", "zeros_like", "ones", "ones_like", "new_zeros"),
        *("new_ones", "new_full", "scalar_tensor", "linspace", "eye", "fill"),
        # pointwise arithmetic, comparisons, activations
        *("add", "sub", "rsub", "mul", "div", "true_divide", "floor_divide", "remainder", "fmod", "pow"),
        *("neg", "abs", "sign", "sgn", "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "sqrt"),
        *("rsqrt", "reciprocal", "square", "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh"),
        *("cosh", "tanh", "asinh", "acosh", "atanh", "erf", "erfc", "erfinv", "floor", "ceil", "round"),
        *("trunc", "frac", "clamp", "clamp_min", "clamp_max", "clip", "maximum", "minimum", "fmax"),
        *("fmin", "lerp", "addcmul", "addcdiv", "hypot", "logit", "nan_to_num", "logaddexp", "copysign"),
        *("sigmoid", "relu", "relu6", "gelu", "silu", "mish", "elu", "selu", "celu", "leaky_relu"),
        *("hardtanh", "hardsigmoid", "hardswish", "softplus", "softshrink", "hardshrink", "prelu", "glu"),
        *("isnan", "isinf", "isfinite", "logical_and", "logical_or", "logical_not", "logical_xor"),
        *("bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "__and__", "__or__", "__xor__"),
        *("eq", "ne", "lt", "le", "gt", "ge"),
        # reductions, normalisations, softmax
        *("sum", "mean", "prod", "amax", "amin", "max", "min", "argmax", "argmin", "any", "all", "var"),
        *("std", "var_mean", "std_mean", "norm", "linalg_vector_norm", "logsumexp", "cumsum", "cumprod"),
        *("diff",),  # transformers' GPT-2 mask code (position ids)
        *("topk", "sort", "argsort", "softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax"),
        *("layer_norm", "native_layer_norm", "group_norm", "native_group_norm", "rms_norm"),
        *("batch_norm", "_native_batch_norm_legit_no_training", "instance_norm", "dropout"),
        # matrix products, convolutions, pooling, attention, resizing
        *("linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "mv", "dot", "outer", "einsum", "_int_mm"),
        *("_scaled_mm", "conv1d", "conv2d", "conv3d", "convolution", "conv_transpose1d"),
        *("conv_transpose2d", "conv_transpose3d", "max_pool1d", "max_pool2d", "max_pool3d"),
        *("max_pool2d_with_indices", "avg_pool1d", "avg_pool2d", "avg_pool3d", "adaptive_avg_pool1d"),
        *("adaptive_avg_pool2d", "adaptive_avg_pool3d", "_adaptive_avg_pool2d", "pad", "constant_pad_nd"),
        *("reflection_pad1d", "reflection_pad2d", "replication_pad1d", "replication_pad2d"),
        *("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "upsample_bilinear2d"),
        *("scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu"),
    }
)

# The only string arguments a call may carry, and the values each may take.
STRING_ARGUMENTS: Mapping[tuple[str, str], frozenset[str] | re.Pattern[str]] = {
    ("gelu", "approximate"): frozenset({"none", "tanh"}),
    ("div", "rounding_mode"): frozenset({"trunc", "floor"}),
    ("pad", "mode"): frozenset({"constant", "reflect", "replicate", "circular"}),
    ("einsum", "equation"): re.compile(r"^[A-Za-z.,\->\s]{1,200}$"),
    ("scatter", "reduce"): frozenset({"add", "multiply"}),
    ("scatter_reduce", "reduce"): frozenset({"sum", "prod", "mean", "amax", "amin"}),
}

# Namespaces torch registers itself: never a user's custom op (file, process-group, profiler,
# quantized-kernel and test ops live here).
TORCH_NAMESPACES = frozenset(
    {
        *("aten", "prims", "profiler", "c10d", "_c10d_functional", "_c10d_functional_autograd"),
        *("_dtensor", "_native", "_quantized", "quantized", "quantization", "_test", "debug_mode_ops"),
        *("debugprims", "rngprims", "export", "inductor", "inductor_prims", "mkl", "mkldnn"),
        *("mkldnn_prepacked", "onednn", "sparse", "static_runtime", "symm_mem", "image", "higher_order"),
    }
)

_OP_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)::([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)$")
# Argument types a call may pass (torch's schema types, as ``Argument.real_type`` spells them).
_SCALARS: Mapping[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "number": (int, float, bool),
    "ScalarType": (torch.dtype,),
    "Layout": (torch.layout,),
    "Device": (torch.device,),
    "MemoryFormat": (torch.memory_format,),
}


class CallRefused(ValueError):
    """A call the runtime-graph rule does not allow (the message says which part and why)."""


def target_name(target: object) -> str:
    """The file's name for an allowed call target; :class:`CallRefused` for any other."""
    if isinstance(target, torch._ops.OpOverload):
        name = f"{target.namespace}::{target._opname}.{target._overloadname}"
        _check_operator(target, name)
        return name
    for name, fn in PYTHON_OPERATORS.items():
        if fn is target or _TRACED_OPERATORS[name] is target:
            return name
    raise CallRefused(f"call target {target!r:.80} is not an operator a runtime graph may call")


def resolve(name: str) -> Callable[..., Any]:
    """The allowed call target a file names (an operator already registered in this process)."""
    if name in PYTHON_OPERATORS:
        return PYTHON_OPERATORS[name]
    match = _OP_NAME.match(name)
    if match is None:
        raise CallRefused(f"call target {name!r:.80} is not an operator name")
    namespace, packet, overload = match.groups()
    if namespace == "aten" and packet not in ATEN_OPS:
        raise CallRefused(
            f"{name} is not in the runtime graph's operator table (compiler/partitioning/runtime_ops.py)"
        )
    try:  # a look-up in the dispatcher's registry: an op whose module was never imported is not there
        target = getattr(getattr(getattr(torch.ops, namespace), packet), overload)
    except (AttributeError, RuntimeError) as exc:
        raise CallRefused(f"operator {name} is not registered in this process") from exc
    if not isinstance(target, torch._ops.OpOverload):
        raise CallRefused(f"{name} is not an operator overload")
    _check_operator(target, name)
    return target


def returns_several(target: torch._ops.OpOverload) -> bool:
    """Whether the operator returns a tuple or list of results (graph nodes index it)."""
    returns = target._schema.returns
    return len(returns) != 1 or str(returns[0].real_type).startswith("List[")


def check_call(
    target: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], node: type
) -> None:
    """Bind ``args``/``kwargs`` to ``target``'s schema; :class:`CallRefused` where torch would not take
    them as they are, or where a value is not of its argument's type. ``node``: the graph-value type
    (any argument may be another node's result)."""
    if not isinstance(target, torch._ops.OpOverload):  # a Python operator: nodes and numbers
        if kwargs or not 1 <= len(args) <= 2:
            raise CallRefused(f"{target.__name__} takes one or two positional arguments")
        if any(not isinstance(a, node | int | float) or isinstance(a, bool) for a in args):
            raise CallRefused(f"{target.__name__} takes graph values and numbers")
        return
    schema = target._schema
    positional = [a for a in schema.arguments if not a.kwarg_only]
    if len(args) > len(positional):
        raise CallRefused(
            f"{target} takes {len(positional)} positional arguments, the graph passes {len(args)}"
        )
    by_name = {a.name: a for a in schema.arguments}
    bound = dict(zip((a.name for a in positional), args, strict=False))
    for key, value in kwargs.items():
        if key not in by_name:
            raise CallRefused(f"{target} has no argument {key!r:.60}")
        if key in bound:
            raise CallRefused(f"{target}: argument {key!r} is given twice")
        bound[key] = value
    for argument in schema.arguments:
        if argument.name not in bound:
            if not argument.has_default_value():
                raise CallRefused(f"{target}: argument {argument.name!r} is missing")
            continue
        value = bound[argument.name]
        if not _fits(str(argument.real_type), value, node, (target._opname, argument.name)):
            raise CallRefused(f"{target}: argument {argument.name!r} cannot be {_describe(value)}")


def _check_operator(target: torch._ops.OpOverload, name: str) -> None:
    namespace = target.namespace
    if namespace == "aten":
        if target._opname not in ATEN_OPS:
            raise CallRefused(
                f"{name} is not in the runtime graph's operator table (compiler/partitioning/runtime_ops.py)"
            )
    elif namespace in TORCH_NAMESPACES:
        raise CallRefused(f"{name}: operators of torch's {namespace!r} namespace are not runtime-graph calls")
    schema = target._schema
    for argument in schema.arguments:
        if argument.alias_info is not None and argument.alias_info.is_write:
            raise CallRefused(f"{name} writes into its argument {argument.name!r}")
        kind = str(argument.real_type)
        strings = namespace == "aten" and (target._opname, argument.name) in STRING_ARGUMENTS
        if not _type_allowed(kind, strings):
            raise CallRefused(f"{name} takes an argument {argument.name!r} of type {kind}")


def _type_allowed(kind: str, strings: bool) -> bool:
    inner = kind
    for wrapper in ("Optional[", "List["):
        if inner.startswith(wrapper) and inner.endswith("]"):
            inner = inner[len(wrapper) : -1]
    if inner.startswith("Optional[") and inner.endswith("]"):  # List[Optional[Tensor]]
        inner = inner[len("Optional[") : -1]
    return inner == "Tensor" or inner in _SCALARS or (inner == "str" and strings)


def _fits(kind: str, value: Any, node: type, where: tuple[str, str]) -> bool:
    if isinstance(value, node):  # a node's result: its type is torch's to check at run time
        return True
    if kind.startswith("Optional[") and kind.endswith("]"):
        return value is None or _fits(kind[len("Optional[") : -1], value, node, where)
    if kind.startswith("List[") and kind.endswith("]"):
        inner = kind[len("List[") : -1]
        return isinstance(value, list | tuple) and all(_fits(inner, v, node, where) for v in value)
    if kind == "Tensor":  # from the graph, or a number torch wraps (``add.Tensor(x, 0)``)
        return isinstance(value, int | float)
    if kind == "str":
        allowed = STRING_ARGUMENTS.get(where)
        if not isinstance(value, str) or allowed is None:
            return False
        return bool(allowed.match(value)) if isinstance(allowed, re.Pattern) else value in allowed
    types = _SCALARS.get(kind)
    if types is None:
        return False
    if isinstance(value, bool) and bool not in types:
        return False
    return isinstance(value, types)


def _describe(value: Any) -> str:
    return f"a {type(value).__name__} ({value!r:.40})"
