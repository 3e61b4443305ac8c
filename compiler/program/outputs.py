"""Output specs and index bounds: what a program returns and what its index inputs accept, read from
the exported program's own metadata (fake tensors, symbolic shapes), nothing run.

A server learns a version's signature from these (``Manifest.output_specs``, the inputs'
``index_bound``), so any host describes any engine target: a CUDA package exported for Triton on a
CPU-only host needs neither its device nor a load.

Output names follow the model's output structure: the keys of a mapping (a Hugging Face
``ModelOutput``: ``last_hidden_state``, ``logits``), with ``_<i>`` for the leaves of a nested value
under a key; otherwise ``output_<i>`` over the flat outputs (a single tensor is ``output_0``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import OutputKind
from torch.utils import _pytree as pytree

from compiler.inputs.specs import InputSpec, OutputSpec, dtype_name

if TYPE_CHECKING:
    import sympy

# Ops that pass an index input's values through unchanged (only its shape or layout changes): an
# embedding reached through them still bounds the input.
_VALUE_PRESERVING = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "unsqueeze",
        "squeeze",
        "expand",
        "flatten",
        "contiguous",
        "clone",
        "alias",
        "permute",
        "transpose",
        "slice",
        "select",
        "to",
        "_to_copy",
        "t",
    }
)
_INDEXING = frozenset({"embedding"})


def output_names(out_spec: pytree.TreeSpec) -> list[str]:
    """One name per leaf of ``out_spec`` (see the module docstring)."""
    if out_spec.is_leaf():
        return ["output_0"]
    keys = _keys(out_spec)
    if keys is None:
        return [f"output_{i}" for i in range(out_spec.num_leaves)]
    names = []
    for index, key in enumerate(keys):
        child = out_spec.child(index)
        if child.is_leaf():
            names.append(key)
        else:
            names += [f"{key}_{i}" for i in range(child.num_leaves)]
    return names


def _keys(spec: pytree.TreeSpec) -> list[str] | None:
    """The string keys of a mapping node (dict, OrderedDict, ModelOutput), else None."""
    context = spec.context
    keyed = isinstance(context, list | tuple) and len(context) == spec.num_children
    return list(context) if keyed and all(isinstance(k, str) and k for k in context) else None


def output_specs(program: ExportedProgram, specs: tuple[InputSpec, ...]) -> tuple[OutputSpec, ...]:
    """The program's user outputs: names (:func:`output_names`), dtypes and shape ranges over the
    input specs' ranges. A leaf that is not a tensor gets its Python type as its dtype (no server
    takes it; the server's check names it)."""
    names = output_names(program.call_spec.out_spec)
    output = next(n for n in reversed(program.graph.nodes) if n.op == "output")
    values = [
        value
        for value, spec in zip(output.args[0], program.graph_signature.output_specs, strict=True)
        if spec.kind == OutputKind.USER_OUTPUT
    ]
    if len(values) != len(names):  # a structure torch.export flattened otherwise: positional names
        names = [f"output_{i}" for i in range(len(values))]
    symbols = _symbol_names(program, specs)
    made = []
    for name, value in zip(names, values, strict=True):
        val = value.meta.get("val") if isinstance(value, torch.fx.Node) else value
        if not isinstance(val, torch.Tensor):
            made.append(OutputSpec(name, type(val).__name__, (), ()))
            continue
        lo, hi, dyn = [], [], {}
        for axis, size in enumerate(val.shape):
            if not isinstance(size, torch.SymInt) or size.node.expr.is_number:
                lo.append(int(size)), hi.append(int(size))
                continue
            expr = size.node.expr
            low, high = _bounds(expr, symbols)
            lo.append(low), hi.append(high)
            dyn[axis] = _expr_name(expr, symbols)
        made.append(OutputSpec(name, _dtype(val.dtype), tuple(lo), tuple(hi), dyn))
    return tuple(made)


def _dtype(dtype: torch.dtype) -> str:
    try:
        return dtype_name(dtype)
    except Exception:  # a dtype specs do not name (complex, fp8): recorded as torch says it
        return str(dtype).removeprefix("torch.")


def _symbol_names(program: ExportedProgram, specs: tuple[InputSpec, ...]) -> dict:
    """Each input shape symbol -> (dimension name, min, max) from the input specs."""
    names = set(program.graph_signature.user_inputs)
    nodes = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in names]
    symbols: dict = {}
    for node, spec in zip(nodes, specs, strict=False):
        val = node.meta.get("val")
        for axis, size in enumerate(getattr(val, "shape", ())):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                symbols.setdefault(
                    size.node.expr,
                    (
                        spec.dynamic_dims.get(axis, str(size.node.expr)),
                        spec.min_shape[axis],
                        spec.max_shape[axis],
                    ),
                )
    return symbols


def _bounds(expr: sympy.Expr, symbols: dict) -> tuple[int, int]:
    """(min, max) of a shape expression over the inputs' ranges (monotone expressions, as shapes are);
    (0, -1) where it has a symbol no input bounds (a data-dependent size)."""
    if any(sym not in symbols for sym in expr.free_symbols):
        return 0, -1
    try:
        low = int(expr.subs({sym: symbols[sym][1] for sym in expr.free_symbols}))
        high = int(expr.subs({sym: symbols[sym][2] for sym in expr.free_symbols}))
    except (TypeError, ValueError):
        return 0, -1
    return min(low, high), max(low, high)


def _expr_name(expr: sympy.Expr, symbols: dict) -> str:
    """``batch`` for an axis that is an input's named dimension; ``2*seq`` for an expression of them."""
    if expr in symbols:
        return symbols[expr][0]
    import sympy

    return str(expr.subs({sym: sympy.Symbol(symbols[sym][0]) for sym in expr.free_symbols if sym in symbols}))


def index_bounds(program: ExportedProgram) -> dict[str, int]:
    """User input name -> the rows of the smallest table it indexes: an integer input that reaches an
    embedding's indices through ops that keep its values (views, reshapes, copies)."""
    names = set(program.graph_signature.user_inputs)
    bounds: dict[str, int] = {}
    for node in program.graph.nodes:
        if node.op != "placeholder" or node.name not in names:
            continue
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor) or val.dtype.is_floating_point or val.dtype == torch.bool:
            continue
        rows = _indexed_rows(node)
        if rows is not None:
            bounds[node.name] = rows
    return bounds


def _indexed_rows(start: torch.fx.Node, depth: int = 8) -> int | None:
    found: list[int] = []
    frontier, seen = [start], {start}
    for _ in range(depth):
        following = []
        for node in frontier:
            for user in node.users:
                op = _op_name(user)
                if op in _INDEXING and len(user.args) > 1 and user.args[1] is node:
                    weight = user.args[0].meta.get("val") if isinstance(user.args[0], torch.fx.Node) else None
                    if isinstance(weight, torch.Tensor) and isinstance(weight.shape[0], int):
                        found.append(int(weight.shape[0]))
                elif op in _VALUE_PRESERVING and user.args and user.args[0] is node and user not in seen:
                    seen.add(user)
                    following.append(user)
        frontier = following
    return min(found) if found else None


def _op_name(node: torch.fx.Node) -> str | None:
    if node.op != "call_function":
        return None
    target = node.target
    packet = getattr(target, "_opname", None) or getattr(target, "__name__", "")
    return str(packet).split(".")[0]
