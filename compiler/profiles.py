"""Shape profiles: the concrete input shapes a compiled model is known to serve (``batch`` 1, 8, 32).

``CompileOptions.profiles`` holds one mapping per profile, dynamic-dimension name -> size; dimensions a
profile leaves out take their opt size. A profile is checked against the input specs when the model is
partitioned (:func:`profile_shapes`: a dimension no input has, or a size outside an input's declared
range, is an ``InputSpecError`` naming the profile), so a bad profile fails before any build.

What a profile buys today: on CUDA with graphs on, its CUDA graph is captured when the module is
assembled (compile, load, refit), so the first call at that shape replays instead of capturing; the
warm-up is timed (``module.cuda_graphs.warmup_seconds``). Every profile's latency and what served it
(``dispatch``) are measured at compile and recorded in the report (``CompileReport.profiles``), so in
the manifest. With the Inductor backend each engine also gets a static-shape specialization per
profile, run on an exact shape match (:mod:`compiler.backends.inductor`); padding a batch up to a
profile is :mod:`compiler.padding`. Not built yet: TensorRT optimization profiles per range, ranges.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from compiler.errors import InputSpecError
from compiler.specs import InputSpec

if TYPE_CHECKING:  # CompileOptions normalize profiles here without torch
    import torch


def normalize(profiles: object) -> tuple[dict[str, int], ...]:
    """Profiles as a tuple of {dim name: size}; InputSpecError for anything else."""
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
        sizes = {}
        for name, size in profile.items():
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise InputSpecError(
                    f"profile {index} {dict(profile)}: dimension {name!r} must be an integer >= 1, got "
                    f"{size!r} (ranges are not supported yet: list each size as its own profile)"
                )
            sizes[str(name)] = size
        result.append(dict(sorted(sizes.items())))
    if len({tuple(p.items()) for p in result}) != len(result):
        raise InputSpecError(f"profiles {result} repeat a profile; list each once")
    return tuple(result)


def profile_shapes(specs: Sequence[InputSpec], profile: Mapping[str, int], index: int = 0) -> list[tuple]:
    """Every input's shape under ``profile`` (unnamed dims at their opt size); InputSpecError naming the
    profile for a dimension no input has or a size outside an input's range."""
    dims = {name for spec in specs for name in spec.dynamic_dims.values()}
    unknown = sorted(set(profile) - dims)
    if unknown:
        raise InputSpecError(
            f"profile {index} {dict(profile)}: names dimensions {unknown} that no input has; the dynamic "
            f"dimensions are {sorted(dims)}"
        )
    shapes = []
    for spec in specs:
        shape = list(spec.opt_shape)
        for axis, name in spec.dynamic_dims.items():
            if name in profile:
                lo, hi = spec.dim_range(axis)
                if not lo <= profile[name] <= hi:
                    raise InputSpecError(
                        f"profile {index} {dict(profile)}: {name} = {profile[name]} is outside input "
                        f"{spec.name!r}'s declared range [{lo}, {hi}]"
                    )
                shape[axis] = profile[name]
        shapes.append(tuple(shape))
    return shapes


def check_profiles(specs: Sequence[InputSpec], profiles: Sequence[Mapping[str, int]]) -> None:
    for index, profile in enumerate(profiles):
        profile_shapes(specs, profile, index)


def profile_inputs(
    specs: Sequence[InputSpec], profile: Mapping[str, int], device: torch.device, seed: int = 0
) -> list[torch.Tensor]:
    """Random inputs at the profile's shapes (integer inputs inside their recorded value range)."""
    import torch

    from compiler.validation_data import random_tensor

    generator = torch.Generator().manual_seed(seed)
    return [
        random_tensor(spec, list(shape), generator).to(device)
        for spec, shape in zip(specs, profile_shapes(specs, profile), strict=True)
    ]


def to_json(profiles: Sequence[Mapping[str, int]]) -> list[dict[str, Any]]:
    return [dict(p) for p in profiles]
