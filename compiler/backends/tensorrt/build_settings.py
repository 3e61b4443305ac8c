"""What a TensorRT build sets, derived from kiln's build settings and engine IO: the optimization
profiles, the refit mode and the builder flags; and which profile a call's shapes run under.

Guarantees: pure functions of :class:`BuildSettings` / :class:`EngineIO` (no TensorRT, no GPU), so a
settings mistake is a :class:`BuildSettingsError` or :class:`InputSpecError` before any build starts
(``on_build_failure`` never turns those into a fallback), and the same settings always give the
same flags in the same order.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from compiler.backends.base import BuildSettings, EngineIO, check_backend_options
from compiler.errors import BuildSettingsError, InputSpecError

REFIT_MODES = ("weights", "all", "identical", "none")
BACKEND_OPTIONS = frozenset({"refit"})  # the keys of CompileOptions.backend_options TensorRT reads
# Optimization profiles an engine is built with: the declared range's and at most this many more.
MAX_SHAPE_PROFILES = 16

Bounds = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def optimization_profile(io: EngineIO) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """The one optimization profile (min, opt, max per input) an engine is built with."""
    shapes: dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]] = {}
    for spec in io.inputs:
        if spec.name in shapes:
            raise InputSpecError(f"engine input {spec.name!r} is listed twice; input names must be unique")
        lo, opt, hi = tuple(spec.min_shape), tuple(spec.opt_shape), tuple(spec.max_shape)
        if not len(lo) == len(opt) == len(hi):
            raise InputSpecError(f"input {spec.name!r}: min/opt/max ranks differ: {lo}, {opt}, {hi}")
        for axis, (a, b, c) in enumerate(zip(lo, opt, hi, strict=True)):
            if not 0 <= a <= b <= c:
                raise InputSpecError(
                    f"input {spec.name!r} axis {axis}: an optimization profile needs 0 <= min <= opt <= max, "
                    f"got min={a} opt={b} max={c}"
                )
        shapes[spec.name] = (lo, opt, hi)
    return shapes


def optimization_profiles(io: EngineIO, settings: BuildSettings) -> list[dict[str, Bounds]]:
    """Every optimization profile the engine is built with: the declared range first (every shape the
    model takes runs), then one per shape profile that names a dimension of this engine's inputs (a
    size: min = opt = max; a range: its bounds; dimensions it leaves out at their opt size), in order,
    without repeats. A profile over a derived dimension (``batch*seq``) does not apply to the engine."""
    declared = optimization_profile(io)
    result = [declared]
    for profile in settings.profiles:
        bounds = _engine_bounds(io, profile, declared)
        if bounds is not None and bounds not in result:
            if len(result) > MAX_SHAPE_PROFILES:
                raise BuildSettingsError(
                    f"more than {MAX_SHAPE_PROFILES} shape profiles apply to one TensorRT engine"
                )
            result.append(bounds)
    return result


def _engine_bounds(
    io: EngineIO, profile: Mapping[str, Any], declared: Mapping[str, Bounds]
) -> dict[str, Bounds] | None:
    bounds, named = {}, False
    for spec in io.inputs:
        point = list(declared[spec.name][1])
        lo, hi = list(point), list(point)
        for axis, name in spec.dynamic_dims.items():
            if not name.isidentifier():
                return None
            if name in profile:
                value = profile[name]
                sizes = (value,) if isinstance(value, int) else tuple(value)
                lo[axis], hi[axis], named = sizes[0], sizes[-1], True
                point[axis] = sizes[1] if len(sizes) == 3 else min(max(point[axis], sizes[0]), sizes[-1])
        bounds[spec.name] = (tuple(lo), tuple(point), tuple(hi))
    return bounds if named else None


def choose_profile(profiles: Sequence[Mapping[str, Bounds]], shapes: Mapping[str, Sequence[int]]) -> int:
    """The index of the narrowest profile whose bounds hold every input's shape (the first on a tie);
    the declared range's (0) where no narrower one does. ValueError where none holds them."""
    best, best_width = None, None
    for index, profile in enumerate(profiles):
        fits = all(
            len(shapes[name]) == len(lo)
            and all(a <= d <= c for a, d, c in zip(lo, shapes[name], hi, strict=True))
            for name, (lo, _opt, hi) in profile.items()
        )
        if fits:
            width = sum(c - a for lo, _opt, hi in profile.values() for a, c in zip(lo, hi, strict=True))
            if best_width is None or width < best_width:
                best, best_width = index, width
    if best is None:
        raise ValueError(f"no optimization profile holds shapes {dict(shapes)}")
    return best


def refit_mode(settings: BuildSettings) -> str:
    """How weights are made refittable: ``weights`` (default: exactly the canonical ``w*`` initializers),
    ``all`` (every weight, BuilderFlag.REFIT), ``identical`` (REFIT_IDENTICAL: only the build's own
    weights may be put back, so the engine must not be shared by instances with other weights) or
    ``none``."""
    check_backend_options(settings, BACKEND_OPTIONS, "TensorRT")
    mode = settings.options.get("refit", "weights")
    if mode not in REFIT_MODES:
        raise BuildSettingsError(f"settings.options['refit'] is {mode!r}; expected one of {REFIT_MODES}")
    if settings.strip_weights and mode == "none":
        raise BuildSettingsError(
            "strip_weights needs a refittable engine (weights go back in by refit), but options['refit'] "
            "is 'none'; drop one of the two"
        )
    return mode


def builder_flag_names(settings: BuildSettings) -> tuple[str, ...]:
    """BuilderFlag members a build sets for these settings, in a stable order.

    Stripped engines use STRIP_PLAN with REFIT_INDIVIDUAL, not REFIT_IDENTICAL: one engine serves
    every dedup instance and cache user of its fingerprint, each with other weights, and
    REFIT_IDENTICAL lets the builder assume the build's own values (it was 1.1% of an MLP's full
    size against 1.6%, on the H100; not worth wrong results)."""
    mode = refit_mode(settings)
    flags = {"weights": ["REFIT_INDIVIDUAL"], "all": ["REFIT"], "identical": ["REFIT_IDENTICAL"], "none": []}[
        mode
    ]
    if settings.strip_weights:
        flags.append("STRIP_PLAN")
    return tuple(flags)
