"""What a TensorRT build sets, derived from kiln's build settings and engine IO: the optimization
profile, the refit mode and the builder flags.

Guarantees: pure functions of :class:`BuildSettings` / :class:`EngineIO` (no TensorRT, no GPU), so a
settings mistake is a :class:`BuildSettingsError` or :class:`InputSpecError` before any build starts
(``on_build_failure`` never turns those into a fallback), and the same settings always give the
same flags in the same order.
"""

from __future__ import annotations

from compiler.backends.base import BuildSettings, EngineIO, check_backend_options
from compiler.errors import BuildSettingsError, InputSpecError

REFIT_MODES = ("weights", "all", "identical", "none")
BACKEND_OPTIONS = frozenset({"refit"})  # the keys of CompileOptions.backend_options TensorRT reads


def profile_shapes(io: EngineIO) -> dict[str, tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
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
