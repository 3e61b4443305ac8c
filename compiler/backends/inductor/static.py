"""Inductor engines' static-shape specializations (one per shape profile): which activation shapes a
profile gives an engine, their compile at build, the header's list checked before use, and the names
and keys they are kept under. Their load is :mod:`compiler.backends.inductor.backend`'s."""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from compiler.backends.base import BuildSettings, EngineIO
from compiler.backends.inductor.memo import recall, remember
from compiler.errors import UnsafeEngineError

# Specializations an engine may list: an untrusted load compiles each, so a header cannot ask for more.
MAX_SPECIALIZATIONS = 32


def engine_profile_shapes(
    engine_io: EngineIO, profile: Mapping[str, int]
) -> tuple[tuple[int, ...], ...] | None:
    """The engine's activation shapes under a shape profile (dimensions it leaves out at their opt
    size); None where the profile does not apply: it names none of the engine's dimensions, or an
    input has a derived dynamic size (``batch*seq``) that only the dynamic graph knows how to follow."""
    shapes, named = [], False
    for spec in engine_io.inputs:
        shape = list(spec.opt_shape)
        for axis, name in spec.dynamic_dims.items():
            if not name.isidentifier():
                return None
            if name in profile:
                shape[axis], named = int(profile[name]), True
        shapes.append(tuple(shape))
    return tuple(shapes) if named else None


def specializations(header: Mapping[str, Any], engine_io: EngineIO) -> list[tuple[tuple[int, ...], ...]]:
    """The header's specialization shapes, checked before use: at most MAX_SPECIALIZATIONS, one shape
    per activation input, each inside that input's range (an untrusted engine compiles every one)."""
    listed = header.get("specializations") or []
    if not isinstance(listed, list) or len(listed) > MAX_SPECIALIZATIONS:
        raise UnsafeEngineError(
            f"Inductor engine header field 'specializations': expected a list of at most "
            f"{MAX_SPECIALIZATIONS} shape sets"
        )
    result = []
    for entry in listed:
        ok = isinstance(entry, list) and len(entry) == len(engine_io.inputs)
        for shape, spec in zip(entry if ok else (), engine_io.inputs, strict=False):
            ok = ok and (
                isinstance(shape, list)
                and len(shape) == len(spec.min_shape)
                and all(
                    isinstance(d, int) and not isinstance(d, bool) and lo <= d <= hi
                    for d, lo, hi in zip(shape, spec.min_shape, spec.max_shape, strict=True)
                )
            )
        if not ok:
            raise UnsafeEngineError(
                f"Inductor engine header field 'specializations': {str(entry)[:200]} is not one shape per "
                "activation input inside its range"
            )
        result.append(tuple(tuple(shape) for shape in entry))
    return result


def static_key(key: str, shapes: tuple[tuple[int, ...], ...]) -> str:
    return hashlib.sha256(f"{key}/static/{json.dumps([list(s) for s in shapes])}".encode()).hexdigest()


def build_specializations(
    graph: Any,
    io: EngineIO,
    settings: BuildSettings,
    options: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    key: str,
    partition: str | None,
) -> dict[tuple[tuple[int, ...], ...], bytes]:
    """Activation shapes -> saved static-shape compile of ``graph`` (an ``inductor_graph.ProgramGraph``),
    one per distinct profile shape of this engine. A failed specialization is warned and left out: the
    dynamic graph serves its shapes."""
    # Here, not at the top: inductor_graph reads the engine format, which names these entries.
    from compiler.backends.inductor.graph import save_artifact, short_error

    built: dict[tuple[tuple[int, ...], ...], bytes] = {}
    for profile in settings.profiles:
        if not all(isinstance(v, int) for v in profile.values()):
            continue  # a range: the dynamic graph serves it
        shapes = engine_profile_shapes(io, profile)
        if shapes is None or shapes in built:
            continue
        if len(built) == MAX_SPECIALIZATIONS:  # what a load accepts
            warnings.warn(f"Inductor: {MAX_SPECIALIZATIONS} specializations at most", stacklevel=3)
            break
        shape_key = static_key(key, shapes)
        artifact = recall(shape_key)[1]
        if artifact is None:
            try:
                compiled = graph.compile_static(shapes, io, options, tuple(weights.values()))
                artifact = save_artifact(compiled)
            except Exception as exc:
                warnings.warn(
                    f"Inductor: no static specialization of partition {partition or '?'} for profile "
                    f"{dict(profile)}: {short_error(exc)}",
                    stacklevel=3,
                )
                continue
            remember(shape_key, compiled, artifact)
        built[shapes] = artifact
    return built
