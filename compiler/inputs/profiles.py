"""Shape profiles: the input shapes a compiled model is known to serve (``batch`` 1, 8, 32, or 1..8).

``CompileOptions.profiles`` holds one mapping per profile, dynamic-dimension name -> a size or a range
``(min, max)`` / ``(min, opt, max)``; dimensions a profile leaves out take their opt size. A profile is
checked against the input specs when the model is partitioned (:func:`profile_bounds`: a dimension no
input has, or a size outside an input's declared range, is an ``InputSpecError`` naming the profile),
so a bad profile fails before any build.

What a profile buys today: on CUDA with graphs on, its CUDA graph is captured when the module is
assembled (compile, load, refit), so the first call at that shape replays instead of capturing; the
warm-up is timed (``module.cuda_graphs.warmup_seconds``). Every profile's latency and what served it
(``dispatch``) are measured at compile and recorded in the report (``CompileReport.profiles``), so in
the manifest. With the Inductor backend each engine also gets a static-shape specialization per
profile, run on an exact shape match (:mod:`compiler.backends.inductor.backend`); padding a batch up to a
profile is :mod:`compiler.runtime.padding`. Those three take the fixed profiles only (a range has no one shape
to capture, specialize or pad to: its calls run at their own shape); a range is measured at its opt
point. With TensorRT every profile, fixed or range, is one more optimization profile of each engine it
applies to (:mod:`compiler.backends.tensorrt.build_settings`), beside the declared range's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from compiler.errors import InputSpecError
from compiler.inputs.specs import InputSpec

if TYPE_CHECKING:  # CompileOptions normalize profiles here without torch
    import torch

# A profile's value for one dimension: a size, or a range (min, max) / (min, opt, max).
Size = int | tuple[int, ...]


def normalize(profiles: object) -> tuple[dict[str, Size], ...]:
    """Profiles as a tuple of {dim name: size or (min[, opt], max)}; InputSpecError for anything else."""
    if profiles is None:
        return ()
    if isinstance(profiles, Mapping) or not isinstance(profiles, Sequence) or isinstance(profiles, str):
        raise InputSpecError(
            f"profiles must be a list of {{dimension name: size}} mappings, e.g. [{{'batch': 1}}, "
            f"{{'batch': 8}}], got {profiles!r}"
        )
    result = []
    for index, profile in enumerate(profiles):
        if not isinstance(profile, Mapping) or not profile:
            raise InputSpecError(
                f"profile {index} {profile!r}: expected a non-empty mapping of dimension name to size, "
                "e.g. {'batch': 8}"
            )
        result.append(dict(sorted((str(k), _size(index, profile, k, v)) for k, v in profile.items())))
    if len({tuple(p.items()) for p in result}) != len(result):
        raise InputSpecError(f"profiles {result} repeat a profile; list each once")
    return tuple(result)


def _size(index: int, profile: Mapping, name: object, value: object) -> Size:
    def whole(v: object) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 1

    if whole(value):
        return value  # type: ignore[return-value]
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) in (2, 3):
        bounds = tuple(value)
        if all(whole(v) for v in bounds) and list(bounds) == sorted(bounds):
            return bounds  # type: ignore[return-value]
    raise InputSpecError(
        f"profile {index} {dict(profile)}: dimension {name!r} must be an integer >= 1 or a range "
        f"[min, max] / [min, opt, max] of them in order, got {value!r}"
    )


def is_fixed(profile: Mapping[str, Size]) -> bool:
    """Whether every dimension the profile names has one size (no range)."""
    return all(isinstance(v, int) for v in profile.values())


def fixed_profiles(profiles: Sequence[Mapping[str, Size]]) -> list[Mapping[str, int]]:
    """The profiles that are concrete shapes: what CUDA graphs, static specializations and padding use."""
    return [p for p in profiles if is_fixed(p)]  # type: ignore[misc]


def profile_bounds(
    specs: Sequence[InputSpec], profile: Mapping[str, Size], index: int = 0
) -> list[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]]:
    """Every input's (min, opt, max) shape under ``profile``: a size is min = opt = max, a range its
    bounds (opt: the one given, else the input's own opt clipped into the range); dimensions the profile
    leaves out at their opt size. InputSpecError naming the profile for a dimension no input has or a
    size outside an input's declared range."""
    dims = {name for spec in specs for name in spec.dynamic_dims.values()}
    unknown = sorted(set(profile) - dims)
    if unknown:
        raise InputSpecError(
            f"profile {index} {dict(profile)}: names dimensions {unknown} that no input has; the dynamic "
            f"dimensions are {sorted(dims)}"
        )
    bounds = []
    for spec in specs:
        lo, opt, hi = list(spec.opt_shape), list(spec.opt_shape), list(spec.opt_shape)
        for axis, name in spec.dynamic_dims.items():
            if name not in profile:
                continue
            value = profile[name]
            first, last = (value, value) if isinstance(value, int) else (value[0], value[-1])
            declared_lo, declared_hi = spec.dim_range(axis)
            if not declared_lo <= first <= last <= declared_hi:
                raise InputSpecError(
                    f"profile {index} {dict(profile)}: {name} = {value} is outside input "
                    f"{spec.name!r}'s declared range [{declared_lo}, {declared_hi}]"
                )
            middle = value[1] if isinstance(value, tuple) and len(value) == 3 else opt[axis]
            lo[axis], opt[axis], hi[axis] = first, min(max(middle, first), last), last
        bounds.append((tuple(lo), tuple(opt), tuple(hi)))
    return bounds


def profile_shapes(specs: Sequence[InputSpec], profile: Mapping[str, Size], index: int = 0) -> list[tuple]:
    """Every input's shape under ``profile`` (a range at its opt point; unnamed dims at their opt size);
    InputSpecError naming the profile for a dimension no input has or a size outside an input's range."""
    return [opt for _, opt, _ in profile_bounds(specs, profile, index)]


def check_profiles(specs: Sequence[InputSpec], profiles: Sequence[Mapping[str, Size]]) -> None:
    for index, profile in enumerate(profiles):
        profile_bounds(specs, profile, index)


def profile_inputs(
    specs: Sequence[InputSpec], profile: Mapping[str, Size], device: torch.device, seed: int = 0
) -> list[torch.Tensor]:
    """Random inputs at the profile's shapes (a range's opt point; integer inputs inside their recorded
    value range)."""
    import torch

    from compiler.inputs.data import random_tensor

    generator = torch.Generator().manual_seed(seed)
    return [
        random_tensor(spec, list(shape), generator).to(device)
        for spec, shape in zip(specs, profile_shapes(specs, profile), strict=True)
    ]


def to_json(profiles: Sequence[Mapping[str, Size]]) -> list[dict[str, Any]]:
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in p.items()} for p in profiles]
