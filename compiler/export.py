"""Export: torch.export with the input specs captured once and attached to the program (seed 004).

The specs ride on the program's user-input placeholders (``node.meta["custom"]``, which survives
``run_decompositions``) and, on disk, in the ``.pt2`` archive's extra files. Programs exported with plain
``torch.export`` carry no specs: :func:`input_specs` then derives them from the program's own range
constraints and example inputs, and refuses unbounded ranges.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import threading
import zipfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import sympy
import torch
from torch.export import ExportedProgram

from compiler.atomic import atomic_write
from compiler.errors import ExportError, InputSpecError
from compiler.specs import InputSpec, dtype_name, specs_from_json, specs_to_json

# torch.export and the ONNX exporter built on it are not thread-safe (two traces in one process corrupt
# each other's dispatch state): every trace in kiln holds this lock, so callers may use threads.
TRACING = threading.RLock()

SPEC_META_KEY = "kiln_input_spec"
SPEC_EXTRA_FILE = "kiln_input_specs.json"
# Modules that register what the program refers to by name: pytree types of its inputs/outputs (e.g.
# transformers' ModelOutput classes) and custom ops (torch.library). torch.export.load needs them
# imported first, so a program or package loads in a process that never imported the model.
MODULES_EXTRA_FILE = "kiln_import_modules.json"


def export(
    model: torch.nn.Module,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    strict: bool = False,
) -> ExportedProgram:
    """``torch.export.export`` plus input specs (names, dtypes, min/opt/max, named dims), attached once.

    ``opt`` is the example input's shape; ``min``/``max`` come from the ``Dim`` ranges in
    ``dynamic_shapes``; dimension names are the ``Dim`` names.
    """
    kwargs = dict(kwargs or {})
    try:
        with TRACING:
            program = torch.export.export(
                model, tuple(args), kwargs, dynamic_shapes=dynamic_shapes, strict=strict
            )
    except Exception as exc:  # torch raises many types here; the user needs one with the cause
        raise ExportError(
            f"torch.export could not trace {type(model).__name__}: {type(exc).__name__}: {exc}".strip()[:4000]
        ) from exc
    dim_names = _dim_names(model, args, kwargs, dynamic_shapes)
    specs = _specs_from_program(program, dim_names, require_bounded=True)
    attach_specs(program, specs)
    return program


def attach_specs(program: ExportedProgram, specs: Sequence[InputSpec]) -> None:
    """Attach specs to the program's user-input placeholders (in place)."""
    placeholders = _user_input_nodes(program)
    if len(placeholders) != len(specs):
        raise InputSpecError(f"program has {len(placeholders)} user inputs but {len(specs)} specs were given")
    for node, spec in zip(placeholders, specs, strict=True):
        node.meta.setdefault("custom", {})[SPEC_META_KEY] = json.dumps(spec.to_dict(), sort_keys=True)


def input_specs(program: ExportedProgram) -> tuple[InputSpec, ...]:
    """The program's specs: attached ones, else derived from its range constraints (bounded only)."""
    placeholders = _user_input_nodes(program)
    attached = [n.meta.get("custom", {}).get(SPEC_META_KEY) for n in placeholders]
    if placeholders and all(attached):
        return tuple(InputSpec.from_dict(json.loads(text)) for text in attached)
    return _specs_from_program(program, {}, require_bounded=True)


def save_program(program: ExportedProgram, path: str | os.PathLike) -> Path:
    """``torch.export.save`` with the specs as an extra file; written atomically."""
    specs = input_specs(program)
    path = Path(path)
    extra = {SPEC_EXTRA_FILE: specs_to_json(specs), MODULES_EXTRA_FILE: json.dumps(import_modules(program))}
    with atomic_write(path) as tmp:
        torch.export.save(program, tmp, extra_files=extra)
    return path


def import_modules(program: ExportedProgram) -> list[str]:
    """Modules defining the program's non-builtin container types and custom ops."""
    modules: set[str] = set()
    for node in program.graph.nodes:
        target = node.target
        custom = isinstance(target, torch._ops.OpOverload) and target.namespace not in ("aten", "prims")
        if node.op == "call_function" and custom:
            definition = torch._library.custom_ops.OPDEFS.get(f"{target.namespace}::{target._opname}")
            function = getattr(definition, "_init_fn", None)
            if function is not None and function.__module__ != "__main__":
                modules.add(function.__module__)

    def walk(spec: Any) -> None:
        kind = getattr(spec, "type", None)
        if kind is not None and kind.__module__ not in (
            "builtins",
            "collections",
            "torch.fx.immutable_collections",
        ):
            modules.add(kind.__module__)
        for child in spec.children() if hasattr(spec, "children") else ():
            walk(child)

    for spec in (program.call_spec.in_spec, program.call_spec.out_spec):
        if spec is not None:
            walk(spec)
    return sorted(modules)


def _import_modules(path: str | os.PathLike) -> None:
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith(MODULES_EXTRA_FILE)]
            modules = json.loads(archive.read(names[0])) if names else []
    except (OSError, zipfile.BadZipFile, ValueError):
        return  # not ours to judge here: torch.export.load reports unreadable archives
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ExportError(
                f"{path} uses types or ops from {module!r}, which cannot be imported here: {exc}; install it"
            ) from exc


def load_program(path: str | os.PathLike) -> ExportedProgram:
    """``torch.export.load``; re-attaches specs saved by :func:`save_program` (plain archives derive them)."""
    extra = {SPEC_EXTRA_FILE: "", MODULES_EXTRA_FILE: ""}
    _import_modules(path)
    try:
        program = torch.export.load(os.fspath(path), extra_files=extra)
    except FileNotFoundError:
        raise
    except Exception as exc:
        raise ExportError(f"{path} is not a loadable torch.export archive: {exc}") from exc
    if extra[SPEC_EXTRA_FILE]:
        attach_specs(program, specs_from_json(extra[SPEC_EXTRA_FILE]))
    return program


def _user_input_nodes(program: ExportedProgram) -> list[torch.fx.Node]:
    names = set(program.graph_signature.user_inputs)
    return [n for n in program.graph.nodes if n.op == "placeholder" and n.name in names]


def _dim_names(
    model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any
) -> dict[tuple[str, int], str]:
    """(input name, axis) -> Dim name, read from the user's ``dynamic_shapes``."""
    if dynamic_shapes is None:
        return {}
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
        order = list(bound.arguments)
    except (TypeError, ValueError):
        order = [f"arg{i}" for i in range(len(args))] + list(kwargs)
    if isinstance(dynamic_shapes, Mapping):
        per_input = dict(dynamic_shapes)
    else:
        per_input = dict(zip(order, dynamic_shapes, strict=False))
    names: dict[tuple[str, int], str] = {}
    for input_name, axes in per_input.items():
        items = axes.items() if isinstance(axes, Mapping) else enumerate(axes or ())
        for axis, dim in items:
            dim_name = getattr(dim, "__name__", None)
            if dim_name and dim_name not in ("AUTO", "STATIC", "DYNAMIC"):
                names[(input_name, int(axis))] = dim_name
    return names


def _specs_from_program(
    program: ExportedProgram, dim_names: dict[tuple[str, int], str], *, require_bounded: bool
) -> tuple[InputSpec, ...]:
    ranges = program.range_constraints
    examples = _example_values(program)
    symbol_names: dict[sympy.Symbol, str] = {}
    specs = []
    for index, node in enumerate(_user_input_nodes(program)):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise InputSpecError(
                f"input {node.name!r} is a {type(val).__name__}, not a tensor; "
                "kiln compiles tensor inputs only"
            )
        example = examples[index] if examples is not None else None
        lo, opt, hi, dyn = [], [], [], {}
        for axis, size in enumerate(val.shape):
            if isinstance(size, int) or not isinstance(size, torch.SymInt) or size.node.expr.is_number:
                value = int(size)
                lo.append(value), opt.append(value), hi.append(value)
                continue
            expr = size.node.expr
            low, high = _expr_range(expr, ranges)
            if require_bounded and (high is None or low is None):
                raise InputSpecError(
                    f"input {node.name!r} axis {axis} ({expr}) has an unbounded range; export with "
                    f"torch.export.Dim(name, min=..., max=...) so engines get a finite profile"
                )
            for sym in expr.free_symbols:
                symbol_names.setdefault(sym, dim_names.get((node.name, axis), str(sym)))
            dyn[axis] = symbol_names[expr] if expr in symbol_names else str(expr)
            guess = int(example.shape[axis]) if isinstance(example, torch.Tensor) else high
            lo.append(low), hi.append(high), opt.append(min(max(guess, low), high))
        values = None
        if isinstance(example, torch.Tensor) and not example.is_floating_point() and example.numel():
            values = (float(example.min()), float(example.max()))
        specs.append(
            InputSpec(node.name, dtype_name(val.dtype), tuple(lo), tuple(opt), tuple(hi), dyn, values)
        )
    return tuple(specs)


def _expr_range(expr: sympy.Expr, ranges: Mapping) -> tuple[int | None, int | None]:
    """Integer bounds of a shape expression from the program's per-symbol ranges (monotone exprs)."""

    def bound(which: str) -> int | None:
        subs = {}
        for sym in expr.free_symbols:
            vr = ranges.get(sym)
            value = None if vr is None else getattr(vr, which)
            if value is None or not getattr(value, "is_finite", True) or abs(float(value)) > 2**62:
                return None
            subs[sym] = int(value)
        return int(expr.subs(subs))

    return bound("lower"), bound("upper")


def _example_values(program: ExportedProgram) -> list | None:
    example = getattr(program, "example_inputs", None)
    if not example:
        return None
    flat, _ = torch.utils._pytree.tree_flatten(example)
    return flat if len(flat) == len(program.graph_signature.user_inputs) else None
