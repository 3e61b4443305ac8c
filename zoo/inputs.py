"""Input-range overrides: a zoo entry's ``inputs:`` replace a source's dynamic dims, per input.

A dimension name given there applies to every input that uses it, so ``seq`` stays one dimension
across ``input_ids`` and ``attention_mask``. ``dims: []`` makes an input static. ``drop: true`` leaves
out an input the source passes by keyword to a ``forward`` parameter with a default (an ``hf:`` model's
``token_type_ids``): the model is exported without it, and runs on that default.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from zoo.errors import ZooConfigError
from zoo.sources.base import LoadedCase

if TYPE_CHECKING:  # requests carry overrides as data; torch only where a loaded model's inputs change
    import torch


@runtime_checkable
class DimOverride(Protocol):
    axis: int
    name: str
    min: int
    max: int


@runtime_checkable
class InputOverrideLike(Protocol):
    dims: list[DimOverride]  # (and ``drop: bool``, read with a False default)


def bound_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The example inputs by the names of ``model.forward``'s parameters."""
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise ZooConfigError(
            f"the source's example inputs do not fit {type(model).__name__}.forward: {exc}"
        ) from None
    return dict(bound.arguments)


def apply_overrides(case: LoadedCase, overrides: Mapping[str, InputOverrideLike], where: str) -> LoadedCase:
    """``case`` with its dynamic shapes replaced where ``overrides`` say (see the module docstring)."""
    if not overrides:
        return case
    import torch
    from torch.export import Dim

    inputs = bound_inputs(case.model, case.args, case.kwargs)
    names = list(inputs)
    given = case.dynamic_shapes
    if given is None:
        shapes: dict[str, Any] = dict.fromkeys(names)
    elif isinstance(given, dict):
        shapes = {name: given.get(name) for name in names}
    else:
        shapes = dict(zip(names, list(given) + [None] * len(names), strict=False))
    dims = {d.name: Dim(d.name, min=d.min, max=d.max) for o in overrides.values() for d in o.dims}

    def rename(spec: Any) -> Any:
        # A source Dim with an overridden name takes the new range everywhere it appears.
        if isinstance(spec, dict):
            return {axis: dims.get(getattr(d, "__name__", None), d) for axis, d in spec.items()}
        return spec

    shapes = {name: rename(spec) for name, spec in shapes.items()}
    kwargs = dict(case.kwargs)
    for input_name, override in overrides.items():
        at = f"{where}.inputs.{input_name}"
        if input_name not in inputs:
            raise ZooConfigError(f"{at}: the model has no input {input_name!r}; its inputs are {names}")
        if getattr(override, "drop", False):
            _check_droppable(case, input_name, f"{at}.drop")
            del kwargs[input_name], shapes[input_name]
            continue
        value = inputs[input_name]
        if not isinstance(value, torch.Tensor):
            raise ZooConfigError(f"{at}: input is a {type(value).__name__}, ranges apply to tensors only")
        for d in override.dims:
            if d.axis >= value.dim():
                raise ZooConfigError(f"{at}.dims: axis {d.axis} is outside the input's rank {value.dim()}")
            size = int(value.shape[d.axis])
            if not d.min <= size <= d.max:
                raise ZooConfigError(
                    f"{at}.dims (axis {d.axis}, {d.name!r}): the example has size {size}, "
                    f"outside [{d.min}, {d.max}]; widen the range to include {size}"
                )
        shapes[input_name] = {d.axis: dims[d.name] for d in override.dims} or None
    return LoadedCase(case.model, case.args, kwargs, shapes)


def _check_droppable(case: LoadedCase, name: str, at: str) -> None:
    """An input can be left out only where the call can go without it: a keyword with a default."""
    model = type(case.model).__name__
    if name not in case.kwargs:
        raise ZooConfigError(
            f"{at}: the source passes input {name!r} to {model}.forward by position, so it cannot be "
            "dropped; remove drop"
        )
    parameter = inspect.signature(case.model.forward).parameters.get(name)
    if parameter is None or parameter.default is inspect.Parameter.empty:
        raise ZooConfigError(
            f"{at}: {model}.forward requires input {name!r} (it has no default), so it cannot be dropped; "
            "remove drop"
        )


def largest_input_bytes(case: LoadedCase, overrides: Mapping[str, InputOverrideLike]) -> dict[str, int]:
    """Bytes of each tensor input at the top of its ranges (overrides, else the example's own size)."""
    import torch

    inputs = bound_inputs(case.model, case.args, case.kwargs)
    top = {d.name: d.max for o in overrides.values() for d in o.dims}
    sizes: dict[str, int] = {}
    for name, value in inputs.items():
        if not isinstance(value, torch.Tensor):
            continue
        shape = list(value.shape)
        for d in getattr(overrides.get(name), "dims", []):
            shape[d.axis] = top[d.name]
        count = 1
        for n in shape:
            count *= int(n)
        sizes[name] = count * value.element_size()
    return sizes
