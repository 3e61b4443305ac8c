"""Size arithmetic in an exported program: the ops that compute symbolic sizes, and the nodes that do.

The ONNX exporter turns these ops into Shape/Gather/Mul nodes; partitioning gives each size
computation to its one user; block detection counts them with the block of their user.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

SYMBOLIC_OPS = frozenset(
    {
        torch.ops.aten.sym_size.int,
        torch.ops.aten.sym_numel.default,
        torch.ops.aten.sym_stride.int,
        operator.add,
        operator.sub,
        operator.mul,
        operator.floordiv,
        operator.truediv,
        operator.neg,
        operator.mod,
        operator.getitem,
    }
)


def is_symbolic(node: Any) -> bool:
    """A node that computes a size (an int, float or bool, symbolic or not) from sizes."""
    return (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and node.target in SYMBOLIC_OPS
        and isinstance(node.meta.get("val"), torch.SymInt | torch.SymFloat | torch.SymBool | int | float)
    )
