"""Validate: accuracy of the compiled module against eager, and latency of both, side by side.

The one validation policy of kiln lives here: :class:`Tolerances` (what is gated, ``None`` = not
gated), :meth:`ValidationReport.failures` (the reasons a report fails them; empty = pass) and
:func:`measure_latency` (the one latency measurement, interleaved). Tasks, registry and release call
these; none decides pass/fail on its own.

Inputs are drawn fresh inside the spec ranges (the minimum, the maximum and random points between,
with one value per dimension name so inputs that share ``batch`` agree). Every output leaf is
compared: max abs error, relative L2 error, cosine similarity. A non-finite value where the other side
has a different one (fp16 overflow: ``inf``, then ``nan`` after a normalisation) is an infinite error,
never a silent pass.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree

from compiler.errors import ToleranceError
from compiler.validation_data import ValidationData, held_out, sample_inputs, validation_data

__all__ = [
    "DEFAULT_REL_L2",
    "Latency",
    "OutputAccuracy",
    "Tolerances",
    "ValidationReport",
    "compare",
    "compare_tensors",
    "measure_accuracy",
    "measure_latency",
    "sample_inputs",  # re-exported: callers drew inputs from here before validation_data existed
    "top1_agreement",
    "validate",
]

# Accuracy tolerance (relative L2 vs eager) per precision, when a caller sets none. The one copy.
# int8: static QDQ BERT-base measured cosine 0.9976 (rel L2 ~0.07) against fp32 (issue 19).
DEFAULT_REL_L2 = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 5e-2, "int8": 1e-1}


@dataclass(frozen=True)
class Tolerances:
    """What a validation report must meet. ``None``: that metric is not gated.

    ``rel_l2``: max relative L2 error of any output vs eager. ``max_abs``: max absolute error of any
    output. ``min_cosine``: min cosine similarity of any output. ``max_latency_ratio``: max
    compiled/eager median latency. ``min_top1_agreement``: min share of argmax agreements (last axis)
    of any output that has them (floating outputs of rank >= 2 with a last axis of at least 2: class
    logits, or per-token logits of ``[batch, seq, vocab]``).

    ``failures`` gates exactly what is set; :meth:`resolved` fills ``rel_l2`` from the precision's
    default, which is what a compile or a release is held to when its user sets none.
    """

    rel_l2: float | None = None
    max_abs: float | None = None
    min_cosine: float | None = None
    max_latency_ratio: float | None = None
    min_top1_agreement: float | None = None

    def __post_init__(self) -> None:
        bounds = {
            "rel_l2": (0.0, math.inf),
            "max_abs": (0.0, math.inf),
            "min_cosine": (-1.0, 1.0),
            "max_latency_ratio": (0.0, math.inf),
            "min_top1_agreement": (0.0, 1.0),
        }
        for name, (lo, hi) in bounds.items():
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise ToleranceError(f"tolerances.{name} must be a number or null, got {value!r}")
            if not lo <= value <= hi or (name == "max_latency_ratio" and value == 0):
                raise ToleranceError(f"tolerances.{name} must lie in [{lo:g}, {hi:g}], got {value!r}")
            object.__setattr__(self, name, float(value))

    @classmethod
    def names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def for_precision(cls, precision: str) -> Tolerances:
        """The defaults of a precision: its relative L2 tolerance; nothing else gated."""
        if precision not in DEFAULT_REL_L2:
            raise ToleranceError(
                f"no default tolerance for precision {precision!r}; expected one of {sorted(DEFAULT_REL_L2)}"
            )
        return cls(rel_l2=DEFAULT_REL_L2[precision])

    def resolved(self, precision: str) -> Tolerances:
        """These tolerances with an unset ``rel_l2`` taken from ``precision``'s default."""
        if self.rel_l2 is not None:
            return self
        return dataclasses.replace(self, rel_l2=Tolerances.for_precision(precision).rel_l2)

    def to_dict(self) -> dict[str, float | None]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Tolerances:
        """Tolerances from a mapping; a name that is not a tolerance is refused (a typo gates nothing)."""
        data = dict(data or {})
        unknown = sorted(set(data) - set(cls.names()))
        if unknown:
            raise ToleranceError(f"unknown tolerance name(s) {unknown}; expected some of {list(cls.names())}")
        return cls(**data)


@dataclass
class OutputAccuracy:
    output: str
    max_abs: float
    rel_l2: float
    cosine: float
    # Share of positions (samples, or samples x tokens) whose argmax over the last axis agrees with
    # eager; None where the output has no such axis (see Tolerances.min_top1_agreement).
    top1_agreement: float | None = None


@dataclass
class Latency:
    median_ms: float
    p95_ms: float
    runs: int

    @classmethod
    def of(cls, times_ms: Sequence[float]) -> Latency:
        ordered = sorted(times_ms)
        p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
        return cls(statistics.median(ordered), p95, len(ordered))


@dataclass
class ValidationReport:
    outputs: list[OutputAccuracy]
    shapes: list[list[list[int]]]
    eager: Latency
    compiled: Latency
    precision: str = "fp32"
    extras: dict = field(default_factory=dict)
    # Which inputs accuracy was measured on: "random" (drawn inside the spec ranges) or
    # "<path> sha256:<hex>" for recorded data; samples: how many sets were compared.
    data_source: str = "random"
    samples: int = 0
    # Recorded samples left out because they fall outside the compiled ranges (never clipped), or
    # because a quantized model was calibrated on them.
    skipped: list[str] = field(default_factory=list)
    # Quantized compiles: the final precision of every partition with its own error (vs its PyTorch
    # submodule) and latency (rows of compiler.compare.PartitionComparison), set by ensure_accuracy.
    precision_plan: list[dict] = field(default_factory=list)

    @property
    def max_rel_l2(self) -> float:
        return _worst((o.rel_l2 for o in self.outputs), max, 0.0)

    @property
    def max_abs(self) -> float:
        return _worst((o.max_abs for o in self.outputs), max, 0.0)

    @property
    def min_cosine(self) -> float:
        return _worst((o.cosine for o in self.outputs), min, 1.0)

    @property
    def min_top1_agreement(self) -> float | None:
        values = [o.top1_agreement for o in self.outputs if o.top1_agreement is not None]
        return _worst(values, min, 1.0) if values else None

    @property
    def latency_ratio(self) -> float:
        return self.compiled.median_ms / self.eager.median_ms if self.eager.median_ms else float("inf")

    def failures(self, tolerances: Tolerances) -> list[str]:
        """Why this report fails ``tolerances``: one reason per gated metric it misses; empty = pass.

        Each reason names the metric, its value, the limit and the tolerance field to change. A
        ``nan`` value never passes.
        """
        reasons = []
        # (metric in words, report value, tolerance field, OutputAccuracy field, whether higher is worse)
        gates = [
            ("max relative L2", self.max_rel_l2, "rel_l2", "rel_l2", True),
            ("max abs error", self.max_abs, "max_abs", "max_abs", True),
            ("min cosine", self.min_cosine, "min_cosine", "cosine", False),
            ("min top-1 agreement", self.min_top1_agreement, "min_top1_agreement", "top1_agreement", False),
        ]
        for metric, value, name, column, higher_is_worse in gates:
            limit = getattr(tolerances, name)
            if limit is None:
                continue
            if value is None:
                reasons.append(
                    f"accuracy: no output has a class axis to measure top-1 agreement on "
                    f"(tolerances.{name} is set; unset it for this model)"
                )
                continue
            ok = value <= limit if higher_is_worse else value >= limit  # nan: never ok
            if ok:
                continue
            worst = self._worst_output(column)
            where = f" on {worst}" if worst else ""
            sign, fmt = (">", ".1e") if higher_is_worse else ("<", ".4g")
            reasons.append(
                f"accuracy: {metric} {value:{fmt}}{where} {sign} tolerance {limit:{fmt}} (tolerances.{name})"
            )
        limit = tolerances.max_latency_ratio
        if limit is not None and not self.latency_ratio <= limit:
            reasons.append(
                f"latency: compiled/eager median {self.latency_ratio:.2f}x "
                f"({self.compiled.median_ms:.3g} ms / {self.eager.median_ms:.3g} ms) > tolerance "
                f"{limit:.2f}x (tolerances.max_latency_ratio)"
            )
        return reasons

    def passed(self, tolerances: Tolerances | None = None) -> bool:
        """``not failures(tolerances)``; without tolerances, the defaults of the report's precision."""
        return not self.failures(tolerances or Tolerances.for_precision(self.precision))

    def _worst_output(self, metric: str) -> str | None:
        rows = [o for o in self.outputs if getattr(o, metric) is not None]
        if len(rows) < 2:
            return None  # one output: naming it adds nothing
        sign = -1.0 if metric in ("cosine", "top1_agreement") else 1.0  # for these, lower is worse
        return max(rows, key=lambda o: nan_as_worst(sign * getattr(o, metric))).output

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(
            max_rel_l2=self.max_rel_l2,
            max_abs=self.max_abs,
            min_cosine=self.min_cosine,
            min_top1_agreement=self.min_top1_agreement,
            latency_ratio=self.latency_ratio,
        )
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ValidationReport:
        """The report ``to_dict`` wrote (derived values such as ``max_rel_l2`` are recomputed)."""
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["outputs"] = [
            o if isinstance(o, OutputAccuracy) else OutputAccuracy(**o) for o in data.get("outputs", [])
        ]
        for key in ("eager", "compiled"):
            if isinstance(values.get(key), Mapping):
                values[key] = Latency(**values[key])
        return cls(**values)


def nan_as_worst(value: float) -> float:
    """Sort key where nan counts as the worst (largest) value."""
    return math.inf if math.isnan(value) else value


def _worst(values: Any, pick: Callable, default: float) -> float:
    values = list(values)
    if any(math.isnan(v) for v in values):
        return math.nan
    return pick(values, default=default)


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
    with torch.no_grad():
        for flat in samples:
            args, kwargs = _unflatten(compiled, [t.to(device) for t in flat])
            worst.add(original(*args, **kwargs), compiled(*args, **kwargs))
    return worst.result()


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
    with torch.no_grad():
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
    in_spec = compiled.plan.program.call_spec.in_spec
    args, kwargs = pytree.tree_unflatten(flat, in_spec)
    return tuple(args), dict(kwargs)
