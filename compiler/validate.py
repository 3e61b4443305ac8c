"""Validate: accuracy of the compiled module against eager, and latency of both, side by side.

Inputs are drawn fresh inside the spec ranges (the minimum, the maximum and random points between,
with one value per dimension name so inputs that share ``batch`` agree). Every output leaf is
compared: max abs error, relative L2 error, cosine similarity.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch.utils import _pytree as pytree

from compiler.specs import InputSpec


@dataclass
class OutputAccuracy:
    output: str
    max_abs: float
    rel_l2: float
    cosine: float


@dataclass
class Latency:
    median_ms: float
    p95_ms: float
    runs: int


@dataclass
class ValidationReport:
    outputs: list[OutputAccuracy]
    shapes: list[list[list[int]]]
    eager: Latency
    compiled: Latency
    precision: str = "fp32"
    extras: dict = field(default_factory=dict)

    @property
    def max_rel_l2(self) -> float:
        return max((o.rel_l2 for o in self.outputs), default=0.0)

    @property
    def min_cosine(self) -> float:
        return min((o.cosine for o in self.outputs), default=1.0)

    @property
    def latency_ratio(self) -> float:
        return self.compiled.median_ms / self.eager.median_ms if self.eager.median_ms else float("inf")

    def passed(self, rel_l2: float = 1e-4) -> bool:
        return self.max_rel_l2 <= rel_l2

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(max_rel_l2=self.max_rel_l2, min_cosine=self.min_cosine, latency_ratio=self.latency_ratio)
        return data


def sample_inputs(specs: Sequence[InputSpec], point: str, generator: torch.Generator) -> list[torch.Tensor]:
    """Inputs at ``min``, ``max``, ``opt`` or a ``random`` point inside the spec ranges."""
    sizes: dict[str, int] = {}
    tensors = []
    for spec in specs:
        shape = []
        for axis in range(spec.rank):
            lo, hi = spec.dim_range(axis)
            name = spec.dynamic_dims.get(axis)
            if name is None:
                shape.append(lo)
                continue
            if name not in sizes:
                pick = {"min": lo, "max": hi, "opt": spec.opt_shape[axis]}.get(point)
                sizes[name] = (
                    pick if pick is not None else int(torch.randint(lo, hi + 1, (1,), generator=generator))
                )
            shape.append(sizes[name])
        tensors.append(_random_tensor(spec, shape, generator))
    return tensors


def _random_tensor(spec: InputSpec, shape: list[int], generator: torch.Generator) -> torch.Tensor:
    dtype = spec.torch_dtype
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    lo, hi = spec.value_range or (0, 1)
    return torch.randint(int(lo), int(hi) + 1, shape, generator=generator, dtype=dtype)


def compare(reference: object, actual: object) -> list[OutputAccuracy]:
    ref_leaves, _ = pytree.tree_flatten(reference)
    act_leaves, _ = pytree.tree_flatten(actual)
    if len(ref_leaves) != len(act_leaves):
        raise ValueError(f"compiled module returned {len(act_leaves)} outputs, eager {len(ref_leaves)}")
    rows = []
    for index, (ref, act) in enumerate(zip(ref_leaves, act_leaves, strict=True)):
        if not isinstance(ref, torch.Tensor):
            continue
        ref64, act64 = ref.detach().double().flatten(), act.detach().double().flatten()
        diff = (ref64 - act64).abs()
        max_abs = float(diff.max()) if diff.numel() else 0.0
        norm = float(ref64.norm())
        rel = float((ref64 - act64).norm()) / norm if norm else max_abs
        cosine = float(torch.nn.functional.cosine_similarity(ref64, act64, dim=0)) if ref64.numel() else 1.0
        if not norm and not float(act64.norm()):
            cosine = 1.0
        rows.append(OutputAccuracy(f"output_{index}", max_abs, rel, cosine))
    return rows


def measure(fn: Callable[[], object], warmup: int, runs: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def _latency(times: list[float]) -> Latency:
    ordered = sorted(times)
    p95 = ordered[min(len(ordered) - 1, round(0.95 * (len(ordered) - 1)))]
    return Latency(statistics.median(ordered), p95, len(ordered))


def validate(
    original: torch.nn.Module,
    compiled: torch.nn.Module,
    *,
    samples: int = 3,
    warmup: int = 3,
    runs: int = 20,
    seed: int = 0,
) -> ValidationReport:
    """Accuracy on ``samples`` input sets (min, max, random...) and latency at the opt shapes."""
    specs = compiled.input_specs
    generator = torch.Generator().manual_seed(seed)
    points = (["min", "max"] + ["random"] * max(0, samples - 2))[: max(1, samples)]
    worst: dict[str, OutputAccuracy] = {}
    shapes = []
    with torch.no_grad():
        for point in points:
            flat = sample_inputs(specs, point, generator)
            args, kwargs = _unflatten(compiled, flat)
            for row in compare(original(*args, **kwargs), compiled(*args, **kwargs)):
                if row.output not in worst or row.rel_l2 > worst[row.output].rel_l2:
                    worst[row.output] = row
            shapes.append([list(t.shape) for t in flat])
        args, kwargs = _unflatten(compiled, sample_inputs(specs, "opt", generator))
        eager_times, compiled_times = [], []
        for _ in range(warmup):
            original(*args, **kwargs), compiled(*args, **kwargs)
        # Interleave the two so machine noise hits both alike.
        for _ in range(runs):
            eager_times += measure(lambda: original(*args, **kwargs), 0, 1)
            compiled_times += measure(lambda: compiled(*args, **kwargs), 0, 1)
    precision = getattr(getattr(compiled, "report", None), "precision", "fp32")
    return ValidationReport(
        list(worst.values()), shapes, _latency(eager_times), _latency(compiled_times), precision
    )


def _unflatten(compiled: torch.nn.Module, flat: list[torch.Tensor]) -> tuple[tuple, dict]:
    in_spec = compiled.plan.program.call_spec.in_spec
    args, kwargs = pytree.tree_unflatten(flat, in_spec)
    return tuple(args), dict(kwargs)
