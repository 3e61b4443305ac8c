"""Build a zoo entry's model from its factory, with seeded weights and the entry's input ranges.

Factories return ``zoo.models.ModelCase(model, args, kwargs, dynamic_shapes)``. The entry's ``inputs``
replace the factory's dynamic dims per input, and a dimension name given there applies to every input
that uses it (so ``seq`` stays one dimension across ``input_ids`` and ``attention_mask``).
"""

from __future__ import annotations

import hashlib
import inspect
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.export import Dim

from flows.zoo_config import ZooConfigError, ZooEntry, resolve_factory
from tasks.workspace import content_hash


@dataclass
class LoadedCase:
    model: torch.nn.Module
    args: tuple
    kwargs: dict[str, Any]
    dynamic_shapes: dict[str, Any] | None


def _call_factory(entry: ZooEntry) -> Any:
    factory = resolve_factory(entry.factory, f"models[{entry.name}].factory")
    kwargs = dict(entry.factory_kwargs)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):
        params = {}
    if "seed" in params and "seed" not in kwargs:
        kwargs["seed"] = entry.seed
    # Random weights must be the same every time the model is built: export and validation build it
    # separately, and the content key hashes the weights.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(entry.seed)
        try:
            return factory(**kwargs)
        except TypeError as exc:
            raise ZooConfigError(
                f"models[{entry.name}].factory_kwargs: {entry.factory}(**{kwargs}) failed: {exc}; "
                "check the keyword names against the factory's signature"
            ) from None


def load_case(entry: ZooEntry) -> LoadedCase:
    """The entry's model (eval mode), example inputs and dynamic shapes with the entry's overrides."""
    case = _call_factory(entry)
    model = getattr(case, "model", None)
    if not isinstance(model, torch.nn.Module):
        raise ZooConfigError(
            f"models[{entry.name}].factory: {entry.factory} returned {type(case).__name__}; expected "
            "zoo.models.ModelCase(model, args, kwargs, dynamic_shapes) with an nn.Module as model"
        )
    args, kwargs = tuple(getattr(case, "args", ()) or ()), dict(getattr(case, "kwargs", {}) or {})
    shapes = _merge_dynamic_shapes(entry, model, args, kwargs, getattr(case, "dynamic_shapes", None))
    return LoadedCase(model.eval(), args, kwargs, shapes)


def _bound_inputs(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any]:
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
    except TypeError as exc:
        raise ZooConfigError(
            f"the factory's example inputs do not fit {type(model).__name__}.forward: {exc}"
        ) from None
    return dict(bound.arguments)


def _merge_dynamic_shapes(
    entry: ZooEntry, model: torch.nn.Module, args: tuple, kwargs: dict, factory_shapes: Any
) -> dict[str, Any] | None:
    if not entry.inputs:
        return factory_shapes
    inputs = _bound_inputs(model, args, kwargs)
    names = list(inputs)
    if factory_shapes is None:
        shapes: dict[str, Any] = dict.fromkeys(names)
    elif isinstance(factory_shapes, dict):
        shapes = {name: factory_shapes.get(name) for name in names}
    else:
        shapes = dict(zip(names, list(factory_shapes) + [None] * len(names), strict=False))
    dims = {d.name: Dim(d.name, min=d.min, max=d.max) for o in entry.inputs.values() for d in o.dims}

    def rename(spec: Any) -> Any:
        # A factory Dim with an overridden name takes the new range everywhere it appears.
        if isinstance(spec, dict):
            return {axis: dims.get(getattr(d, "__name__", None), d) for axis, d in spec.items()}
        return spec

    shapes = {name: rename(spec) for name, spec in shapes.items()}
    for input_name, override in entry.inputs.items():
        where = f"models[{entry.name}].inputs.{input_name}"
        if input_name not in inputs:
            raise ZooConfigError(f"{where}: the model has no input {input_name!r}; its inputs are {names}")
        value = inputs[input_name]
        if not isinstance(value, torch.Tensor):
            raise ZooConfigError(f"{where}: input is a {type(value).__name__}, ranges apply to tensors only")
        for d in override.dims:
            if d.axis >= value.dim():
                raise ZooConfigError(f"{where}.dims: axis {d.axis} is outside the input's rank {value.dim()}")
            size = int(value.shape[d.axis])
            if not d.min <= size <= d.max:
                raise ZooConfigError(
                    f"{where}.dims (axis {d.axis}, {d.name!r}): the factory's example has size {size}, "
                    f"outside [{d.min}, {d.max}]; widen the range to include {size}"
                )
        shapes[input_name] = {d.axis: dims[d.name] for d in override.dims} or None
    return shapes


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every parameter and buffer (names, dtypes, shapes, bytes)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def source_digest(factory: str) -> str:
    """sha256 of the factory's module source: an architecture edit changes the key even with equal weights."""
    module_name = factory.partition(":")[0]
    import importlib

    module = importlib.import_module(module_name)
    path = getattr(module, "__file__", None)
    return hashlib.sha256(Path(path).read_bytes()).hexdigest() if path else "builtin"


def model_key(entry: ZooEntry, case: LoadedCase) -> str:
    """The model's content key: weights, factory source, factory call and input ranges."""
    return content_hash(
        "model",
        entry.factory,
        entry.factory_kwargs,
        entry.seed,
        entry.inputs,
        weights_digest(case.model),
        source_digest(entry.factory),
    )
