"""Structural fingerprint of an engine partition: structure, never weight values.

The hash covers op targets, argument structure, edges (as local node indices), input/output shapes
(dynamic dims by name and min/opt/max range, not by the program's symbol numbers), dtypes, which
inputs are weights, and every setting that changes engine bytes. Two BERT layers of one model, or of
two models with the same config, get one fingerprint; a different hidden size or precision does not.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

import torch

from compiler.backends.onnx_support import op_name


class ShapeNames:
    """Renders symbolic shapes with dimension names and ranges instead of program-local symbols."""

    def __init__(self, symbols: Mapping[str, tuple[str, int, int, int]]):
        import sympy  # here, not at import: a package load never fingerprints, and sympy costs ~0.3 s

        self._subs = {
            sympy.Symbol(sym, integer=True, positive=True): sympy.Symbol(f"{name}[{lo}:{opt}:{hi}]")
            for sym, (name, lo, opt, hi) in symbols.items()
        }
        self._plain = {sympy.Symbol(sym): new for sym, new in zip(symbols, self._subs.values(), strict=True)}

    def expr(self, value: Any) -> str:
        if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
            expr = value.node.expr
            return str(expr.xreplace(self._subs).xreplace(self._plain))
        return repr(value)

    def shape(self, shape: Any) -> list[str]:
        return [self.expr(d) for d in shape]


def describe_value(value: Any, names: ShapeNames) -> Any:
    if isinstance(value, torch.Tensor):
        return {"dtype": str(value.dtype), "shape": names.shape(value.shape)}
    if isinstance(value, list | tuple):
        return [describe_value(v, names) for v in value]
    if isinstance(value, torch.SymInt | torch.SymFloat | torch.SymBool):
        return {"sym": names.expr(value)}
    return repr(value)


def _arg(value: Any, index: Mapping[torch.fx.Node, int]) -> Any:
    if isinstance(value, torch.fx.Node):
        return ["%", index[value]]
    if isinstance(value, list | tuple):
        return [_arg(v, index) for v in value]
    if isinstance(value, Mapping):
        return {str(k): _arg(v, index) for k, v in sorted(value.items())}
    if isinstance(value, float):
        return ["f", value.hex()]
    return repr(value)


def structure(
    graph: torch.fx.Graph, input_kinds: tuple[str, ...], symbols: Mapping[str, tuple[str, int, int, int]]
) -> list:
    """The canonical, JSON-able description of a partition graph that the fingerprint hashes."""
    names = ShapeNames(symbols)
    index: dict[torch.fx.Node, int] = {}
    rows: list = []
    placeholders = 0
    for node in graph.nodes:
        index[node] = len(index)
        val = describe_value(node.meta.get("val"), names)
        if node.op == "placeholder":
            rows.append(["in", input_kinds[placeholders], val])
            placeholders += 1
        elif node.op == "call_function":
            rows.append(["op", op_name(node.target), _arg(node.args, index), _arg(node.kwargs, index), val])
        elif node.op == "output":
            rows.append(["out", _arg(node.args, index)])
        else:
            rows.append([node.op, str(node.target)])
    return rows


def fingerprint(
    graph: torch.fx.Graph,
    input_kinds: tuple[str, ...],
    symbols: Mapping[str, tuple[str, int, int, int]],
    settings: Mapping[str, Any],
) -> str:
    """sha256 over the partition's structure and the engine-affecting settings (hex, 64 chars)."""
    payload = {"structure": structure(graph, input_kinds, symbols), "settings": dict(settings), "v": 1}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()
