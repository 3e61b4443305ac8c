"""Padding a dynamic batch up to a shape profile (``CompileOptions.pad_to_profile``).

With ``"auto"``, a call whose batch is not a profile's but fits under one (same sizes in every other
dimension the profile names) is padded up to the smallest such profile, run there (its static
specialization, its CUDA graph) and its outputs cut back to the real rows. Only where the compile-time
check allowed it: for each profile, batches just below it (the largest and the smallest that would pad
to it) are run on seeded inputs drawn as validation draws them, once as they are and once padded
(copies of the last real row), and the real rows' outputs must agree within the tolerance; every
output must carry the batch on axis 0. A model that mixes rows (a batch norm in training, a softmax
over the batch) fails the check, and that profile is refused for padding with the reason, recorded per
profile in the report (``profiles[i]["padding"]``) and so in the manifest; a load pads exactly where
the compile allowed it. ``"off"`` (the default) never pads.

The padded dimension is the batch: the name of the first input's dynamic axis 0, which every input
that has it must carry on axis 0.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from compiler.inputs.profiles import is_fixed, profile_inputs
from compiler.inputs.specs import InputSpec

# Padded rows must leave the real rows' outputs as they were, up to kernel rounding (the padded call
# may run a static specialization, the real one the dynamic graph).
_RTOL = {"float32": 1e-4, "float64": 1e-6}
_LOOSE = 1e-2  # fp16 / bf16 outputs


@dataclass(frozen=True)
class PadTarget:
    """A profile: its batch size, every other dynamic dimension's size under it (named or opt), and
    whether calls may be padded up to it."""

    batch: int
    fixed: tuple[tuple[str, int], ...]
    allowed: bool


def batch_dim(specs: Sequence[InputSpec]) -> str | None:
    """The dimension padding extends: the first input's dynamic axis 0, if every input that has it
    has it on axis 0 only; else None."""
    name = specs[0].dynamic_dims.get(0) if specs else None
    if name is None:
        return None
    for spec in specs:
        axes = [axis for axis, dim in spec.dynamic_dims.items() if dim == name]
        if axes and axes != [0]:
            return None
    return name


def check_padding(
    run: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    specs: Sequence[InputSpec],
    profiles: Sequence[Mapping[str, int]],
    device: torch.device,
) -> list[dict]:
    """Per profile: whether calls may be padded up to it, why, and the batches checked."""
    batch = batch_dim(specs)
    rows = []
    for index, profile in enumerate(profiles):
        if batch is None or batch not in profile or not is_fixed(profile):
            reason = (
                "the inputs have no dynamic batch on axis 0"
                if batch is None
                else f"it does not name the batch dimension {batch!r}"
                if batch not in profile
                else "it is a range: calls inside it run at their own shape"
            )
            rows.append({"allowed": False, "reason": f"profile {index} {dict(profile)}: {reason}"})
            continue
        batches = _batches_below(specs, profiles, index, batch)
        if not batches:
            rows.append(
                {
                    "allowed": False,
                    "reason": f"profile {index} {dict(profile)}: no smaller batch would pad to it",
                }
            )
            continue
        failure = None
        for n in batches:
            failure = _padding_changes_outputs(run, specs, profile, batch, n, device, seed=index)
            if failure is not None:
                break
        rows.append(
            {
                "allowed": failure is None,
                "reason": f"profile {index} {dict(profile)}: {failure}"
                if failure is not None
                else f"batches {batches} padded to {profile[batch]} left the real rows' outputs unchanged",
                "checked_batches": batches,
            }
        )
    return rows


def pad_targets(
    specs: Sequence[InputSpec], profiles: Sequence[Mapping[str, int]], rows: Sequence[Mapping] | None
) -> list[PadTarget]:
    """Every profile naming the batch, smallest batch first, with whether the check allowed padding up
    to it (report rows: ``profiles[i]["padding"]``); empty where none is allowed."""
    batch = batch_dim(specs)
    if batch is None or not rows or not any((r.get("padding") or {}).get("allowed") for r in rows):
        return []
    opt = {name: spec.opt_shape[axis] for spec in specs for axis, name in spec.dynamic_dims.items()}
    targets = [
        PadTarget(
            int(p[batch]),
            tuple(sorted((k, int(p.get(k, v))) for k, v in opt.items() if k != batch)),
            bool((row.get("padding") or {}).get("allowed")),
        )
        for p, row in zip(profiles, rows, strict=False)
        if batch in p and is_fixed(p)
    ]
    return sorted(targets, key=lambda t: t.batch)


def pad_call(
    flat: list[torch.Tensor], specs: Sequence[InputSpec], targets: Sequence[PadTarget]
) -> tuple[list[torch.Tensor], int] | None:
    """The inputs padded up to the smallest target that fits them, and the real batch; None where no
    target fits (the call runs as it is)."""
    batch = batch_dim(specs)
    sizes = _dim_sizes(specs, flat)
    n = sizes.get(batch)
    fitting = [t for t in targets if all(sizes.get(name) == size for name, size in t.fixed)]
    if n is None or any(t.batch == n for t in fitting):
        return None  # a profile's own shape: it runs as it is
    for target in fitting:
        if target.allowed and target.batch > n:
            padded = [
                _pad_rows(x, target.batch) if 0 in spec.dynamic_dims and spec.dynamic_dims[0] == batch else x
                for spec, x in zip(specs, flat, strict=True)
            ]
            return padded, n
    return None


def _batches_below(
    specs: Sequence[InputSpec], profiles: Sequence[Mapping[str, int]], index: int, batch: str
) -> list[int]:
    """The largest and smallest batch that would pad up to profile ``index``: above the next smaller
    profile with the same other dimensions (or the batch's minimum), below this one."""
    profile = profiles[index]
    others = {k: v for k, v in profile.items() if k != batch}
    lowest = min(
        spec.min_shape[axis] for spec in specs for axis, name in spec.dynamic_dims.items() if name == batch
    )
    below = [
        p[batch]
        for p in profiles
        if batch in p
        and is_fixed(p)
        and p[batch] < profile[batch]
        and {k: v for k, v in p.items() if k != batch} == others
    ]
    first = max([lowest, *(b + 1 for b in below)])
    last = profile[batch] - 1
    return sorted({first, last}) if first <= last else []


def _padding_changes_outputs(
    run: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    specs: Sequence[InputSpec],
    profile: Mapping[str, int],
    batch: str,
    n: int,
    device: torch.device,
    seed: int,
) -> str | None:
    """Why padding a batch of ``n`` up to the profile changes the real rows' outputs; None if not."""
    real = profile_inputs(specs, {**profile, batch: n}, device, seed=seed)
    padded = [
        _pad_rows(x, profile[batch]) if spec.dynamic_dims.get(0) == batch else x
        for spec, x in zip(specs, real, strict=True)
    ]
    with torch.no_grad():
        expected, got = run(real), run(padded)
    for position, (want, have) in enumerate(zip(expected, got, strict=True)):
        if have.dim() == 0 or have.shape[0] != profile[batch] or want.shape[0] != n:
            return f"output {position} does not carry the batch on axis 0 (shape {tuple(have.shape)})"
        have = have[:n]
        tolerance = _RTOL.get(str(want.dtype).removeprefix("torch."), _LOOSE)
        if want.dtype.is_floating_point:
            close = torch.allclose(have.float(), want.float(), rtol=tolerance, atol=tolerance, equal_nan=True)
        else:
            close = torch.equal(have, want)
        if not close:
            worst = (have.float() - want.float()).abs().max().item()
            return (
                f"padding a batch of {n} to {profile[batch]} changes output {position} of the real rows "
                f"(max abs difference {worst:.3g}): the model mixes rows"
            )
    return None


def _pad_rows(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x`` with copies of its last row appended up to ``size`` rows (always a valid input row)."""
    return torch.cat([x, x[-1:].expand(size - x.shape[0], *x.shape[1:])])


def _dim_sizes(specs: Sequence[InputSpec], flat: Sequence[torch.Tensor]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for spec, x in zip(specs, flat, strict=False):
        for axis, name in spec.dynamic_dims.items():
            sizes.setdefault(name, int(x.shape[axis]))
    return sizes
