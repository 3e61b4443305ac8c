"""Repair: a reduced-precision compile that misses its accuracy tolerances raises its worst partitions.

One round: attribute the error to partitions (:func:`compiler.accuracy.compare.compare_partitions`: each
engine against its own PyTorch submodule on the activations captured at its inputs, in one pass), raise the
worst one step (int8 -> fp16 on CUDA / fp32 on the CPU; fp16/bf16 -> fp32 engine -> PyTorch; every
partition with a non-finite error at once), rebuild, re-validate. In an int8 compile the precision is
chosen per partition this way, and ``partition_precision`` entries given to it are pins it keeps.
Rounds repeat until the tolerances hold or nothing is left to raise.

What changes is ``CompileOptions.partition_precision``: only the raised partitions' build settings,
so only their fingerprints change; every other engine is reused as built (no lowering, no build, not
even a cache look-up) and the engine cache keeps both versions. The repaired options are the whole
recipe: compiling with them gives the same engines without repairing again.

Every decision is recorded (:class:`RepairRecord`, also put in the compile report), e.g.
``engine_3: fp16 -> fp32, its rel L2 3.1e-02 -> 2.0e-07``.

Only accuracy is repaired: raising precision never makes a model faster, so latency tolerances are
left to validation. An fp32 compile is not repaired: an fp32 engine that misses its tolerance is a
lowering bug to report, not a precision loss to hide in PyTorch.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from compiler.accuracy.compare import PartitionComparison, PartitionRow, compare_partitions
from compiler.accuracy.layers import LayerSearch, search
from compiler.accuracy.mixed import (
    decision_key,
    kept_line,
    kept_shares,
    recalled_decision,
    remember_decision,
    search_lines,
)
from compiler.accuracy.ops import REDUCED_FLOATS
from compiler.backends.base import QUANTIZED_PRECISIONS
from compiler.cache.local import EngineCache, resolve_cache, resolve_setting
from compiler.engine_build.engine import EngineArtifact, build_engine
from compiler.engine_build.weights import at_program_dtype, read_wider_than_stored
from compiler.errors import AccuracyError, PackageError
from compiler.inputs.data import ValidationData
from compiler.partitioning.dedup import dedup
from compiler.partitioning.partition import QUANTIZED_PREFIX
from compiler.quantization.quantize import quantize
from compiler.runtime.module import CompiledModule, assemble
from compiler.validation.report import Latency, Tolerances, ValidationReport, nan_as_worst
from compiler.validation.validate import measure_accuracy, validate, validation_inputs

# One step up in accuracy for a partition at each level; "torch" (its PyTorch submodule) is the top.
# int8 steps to fp16 where fp16 is fast (CUDA) and straight to fp32 on the CPU, where fp16 engines run
# through casts and would only cost one more rebuild (see step_up).
STEP_UP = {"int8": "fp16", "fp8": "fp16", "fp16": "fp32", "bf16": "fp32", "fp32": "torch"}
REDUCED = ("fp16", "bf16", "int8", "fp8")
LAYERED = (*QUANTIZED_PRECISIONS, *REDUCED_FLOATS)  # repaired a layer or an op at a time first


def step_up(precision: str, device: str) -> str:
    """The next level up from ``precision`` for a partition of a model running on ``device``."""
    if precision == "int8" and not device.startswith("cuda"):
        return "fp32"
    return STEP_UP[precision]


def pinned(options: Any) -> frozenset[str]:
    """Partitions the search must leave as they are: in an int8 compile (precision chosen per partition)
    every ``partition_precision`` entry given to the compile is a pin. A float compile's entries are
    starting points the ladder may raise further (fp32 -> torch), as before int8 existed."""
    if options.precision not in QUANTIZED_PRECISIONS:
        return frozenset()
    return frozenset(options.partition_precision)


@dataclass(frozen=True)
class RepairStep:
    """One partition raised one step, with its own error (vs its PyTorch submodule) before and after."""

    round: int
    partition: str
    precision_before: str
    precision_after: str
    fingerprint_before: str
    fingerprint_after: str
    rel_l2_before: float
    rel_l2_after: float

    def describe(self) -> str:
        return (
            f"{self.partition}: {self.precision_before} -> {self.precision_after}, its rel L2 "
            f"{self.rel_l2_before:.1e} -> {self.rel_l2_after:.1e}"
        )


@dataclass(frozen=True)
class ModelAccuracy:
    """The model's accuracy at one point of a repair, and the reasons it fails the tolerances."""

    max_rel_l2: float
    min_cosine: float
    min_top1_agreement: float | None
    failures: tuple[str, ...]


@dataclass(frozen=True)
class RepairRecord:
    """What a repair did: every step, the model before and after, and what it cost."""

    steps: tuple[RepairStep, ...]
    before: ModelAccuracy
    after: ModelAccuracy
    partition_precision: Mapping[str, str]
    rounds: int
    engines_built: int  # fingerprints repair built (cache misses)
    engines_from_cache: int  # fingerprints repair needed that the engine cache already held
    build_seconds: float
    seconds: float
    data_source: str
    note: str = ""  # why it stopped short, when it did
    # Layer-granular repair (compiler.accuracy.layers): each partition's search, the layers it kept in
    # float, what of the model stayed at the requested precision, the time budget, and whether the
    # decision came from the engine cache (an earlier repair of this very compile).
    searches: tuple[dict, ...] = ()
    float_layers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    kept: Mapping[str, Any] | None = None
    budget_seconds: float | None = None
    reused: bool = False

    @property
    def passed(self) -> bool:
        return not self.after.failures

    def lines(self) -> list[str]:
        """One line per decision, then the model's accuracy before and after."""
        model = f"model rel L2 {self.before.max_rel_l2:.1e} -> {self.after.max_rel_l2:.1e}"
        if self.before.min_top1_agreement is not None and self.after.min_top1_agreement is not None:
            model += (
                f"; model top-1 agreement {self.before.min_top1_agreement:.2f} -> "
                f"{self.after.min_top1_agreement:.2f}"
            )
        searched = [line for search in self.searches for line in search_lines(search)]
        kept = [kept_line(self.kept)] if self.kept else []
        notes = [self.note] if self.note else []
        return searched + [step.describe() for step in self.steps] + [model] + kept + notes

    def to_dict(self) -> dict:
        """JSON-safe: a non-finite error (an overflow's ``inf``, ``nan``) is written as a string, since
        strict JSON readers refuse ``Infinity``; ``from_dict`` reads it back as a float."""
        data = _json_safe(dataclasses.asdict(self))
        data["partition_precision"] = dict(self.partition_precision)
        data["float_layers"] = {k: list(v) for k, v in self.float_layers.items()}
        data["passed"] = self.passed
        data["lines"] = self.lines()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RepairRecord:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["steps"] = tuple(
            RepairStep(
                **{**s, "rel_l2_before": float(s["rel_l2_before"]), "rel_l2_after": float(s["rel_l2_after"])}
            )
            for s in data["steps"]
        )
        for key in ("before", "after"):
            point = dict(data[key])
            point["failures"] = tuple(point["failures"])
            for metric in ("max_rel_l2", "min_cosine", "min_top1_agreement"):
                point[metric] = None if point[metric] is None else float(point[metric])
            values[key] = ModelAccuracy(**point)
        values["partition_precision"] = dict(data["partition_precision"])
        values["searches"] = tuple(dict(s) for s in data.get("searches", ()))
        values["float_layers"] = {k: tuple(v) for k, v in (data.get("float_layers") or {}).items()}
        return cls(**values)


@dataclass(frozen=True)
class RepairResult:
    compiled: CompiledModule
    record: RepairRecord
    comparison: PartitionComparison | None = field(default=None)  # the last per-partition table


def rebuild(
    compiled: CompiledModule,
    partition_precision: Mapping[str, str],
    *,
    cache: EngineCache | str | os.PathLike | bool | None = None,
    float_layers: Mapping[str, Sequence[str]] | None = None,
) -> tuple[CompiledModule, list[EngineArtifact]]:
    """``compiled`` with new per-partition precisions (and ``float_layers``: layers kept in float inside
    int8 partitions, whose graphs are quantized again): only fingerprints it does not hold are built
    (through the engine cache); every other engine is reused as it is. Returns the new module and the
    artifacts it had to get (built or from the cache)."""
    before = compiled.plan.options
    layers = before.float_layers if float_layers is None else float_layers
    levels = dict(partition_precision)
    layers = {k: tuple(v) for k, v in layers.items() if levels.get(k, before.precision) in LAYERED}
    options = dataclasses.replace(before, partition_precision=levels, float_layers=layers)
    raised = [
        p.name for p in compiled.plan.partitions if options.precision_of(p.name) not in QUANTIZED_PRECISIONS
    ]
    lacking = compiled.plan.float_weights_missing(raised)
    if lacking:
        raise PackageError(
            f"partitions {lacking} cannot leave int8: their float weights were left out of the package "
            "(saved with int8_weights_only); recompile from the model to change their precision"
        )
    # A partition raised out of int8 takes its float weights again: its quantized tensors go.
    quantized = {
        key: tensor
        for key, tensor in compiled.plan.quantized.items()
        if options.precision_of(key[len(QUANTIZED_PREFIX) :].split("/")[0]) in QUANTIZED_PRECISIONS
    }
    plan = dataclasses.replace(compiled.plan, options=options, quantized=quantized)
    rounded = read_wider_than_stored(plan, compiled.dedup.instances)
    if rounded:  # stored at their engines' precision: the fp32 values are not in the package
        raise PackageError(
            f"partitions {rounded} cannot be raised: their weights were stored at fp16/bf16 (saved with "
            "engine_precision_weights); recompile from the model to change their precision"
        )
    changed = [
        p.name
        for p in plan.partitions
        if options.precision_of(p.name) in QUANTIZED_PRECISIONS
        and options.float_layers.get(p.name, ()) != before.float_layers.get(p.name, ())
    ]
    if changed:
        plan = quantize(plan, only=changed)
    unique = dedup(plan)
    engine_cache = resolve_setting(cache)  # False where there is none: None is the default cache
    new = {
        fp: build_engine(plan, unique, fp, cache=engine_cache)
        for fp in unique.fingerprints
        if fp not in compiled.engines
    }
    engines = {fp: compiled.engines.get(fp) or new[fp] for fp in unique.fingerprints}
    running = {p.name for p in plan.partitions if engines[unique.instance(p.name).fingerprint].is_engine}
    plan = at_program_dtype(plan, unique.instances, running)  # PyTorch runs fp32 where it now reads one
    rebuilt = assemble(plan, unique, engines, cache=engine_cache)
    return rebuilt, list(new.values())


def repair(
    original: torch.nn.Module,
    compiled: CompiledModule,
    tolerances: Tolerances,
    *,
    data: str | os.PathLike | Mapping[str, object] | ValidationData | None = None,
    samples: int = 3,
    seed: int = 0,
    cache: EngineCache | str | os.PathLike | bool | None = None,
    per_round: int = 1,
    max_rounds: int | None = None,
) -> RepairResult:
    """Raise the partitions that lose accuracy until ``tolerances`` hold (see the module docstring).

    ``tolerances`` are used as given (``Tolerances.resolved(precision)`` fills the default rel L2);
    latency is not gated here. ``data``/``samples``/``seed``: the inputs, as :func:`compiler.validate`.
    ``per_round``: how many partitions (the worst) to raise per round when none is non-finite.
    Returns the repaired module (``compiled`` itself when nothing needed raising) and the record,
    which is also set on the module's report (``report.accuracy_repair``).
    """
    start = time.perf_counter()
    gate = dataclasses.replace(tolerances, max_latency_ratio=None)
    dataset = validation_inputs(compiled, data, samples=samples, seed=seed)
    engine_cache = resolve_cache(cache)
    key = decision_key(compiled, gate, dataset)
    earlier = _reuse(original, compiled, gate, dataset, engine_cache, key, start)
    if earlier is not None:
        return earlier
    initial = compiled
    before = current = _accuracy(original, compiled, dataset, gate)
    steps: list[RepairStep] = []
    searches: list[LayerSearch] = []
    built = from_cache = rounds = 0
    build_seconds = 0.0
    note = ""
    table: PartitionComparison | None = None
    precision = compiled.plan.options.precision
    pins = pinned(compiled.plan.options)
    device = compiled.plan.options.device
    deadline = start + compiled.plan.options.repair_seconds

    def rebuilt(module: CompiledModule, levels: Mapping[str, str], layers=None) -> CompiledModule:
        nonlocal built, from_cache, build_seconds
        module, artifacts = rebuild(module, levels, cache=engine_cache or False, float_layers=layers)
        built += sum(1 for a in artifacts if a.is_engine and not a.cache_hit)
        from_cache += sum(1 for a in artifacts if a.is_engine and a.cache_hit)
        build_seconds += sum(a.seconds for a in artifacts)
        return module

    if current.failures and precision not in REDUCED:
        note = (
            f"not repaired: repair raises {'/'.join(REDUCED)} partitions and this compile is {precision}; "
            "an engine that misses its tolerance at full precision is a lowering bug to report"
        )
    elif current.failures:
        table = compare_partitions(compiled, dataset.samples, runs=0)
    while current.failures and table is not None:
        if max_rounds is not None and rounds >= max_rounds:
            note = f"stopped after max_rounds={max_rounds} with the tolerances still missed"
            break
        picks = _pick(table, per_round, pins)
        if not picks:
            note = "nothing left to raise: every partition with an error is fp32 or PyTorch already"
            if pins:
                note += f" or pinned by partition_precision ({', '.join(sorted(pins))})"
            break
        rounds += 1
        # Layer granularity first: the worst int8 partition keeps its fewest sensitive layers in float.
        searched = {s.partition for s in searches}
        # fp16/bf16 ops are searched where the error is finite: an overflow raises the partition whole.
        finite = [r for r in picks if r.precision in QUANTIZED_PRECISIONS or math.isfinite(r.rel_l2)]
        layered = [r for r in finite if r.precision in LAYERED and r.partition not in searched]
        if layered and time.perf_counter() < deadline:
            found, module, reached = search(
                compiled,
                layered[0].partition,
                dataset,
                deadline,
                rebuild=lambda m, layers: rebuilt(m, m.plan.options.partition_precision, layers),
                accuracy=lambda m: _accuracy(original, m, dataset, gate),
                model_error=current.max_rel_l2,
                tolerance=gate.rel_l2,
            )
            searches.append(found)
            if module is not None:
                compiled, current = module, reached
                table = compare_partitions(compiled, dataset.samples, runs=0)
                continue
        levels = {**compiled.plan.options.partition_precision}
        levels.update({row.partition: step_up(row.precision, device) for row in picks})
        compiled = rebuilt(compiled, levels)
        after = compare_partitions(compiled, dataset.samples, runs=0)
        for row in picks:
            now = after.row(row.partition)
            steps.append(
                RepairStep(
                    rounds,
                    row.partition,
                    row.precision,
                    step_up(row.precision, device),
                    row.fingerprint,
                    now.fingerprint,
                    row.rel_l2,
                    now.rel_l2,
                )
            )
        table = after
        current = _accuracy(original, compiled, dataset, gate)
    changed = bool(steps or any(s.raised for s in searches))
    record = RepairRecord(
        tuple(steps),
        before,
        current,
        dict(compiled.plan.options.partition_precision),
        rounds,
        built,
        from_cache,
        round(build_seconds, 4),
        round(time.perf_counter() - start, 4),
        dataset.source,
        note,
        searches=tuple(s.to_dict() for s in searches),
        float_layers=dict(compiled.plan.options.float_layers),
        kept=kept_shares(initial, compiled, dataset) if changed else None,
        budget_seconds=compiled.plan.options.repair_seconds,
    )
    if changed or searches:
        compiled.report.accuracy_repair = record.to_dict()
        compiled.report.stage_seconds["repair"] = record.seconds
    if changed and record.passed and engine_cache is not None and key is not None:
        remember_decision(engine_cache, key, record.to_dict())
    return RepairResult(compiled, record, table)


def _reuse(
    original: torch.nn.Module,
    compiled: CompiledModule,
    gate: Tolerances,
    dataset: ValidationData,
    engine_cache: EngineCache | None,
    key: str | None,
    start: float,
) -> RepairResult | None:
    """An earlier repair of this very compile (same engines, options, tolerances and samples), read from
    the engine cache and applied: its engines come from the cache, nothing is searched or measured
    again but the model's accuracy, which must still pass (else None: repair searches anew)."""
    found = recalled_decision(engine_cache, key) if engine_cache is not None and key is not None else None
    if found is None:
        return None
    earlier = RepairRecord.from_dict(found)
    module, artifacts = rebuild(
        compiled, earlier.partition_precision, cache=engine_cache, float_layers=earlier.float_layers
    )
    reached = _accuracy(original, module, dataset, gate)
    if reached.failures:
        return None
    record = dataclasses.replace(
        earlier,
        after=reached,
        engines_built=sum(1 for a in artifacts if a.is_engine and not a.cache_hit),
        engines_from_cache=sum(1 for a in artifacts if a.is_engine and a.cache_hit),
        build_seconds=round(sum(a.seconds for a in artifacts), 4),
        seconds=round(time.perf_counter() - start, 4),
        reused=True,
    )
    module.report.accuracy_repair = record.to_dict()
    module.report.stage_seconds["repair"] = record.seconds
    return RepairResult(module, record, None)


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # "inf", "-inf", "nan": float() reads each back
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    return value


def _pick(
    table: PartitionComparison, per_round: int, pins: frozenset[str] = frozenset()
) -> list[PartitionRow]:
    """The partitions to raise this round: every one with a non-finite error (an overflow: certainly
    broken), else the ``per_round`` worst (the most sensitive, measured against its own PyTorch
    submodule). Partitions without error have nothing to gain; pinned ones are left alone."""
    candidates = [
        r
        for r in table.worst()
        if r.precision in STEP_UP and nan_as_worst(r.rel_l2) > 0 and r.partition not in pins
    ]
    broken = [r for r in candidates if not math.isfinite(r.rel_l2)]
    return broken or candidates[: max(1, per_round)]


def _accuracy(
    original: torch.nn.Module, compiled: CompiledModule, data: ValidationData, gate: Tolerances
) -> ModelAccuracy:
    outputs = measure_accuracy(original, compiled, data.samples)
    report = _accuracy_report(outputs, compiled.plan.options.precision)
    return ModelAccuracy(
        report.max_rel_l2, report.min_cosine, report.min_top1_agreement, tuple(report.failures(gate))
    )


def _accuracy_report(outputs: list, precision: str) -> ValidationReport:
    idle = Latency(0.0, 0.0, 0)  # no latency here: the gate passed in sets no latency tolerance
    return ValidationReport(outputs, [], idle, idle, precision)


def ensure_accuracy(
    original: torch.nn.Module,
    compiled: CompiledModule,
    tolerances: Tolerances,
    *,
    data: str | os.PathLike | Mapping[str, object] | ValidationData | None = None,
    samples: int = 3,
    warmup: int = 3,
    runs: int = 20,
    seed: int = 0,
    cache: EngineCache | str | os.PathLike | bool | None = None,
) -> tuple[CompiledModule, ValidationReport]:
    """Validate; when accuracy fails and ``compiled.plan.options.on_accuracy_failure`` is
    ``"repair"``, repair and validate again. Returns the (possibly repaired) module and its final
    report; raises :class:`AccuracyError` with every reason when the tolerances still do not hold.
    ``tolerances`` are resolved against the compile's precision (an unset rel L2 gets its default)."""
    tolerances = tolerances.resolved(compiled.plan.options.precision)
    dataset = validation_inputs(compiled, data, samples=samples, seed=seed)
    settings = {"warmup": warmup, "runs": runs, "seed": seed}
    report = validate(original, compiled, data=dataset, **settings)
    failures = report.failures(tolerances)
    accuracy_failed = any(reason.startswith("accuracy:") for reason in failures)
    if accuracy_failed and compiled.plan.options.on_accuracy_failure == "repair":
        result = repair(original, compiled, tolerances, data=dataset, cache=cache)
        if result.compiled is not compiled:  # partitions or layers raised
            compiled = result.compiled
            report = validate(original, compiled, data=dataset, **settings)
            failures = report.failures(tolerances)
        if failures and result.record.note:
            failures = [*failures, f"repair: {result.record.note}"]
    if failures:
        raise AccuracyError(
            "the compiled model misses its tolerances: " + "; ".join(failures), failures=failures
        )
    if compiled.plan.options.quantized:  # the plan the gate chose: each partition's level, error, time
        table = compare_partitions(compiled, dataset.samples, runs=max(1, min(runs, 5)))
        report.precision_plan = [row.to_dict() for row in table.rows]
    return compiled, report
