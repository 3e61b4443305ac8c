"""The loaded Inductor engine: a compiled graph (or its static-shape specializations) and one instance's
weights, on the engine's device; and the weights a load or refit passes, checked against the header.

A call whose activation shapes equal a specialization's exactly runs it; every other call runs the
dynamic graph (``InductorEngine.last_dispatch`` says which ran last). Weights are inputs of the
compiled graph, so a refit copies new weights into the engine's own tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from compiler.backends.base import EngineIO
from compiler.backends.inductor.graph import (
    graph_args,
)
from compiler.errors import (
    RefitError,
)
from compiler.inputs.specs import dtype_name


class InductorEngine:
    """A loaded engine: the compiled graph and this instance's weights, on the engine's device."""

    def __init__(
        self,
        compiled: Callable[..., Any],
        weights: tuple[torch.Tensor, ...],
        io: EngineIO,
        constants: Mapping[int, torch.Tensor] | None = None,
        specializations: Mapping[tuple[tuple[int, ...], ...], Callable[..., Any]] | None = None,
        expected_weights: Mapping[str, Any] | None = None,
    ):
        self.compiled, self.weights, self.io = compiled, weights, io
        self._expected = dict(expected_weights or {})  # the header's {name: [shape, dtype]}
        self.device = weights[0].device if weights else None
        self._constants = dict(constants or {})
        # Activation shapes -> static-shape compiled graph (one per shape profile).
        self.specializations: dict[tuple[tuple[int, ...], ...], Callable[..., Any]] = dict(
            specializations or {}
        )
        # What served the last call: "static" or "dynamic"; "blocks" for a dynamic graph compiled one
        # repeated block at a time (inductor/blocks.py: a GraphModule calling the compiled pieces)
        self.last_dispatch: str | None = "blocks" if isinstance(compiled, torch.fx.GraphModule) else None
        # This machine's own native package being built for the loads after this one (native.py)
        self.native_build: Any = None

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # The graph was compiled for contiguous activations (it asserts their strides): a transposed
        # input, or a view a fallback op returns, is copied first.
        inputs = tuple(x if x.is_contiguous() else x.contiguous() for x in inputs)
        compiled = self.compiled
        if self.specializations:
            static = self.specializations.get(tuple(tuple(x.shape) for x in inputs))
            compiled = compiled if static is None else static
            self.last_dispatch = "dynamic" if static is None else "static"
        return tuple(compiled(*graph_args(inputs, self.weights, self._constants)))

    def refit_in_place(self, weights: Mapping[str, torch.Tensor]) -> None:
        """New weights copied into this engine's own tensors (checked like a load's): the compiled
        graphs take them as inputs, so CUDA graphs captured over this engine replay with the new ones."""
        new = ordered_weights({"weights": self._expected}, weights, self.device or torch.device("cpu"))
        with torch.no_grad():
            for mine, value in zip(self.weights, new, strict=True):
                mine.copy_(value)


def ordered_weights(
    header: Mapping[str, Any], weights: Mapping[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """The weights in the engine's input order, checked against the header's names, shapes and dtypes."""
    expected = header["weights"]
    missing, unknown = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unknown:
        raise RefitError(f"weights do not match the engine: missing {missing}, unexpected {unknown}")
    ordered = []
    for name in sorted(expected, key=lambda n: int(n[1:])):
        shape, dtype = expected[name]
        tensor = weights[name]
        if list(tensor.shape) != list(shape) or dtype_name(tensor.dtype) != dtype:
            raise RefitError(
                f"weight {name!r}: expected shape {tuple(shape)} dtype {dtype}, got shape "
                f"{tuple(tensor.shape)} dtype {dtype_name(tensor.dtype)}"
            )
        ordered.append(tensor.detach().to(device))
    return tuple(ordered)
