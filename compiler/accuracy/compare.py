"""Per-partition comparison: each engine against its own PyTorch submodule, on its real inputs.

One pass of the compiled module per sample: at every engine partition the activations arriving at it
(with its weights, as the fallback graph passes them) are captured, the engine's outputs are compared
with the partition's PyTorch submodule (``plan.submodule(name)``, in the model's own precision) run on
those very inputs. So each row is that partition's own error, not the error it inherited from
upstream: a partition fed ``nan`` by a broken neighbour compares ``nan`` with ``nan`` and is clean.

Latency shares come from separate timed passes without the reference runs, so they are the compiled
module's own. The compiled module is observed through forward hooks on its partition modules, added
for the call and removed after it (not thread-safe with other callers of the same module).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any

import torch

from compiler.backends import TORCH
from compiler.errors import PackageError
from compiler.runtime.module import CompiledModule
from compiler.validation.report import nan_as_worst
from compiler.validation.validate import compare_tensors


@dataclass(frozen=True)
class PartitionRow:
    """One partition: its engine (or ``"torch"``), its error vs its PyTorch submodule, its time.

    Errors are the worst over the partition's outputs and the samples (``nan`` and ``inf`` count as
    worst). A partition that runs in PyTorch has no error of its own (0).
    """

    partition: str
    fingerprint: str
    precision: str  # "fp32" | "fp16" | "bf16" | "torch"
    backend: str
    max_abs: float
    rel_l2: float
    cosine: float
    latency_ms: float
    latency_share: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PartitionComparison:
    rows: tuple[PartitionRow, ...]
    total_ms: float
    samples: int

    def row(self, partition: str) -> PartitionRow:
        return next(r for r in self.rows if r.partition == partition)

    def worst(self) -> list[PartitionRow]:
        """Rows from the largest relative L2 error down (non-finite first)."""
        return sorted(self.rows, key=lambda r: nan_as_worst(r.rel_l2), reverse=True)

    def table(self) -> str:
        """A table that reads at 80 columns."""
        lines = [
            f"{'partition':<12} {'fingerprint':<12} {'prec':<5} {'rel L2':>9} {'max abs':>9} "
            f"{'cosine':>8} {'ms':>8} {'share':>6}"
        ]
        for r in self.rows:
            lines.append(
                f"{r.partition:<12} {r.fingerprint[:12]:<12} {r.precision:<5} {r.rel_l2:>9.2e} "
                f"{r.max_abs:>9.2e} {r.cosine:>8.5f} {r.latency_ms:>8.3f} {r.latency_share:>6.1%}"
            )
        if not self.total_ms:
            lines.append("latency not measured (runs=0)")
            return "\n".join(lines)
        rest = max(1.0 - sum(r.latency_share for r in self.rows), 0.0)
        lines.append(f"rest of the graph (PyTorch fallback ops, glue): {rest:.1%} of {self.total_ms:.3f} ms")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {"rows": [r.to_dict() for r in self.rows], "total_ms": self.total_ms, "samples": self.samples}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> PartitionComparison:
        names = {f.name for f in fields(PartitionRow)}
        rows = tuple(PartitionRow(**{k: v for k, v in r.items() if k in names}) for r in data["rows"])
        return cls(rows, float(data["total_ms"]), int(data["samples"]))


def compare_partitions(
    compiled: CompiledModule,
    inputs: Sequence[torch.Tensor] | Sequence[Sequence[torch.Tensor]],
    *,
    runs: int = 3,
) -> PartitionComparison:
    """Each partition of ``compiled`` against its PyTorch submodule on the activations captured at its
    inputs, in one pass per sample; plus each partition's share of the compiled latency (median of
    ``runs`` timed passes; ``runs=0`` skips timing). Both run the graph uncaptured: a CUDA-graph replay
    calls none of the partitions' modules, whose hooks measure them.

    ``inputs``: the flat user inputs of one call (spec order), or a sequence of such samples.
    """
    device = compiled.plan.options.device
    samples = [tuple(t.to(device) for t in sample) for sample in _as_samples(inputs)]
    plan = compiled.plan
    parts = [p.name for p in plan.partitions]
    modules = {name: getattr(compiled.graph, name) for name in parts}
    worst: dict[str, list[float]] = {name: [0.0, 0.0, 1.0] for name in parts}

    def check(name: str):
        reference = plan.submodule(name)
        # The dtype each input of the submodule was traced at: a weight the package stored at its
        # engine's precision (reduced_weights) is run at it again, as the program holds it.
        traced = [n.meta.get("val") for n in reference.graph.nodes if n.op == "placeholder"]

        def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
            expected = reference(*(_traced_dtype(a, v) for a, v in zip(args, traced, strict=True)))
            outs = output if isinstance(output, tuple | list) else (output,)
            refs = expected if isinstance(expected, tuple | list) else (expected,)
            for ref, out in zip(refs, outs, strict=True):
                if not isinstance(ref, torch.Tensor):
                    continue
                row = compare_tensors(name, ref, out)
                w = worst[name]
                w[0] = max(w[0], row.max_abs, key=nan_as_worst)
                w[1] = max(w[1], row.rel_l2, key=nan_as_worst)
                w[2] = math.nan if math.isnan(w[2]) or math.isnan(row.cosine) else min(w[2], row.cosine)

        return hook

    engines = [name for name in parts if _runs_engine(compiled, name)]
    lacking = plan.float_weights_missing(engines)
    if lacking:
        raise PackageError(
            f"partitions {lacking} cannot be compared with their PyTorch submodules: their float weights "
            "were left out of the package (saved with int8_weights_only); compare before saving"
        )
    with _hooks({name: modules[name] for name in engines}, forward=check):
        for flat in samples:
            compiled.run_flat(list(flat), capture=False)

    times: dict[str, list[float]] = {name: [] for name in parts}
    totals: list[float] = []
    if runs > 0:
        started: dict[str, float] = {}

        def pre(name: str):
            def hook(module: torch.nn.Module, args: tuple) -> None:
                started[name] = time.perf_counter()

            return hook

        def post(name: str):
            def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
                times[name][-1] += (time.perf_counter() - started[name]) * 1e3

            return hook

        flat = list(samples[0])
        compiled.run_flat(flat, capture=False)  # warm: first calls allocate
        with _hooks(modules, forward=post, pre=pre):
            for _ in range(runs):
                for name in parts:
                    times[name].append(0.0)
                start = time.perf_counter()
                compiled.run_flat(flat, capture=False)
                totals.append((time.perf_counter() - start) * 1e3)
    total = statistics.median(totals) if totals else 0.0
    rows = []
    for name in parts:
        fp = compiled.dedup.instance(name).fingerprint
        artifact = compiled.engines[fp]
        ms = statistics.median(times[name]) if times[name] else 0.0
        max_abs, rel_l2, cosine = worst[name]
        rows.append(
            PartitionRow(
                name,
                fp,
                plan.options.precision_of(name) if artifact.is_engine else TORCH,
                artifact.backend,
                max_abs,
                rel_l2,
                cosine,
                ms,
                ms / total if total else 0.0,
            )
        )
    return PartitionComparison(tuple(rows), total, len(samples))


def _runs_engine(compiled: CompiledModule, name: str) -> bool:
    return compiled.engines[compiled.dedup.instance(name).fingerprint].is_engine


def _as_samples(inputs: Sequence[Any]) -> list[tuple[torch.Tensor, ...]]:
    if not inputs:
        raise ValueError("compare_partitions needs at least one set of inputs")
    if isinstance(inputs[0], torch.Tensor):
        return [tuple(inputs)]
    return [tuple(sample) for sample in inputs]


class _hooks:
    """Forward (and pre-forward) hooks on named modules for the duration of a ``with`` block."""

    def __init__(self, modules: dict[str, torch.nn.Module], *, forward, pre=None):
        self.modules, self.forward, self.pre, self.handles = modules, forward, pre, []

    def __enter__(self) -> None:
        for name, module in self.modules.items():
            if self.pre is not None:
                self.handles.append(module.register_forward_pre_hook(self.pre(name)))
            self.handles.append(module.register_forward_hook(self.forward(name)))

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def _traced_dtype(value: Any, traced: Any) -> Any:
    """``value`` at the float dtype its placeholder was traced with, where both are float tensors."""
    floats = (
        isinstance(value, torch.Tensor) and isinstance(traced, torch.Tensor) and value.is_floating_point()
    )
    if floats and traced.is_floating_point() and value.dtype != traced.dtype:
        return value.to(traced.dtype)
    return value
