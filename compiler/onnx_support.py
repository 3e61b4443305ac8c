"""Which ATen ops the torch.onnx exporter can translate: the base of every backend's op table."""

from __future__ import annotations

import logging
import operator
from functools import cache
from typing import Any

import torch

# Shape arithmetic on symbolic sizes: the exporter turns these into Shape/Gather/Mul nodes.
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


@cache
def _registry() -> Any:
    from torch.onnx._internal.exporter import _registration

    # torchvision-only ops log a warning per op when torchvision is absent; they are irrelevant here.
    logger = logging.getLogger("torch.onnx._internal.exporter._registration")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        return _registration.ONNXRegistry.from_torchlib()
    finally:
        logger.setLevel(level)


def onnx_exportable(target: Any) -> bool:
    """Whether an fx node target (ATen overload or symbolic op) has an ONNX translation."""
    if target in SYMBOLIC_OPS:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return bool(_registry().is_registered(target))


def op_name(target: Any) -> str:
    """A stable, readable op name: ``aten.addmm.default``, ``operator.mul``."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module = getattr(target, "__module__", "") or "builtins"
    return f"{module}.{getattr(target, '__name__', str(target))}".replace("_operator.", "operator.")
