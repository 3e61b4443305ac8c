"""What a validation measured and the one pass/fail policy over it: :class:`Tolerances` (what is gated),
:class:`ValidationReport` (accuracy per output, latency of both sides) and its
:meth:`~ValidationReport.failures` (the reasons it fails; empty = pass).

Plain data, no torch: zoo files (tolerances) and manifests (reports) are read without importing it;
a report read back is checked field by field against :data:`VALIDATION` first
(:mod:`compiler.typed_json`). Measuring is :mod:`compiler.validate`'s job, which re-exports every
name here.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from compiler.errors import ToleranceError
from compiler.typed_json import ANY, ListOf, MapOf, Opt, Record, check

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
    # submodule) and latency (rows of compiler.accuracy.compare.PartitionComparison), set by ensure_accuracy.
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
    def from_dict(cls, data: Mapping[str, Any], where: str = "validation") -> ValidationReport:
        """The report ``to_dict`` wrote (derived values such as ``max_rel_l2`` are recomputed). A field
        of the wrong type is a PackageCorruptError naming ``where`` and the field."""
        # Rows and latencies may come as the dataclasses themselves (a report handed to save in memory).
        data = dict(data)
        if isinstance(data.get("outputs"), list | tuple):
            data["outputs"] = [asdict(o) if isinstance(o, OutputAccuracy) else o for o in data["outputs"]]
        for key in ("eager", "compiled"):
            if isinstance(data.get(key), Latency):
                data[key] = asdict(data[key])
        check(data, VALIDATION, where)
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["outputs"] = [OutputAccuracy(**o) for o in data["outputs"]]
        values["eager"], values["compiled"] = Latency(**data["eager"]), Latency(**data["compiled"])
        return cls(**values)


_OUTPUT = Record(
    {"output": str, "max_abs": float, "rel_l2": float, "cosine": float, "top1_agreement": Opt(float)},
    required=frozenset({"output", "max_abs", "rel_l2", "cosine"}),
)
_LATENCY = Record(
    {"median_ms": float, "p95_ms": float, "runs": int}, required=frozenset({"median_ms", "p95_ms", "runs"})
)
_PARTITION_ROW = Record(  # compiler.accuracy.compare.PartitionRow.to_dict()
    {
        "partition": str,
        "fingerprint": str,
        "precision": str,
        "backend": str,
        "max_abs": float,
        "rel_l2": float,
        "cosine": float,
        "latency_ms": float,
        "latency_share": float,
    },
    required=frozenset({"partition", "precision", "rel_l2", "latency_ms"}),
)
VALIDATION = Record(
    {
        "outputs": ListOf(_OUTPUT),
        "shapes": ListOf(ListOf(ListOf(int))),
        "eager": _LATENCY,
        "compiled": _LATENCY,
        "precision": str,
        "extras": MapOf(ANY),
        "data_source": str,
        "samples": int,
        "skipped": ListOf(str),
        "precision_plan": ListOf(_PARTITION_ROW),
    },
    required=frozenset({"outputs", "shapes", "eager", "compiled"}),
)


def precision_summary(rows: Sequence[Mapping[str, Any] | Any]) -> str:
    """``int8 x11; fp32: engine_2``: the precision most partitions got, with the others named. ``rows``:
    a report's ``precision_plan`` (dicts), or rows with ``to_dict()`` (compiler.accuracy.compare's)."""
    levels: dict[str, list[str]] = {}
    for row in rows:
        data = row if isinstance(row, Mapping) else row.to_dict()
        levels.setdefault(str(data["precision"]), []).append(str(data["partition"]))
    if not levels:
        return ""
    common = max(levels, key=lambda level: len(levels[level]))
    others = [f"{level}: {', '.join(names)}" for level, names in sorted(levels.items()) if level != common]
    return "; ".join([f"{common} x{len(levels[common])}", *others])


def nan_as_worst(value: float) -> float:
    """Sort key where nan counts as the worst (largest) value."""
    return math.inf if math.isnan(value) else value


def _worst(values: Any, pick: Callable, default: float) -> float:
    values = list(values)
    if any(math.isnan(v) for v in values):
        return math.nan
    return pick(values, default=default)
