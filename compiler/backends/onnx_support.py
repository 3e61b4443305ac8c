"""Which ATen ops the torch.onnx exporter can translate: the base of every backend's op table."""

from __future__ import annotations

import logging
from functools import cache
from typing import Any

import torch

from compiler.program.symbolic import SYMBOLIC_OPS


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


@cache
def _decomposable() -> frozenset:
    return frozenset(torch.export.default_decompositions())


@cache
def onnx_exportable(target: Any) -> bool:
    """Whether an fx node target (ATen overload or symbolic op) has an ONNX translation.

    Either torchlib translates it directly, or the exporter decomposes it first (the core ATen
    decompositions, or a CompositeImplicitAutograd kernel) into ops that it translates. Mutating ops
    are never exportable: an engine cannot write into a tensor it was given.
    """
    if target in SYMBOLIC_OPS:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if any(arg.alias_info is not None and arg.alias_info.is_write for arg in target._schema.arguments):
        return False
    if _registry().is_registered(target) or target in _decomposable():
        return True
    return torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd")


def op_name(target: Any) -> str:
    """A stable, readable op name: ``aten.addmm.default``, ``operator.mul``."""
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module = getattr(target, "__module__", "") or "builtins"
    return f"{module}.{getattr(target, '__name__', str(target))}".replace("_operator.", "operator.")
