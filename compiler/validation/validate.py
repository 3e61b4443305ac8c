"""Validate: accuracy of the compiled module against eager, and latency of both, side by side.

The one validation policy of kiln lives here: :class:`Tolerances` (what is gated, ``None`` = not
gated), :meth:`ValidationReport.failures` (the reasons a report fails them; empty = pass) and
:func:`measure_latency` (the one latency measurement, interleaved). Tasks, registry and release call
these; none decides pass/fail on its own. The first two are plain data in
:mod:`compiler.validation.report` (read without torch), re-exported here.

Inputs are drawn fresh inside the spec ranges (the minimum, the maximum and random points between,
with one value per dimension name so inputs that share ``batch`` agree). Every output leaf is
compared: max abs error, relative L2 error, cosine similarity. A non-finite value where the other side
has a different one (fp16 overflow: ``inf``, then ``nan`` after a normalisation) is an infinite error,
never a silent pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence

import torch
from torch.utils import _pytree as pytree

from compiler.inputs.data import ValidationData, held_out, sample_inputs, validation_data
from compiler.program.tracing import TRACING
from compiler.validation.report import (
    Latency,
    OutputAccuracy,
    ValidationReport,
    nan_as_worst,
)

__all__ = [
    "compare",
    "compare_tensors",
    "measure_accuracy",
    "measure_latency",
    "top1_agreement",
    "validate",
]


def compare_tensors(name: str, ref: torch.Tensor, act: torch.Tensor) -> OutputAccuracy:
    """Max abs, relative L2, cosine and (where it applies) top-1 agreement of one output pair."""
    ref64, act64 = ref.detach().double().flatten(), act.detach().double().flatten()
    agreement = top1_agreement(ref, act)
    # Where the two differ in a non-finite way (fp16 overflow gives inf, a norm after it nan), the
    # error is infinite; plain arithmetic would give nan, and nan compares false against any limit.
    same = (ref64 == act64) | (ref64.isnan() & act64.isnan())
    broken = ~(ref64.isfinite() & act64.isfinite()) & ~same
    if bool(broken.any()):
        return OutputAccuracy(name, math.inf, math.inf, math.nan, agreement)
    finite = ref64.isfinite()
    ref64, act64 = ref64[finite], act64[finite]
    diff = (ref64 - act64).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    norm = float(ref64.norm())
    rel = float((ref64 - act64).norm()) / norm if norm else max_abs
    cosine = float(torch.nn.functional.cosine_similarity(ref64, act64, dim=0)) if ref64.numel() else 1.0
    if not norm and not float(act64.norm()):
        cosine = 1.0
    return OutputAccuracy(name, max_abs, rel, cosine, agreement)


def top1_agreement(ref: torch.Tensor, act: torch.Tensor) -> float | None:
    """Share of positions whose argmax over the last axis agrees: classification logits ``[batch,
    classes]`` or per-token logits ``[batch, seq, vocab]``. None for outputs without a class axis."""
    counts = _top1_counts(ref, act)
    return counts[0] / counts[1] if counts else None


def _top1_counts(ref: torch.Tensor, act: torch.Tensor) -> tuple[int, int] | None:
    if not ref.is_floating_point() or ref.dim() < 2 or ref.shape[-1] < 2 or ref.numel() == 0:
        return None
    act = act.detach().float()
    # A position with nan in the compiled logits never agrees (argmax would pick the nan).
    agree = (ref.detach().float().argmax(-1) == act.argmax(-1)) & ~act.isnan().any(-1)
    return int(agree.sum()), agree.numel()


def compare(reference: object, actual: object) -> list[OutputAccuracy]:
    ref_leaves, _ = pytree.tree_flatten(reference)
    act_leaves, _ = pytree.tree_flatten(actual)
    if len(ref_leaves) != len(act_leaves):
        raise ValueError(f"compiled module returned {len(act_leaves)} outputs, eager {len(ref_leaves)}")
    return [
        compare_tensors(f"output_{index}", ref, act)
        for index, (ref, act) in enumerate(zip(ref_leaves, act_leaves, strict=True))
        if isinstance(ref, torch.Tensor)
    ]


class _Worst:
    """Per output, over samples: the largest abs and relative errors, the smallest cosine, and top-1
    agreement pooled over every position of every sample (a share of all positions, not a per-sample
    minimum: one flipped sample of batch 1 is not zero agreement)."""

    def __init__(self) -> None:
        self.rows: dict[str, OutputAccuracy] = {}
        self.agree: dict[str, list[int]] = {}

    def add(self, reference: object, actual: object) -> None:
        ref_leaves, _ = pytree.tree_flatten(reference)
        act_leaves, _ = pytree.tree_flatten(actual)
        if len(ref_leaves) != len(act_leaves):
            raise ValueError(f"compiled module returned {len(act_leaves)} outputs, eager {len(ref_leaves)}")
        for index, (ref, act) in enumerate(zip(ref_leaves, act_leaves, strict=True)):
            if not isinstance(ref, torch.Tensor):
                continue
            row = compare_tensors(f"output_{index}", ref, act)
            counts = _top1_counts(ref, act)
            if counts is not None:
                pooled = self.agree.setdefault(row.output, [0, 0])
                pooled[0], pooled[1] = pooled[0] + counts[0], pooled[1] + counts[1]
            prior = self.rows.get(row.output)
            if prior is not None:
                row = OutputAccuracy(
                    row.output,
                    max(prior.max_abs, row.max_abs, key=nan_as_worst),
                    max(prior.rel_l2, row.rel_l2, key=nan_as_worst),
                    _lowest(prior.cosine, row.cosine),
                )
            self.rows[row.output] = row

    def result(self) -> list[OutputAccuracy]:
        return [
            dataclasses.replace(row, top1_agreement=_share(self.agree.get(name)))
            for name, row in self.rows.items()
        ]


def _lowest(a: float, b: float) -> float:
    return math.nan if math.isnan(a) or math.isnan(b) else min(a, b)


def _share(counts: list[int] | None) -> float | None:
    return counts[0] / counts[1] if counts and counts[1] else None


def measure_accuracy(
    original: torch.nn.Module, compiled: torch.nn.Module, samples: Sequence[Sequence[torch.Tensor]]
) -> list[OutputAccuracy]:
    """Per output, the worst error of ``compiled`` vs ``original`` over the samples (flat user inputs,
    in spec order) and the pooled top-1 agreement."""
    worst = _Worst()
    device = _device(compiled)
    with _eager_lock(compiled), torch.no_grad():
        for flat in samples:
            args, kwargs = _unflatten(compiled, [t.to(device) for t in flat])
            worst.add(original(*args, **kwargs), compiled(*args, **kwargs))
    return worst.result()


def _eager_lock(compiled: torch.nn.Module) -> contextlib.AbstractContextManager:
    # The user's eager model calls the ops its compiled module calls: where those are custom ops, it
    # must not overlap another thread's export either (compiler.program.tracing.custom_op_lock). A module kiln
    # did not compile is not known: held.
    return getattr(compiled, "trace_lock", TRACING)


def _synchronize() -> None:
    # Work queued on a GPU would otherwise be timed when the next call waits for it.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def measure_latency(fns: Mapping[str, Callable[[], object]], *, warmup: int, runs: int) -> dict[str, Latency]:
    """Median and p95 latency of each callable, in milliseconds: the one latency measurement of kiln.

    The callables are interleaved (one call of each per round, the order rotating every round), so
    machine noise and cache warmth hit all alike; comparing two measured separately compares moments.
    """
    if runs < 1 or warmup < 0:
        raise ValueError(f"measure_latency needs runs >= 1 and warmup >= 0, got runs={runs} warmup={warmup}")
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    _synchronize()
    times: dict[str, list[float]] = {name: [] for name in names}
    for round_ in range(runs):
        shift = round_ % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            fns[name]()
            _synchronize()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: Latency.of(values) for name, values in times.items()}


def validate(
    original: torch.nn.Module,
    compiled: torch.nn.Module,
    *,
    data: str | os.PathLike | Mapping[str, object] | ValidationData | None = None,
    samples: int = 3,
    warmup: int = 3,
    runs: int = 20,
    seed: int = 0,
) -> ValidationReport:
    """Accuracy on ``data`` (recorded inputs: a ``.safetensors``/``.npz`` file or a mapping, see
    :mod:`compiler.validation_data`), else on ``samples`` random input sets (min, max, random...);
    latency of both at the opt shapes. The report says which data was used and which recorded samples
    were skipped (outside the compiled ranges)."""
    specs = compiled.input_specs
    dataset = validation_inputs(compiled, data, samples=samples, seed=seed)
    outputs = measure_accuracy(original, compiled, dataset.samples)
    generator = torch.Generator().manual_seed(seed)
    device = _device(compiled)
    args, kwargs = _unflatten(compiled, [t.to(device) for t in sample_inputs(specs, "opt", generator)])
    with _eager_lock(compiled), torch.no_grad():  # held once: no call is timed waiting on a thread
        latency = measure_latency(
            {"eager": lambda: original(*args, **kwargs), "compiled": lambda: compiled(*args, **kwargs)},
            warmup=warmup,
            runs=runs,
        )
    precision = getattr(getattr(compiled, "report", None), "precision", "fp32")
    return ValidationReport(
        outputs,
        [[list(t.shape) for t in flat] for flat in dataset.samples],
        latency["eager"],
        latency["compiled"],
        precision,
        data_source=dataset.source,
        samples=len(dataset),
        skipped=list(dataset.skipped),
    )


def validation_inputs(
    compiled: torch.nn.Module,
    data: str | os.PathLike | Mapping[str, object] | ValidationData | None = None,
    *,
    samples: int = 3,
    seed: int = 0,
) -> ValidationData:
    """The inputs ``compiled`` is validated on: :func:`validation_data`, less every sample it was
    calibrated on (int8 partitions: ``report.quantization.sample_digests``), named in ``skipped``."""
    dataset = validation_data(compiled.input_specs, data, samples=samples, seed=seed)
    record = getattr(getattr(compiled, "plan", None), "quantization", None) or {}
    return held_out(dataset, record.get("sample_digests", ()))


def _device(compiled: torch.nn.Module) -> str:
    options = getattr(getattr(compiled, "plan", None), "options", None)
    return getattr(options, "device", "cpu")


def _unflatten(compiled: torch.nn.Module, flat: list[torch.Tensor]) -> tuple[tuple, dict]:
    in_spec = compiled.plan.signature.in_spec
    args, kwargs = pytree.tree_unflatten(flat, in_spec)
    return tuple(args), dict(kwargs)
