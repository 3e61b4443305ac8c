"""Layer-granular repair: an int8 partition that misses the model's tolerances keeps its fewest, most
sensitive layers in float instead of leaving int8 whole.

For the partition repair picked (:mod:`compiler.accuracy.repair`), when its recipe takes per-layer
exclusions (:func:`compiler.quantization.layers.supports_layers`: ONNX Runtime's quantizer, for ONNX
Runtime and TensorRT engines):

1. each layer's sensitivity (int8; fp16/bf16: :class:`~compiler.accuracy.ops.OpProbe`, the error an op
   adds alone): the error it adds on top of every other layer at int8, i.e. the partition's
   own output error (vs its float graph) fully quantized less that error with only this layer kept in
   float, on the validation samples' activations at its inputs, quantized from one calibration
   (:meth:`~compiler.quantization.layers.LayerProbe.gain`), largest first. Not each layer quantized
   alone: that misses how the errors before a layer pass through it (a 4x256 BERT's classifier added
   1.1e-02 alone, the 67th of 97, yet kept in float took the model from 0.21 to 0.07). A layer that adds
   nothing is never kept in float: every tensor of an elementwise op between quantized neighbours stays
   quantized, so keeping it in float only adds Q/DQ nodes (latency) and no accuracy;
2. the fewest of them kept in float until the *model* meets the tolerances. Where a rel L2 tolerance
   is set, the probe first guesses the count: the partition's own error with the top k in float
   (quantized from the cached ranges, no rebuild), scaled by the model's error over the partition's at
   k = 0, bisected for the fewest k whose guess meets the tolerance. That count is rebuilt (quantized
   again with ``CompileOptions.float_layers``, the engine through the engine cache) and validated;
   when it passes, one fewer is the guess's miss. When it misses (or without a guess: from 1), the
   count doubles, rebuilt and validated each time, then a bisection between the last miss and the
   first hit. A rebuild is what costs (a quantization, a build, a validation): the guess saves most.
3. latency: the fewest by count is not the cheapest (a GEMM in float costs ~3x its int8 time on ONNX
   Runtime's CPU, an elementwise op a Q/DQ pair): the layers of the set found are put back at int8, the
   costliest first, while the guess still meets the tolerance, and what is left is rebuilt and
   validated once; kept only when it passes.

Both stop at the deadline (``CompileOptions.repair_seconds``): layers not measured by then rank after
the measured ones, and a search with no passing set by then gives up, and repair raises the partition
whole (the fallback it always had). Every verification is a real rebuild, so the set chosen is the one
validated.

Sensitivities are measured on validation samples, the data the gate checks, as partition repair's
errors are; calibration data only sets scales.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from compiler.accuracy.ops import REDUCED_FLOATS, OpProbe
from compiler.inputs.data import ValidationData
from compiler.quantization.layers import Layer, LayerProbe, LayerSensitivity, supports_layers
from compiler.runtime.module import CompiledModule

FLOAT = "fp32"  # what a layer kept out of int8 computes in (ONNX Runtime's QDQ graphs are fp32 around it)


@dataclass(frozen=True)
class LayerSearch:
    """One partition's layer search: the layers it kept in float (with their sensitivity), what it
    measured and verified, and whether the model met its tolerances."""

    partition: str
    raised: tuple[LayerSensitivity, ...]
    candidates: int  # layers the quantizer touched
    measured: int  # of them, whose sensitivity was measured before the deadline
    verifications: int  # rebuilds validated against the model's tolerances
    partition_rel_l2: float  # the partition's own error with every layer at int8 (vs its float graph)
    passed: bool
    seconds: float
    note: str = ""
    precision: str = "int8"  # what the partition computes in, the layers kept in float aside

    def to_dict(self) -> dict:
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["raised"] = [r.to_dict() for r in self.raised]
        data["partition_rel_l2"] = _finite(self.partition_rel_l2)
        return data

    def lines(self) -> list[str]:
        if not self.passed:
            return [f"{self.partition}: no set of its layers in float met the tolerances ({self.note})"]
        return [
            f"{self.partition}/{r.layer.label()}: {self.precision} -> {FLOAT}, "
            f"{'alone ' if r.alone else ''}it added rel L2 {r.rel_l2:.1e}"
            for r in self.raised
        ]


def search(
    compiled: CompiledModule,
    partition: str,
    dataset: ValidationData,
    deadline: float,
    *,
    rebuild: Callable[[CompiledModule, Mapping[str, tuple[str, ...]]], CompiledModule],
    accuracy: Callable[[CompiledModule], Any],
    model_error: float | None = None,
    tolerance: float | None = None,
) -> tuple[LayerSearch, CompiledModule | None, Any]:
    """Search ``partition``'s layers (see the module docstring). ``rebuild(compiled, float_layers)``
    gives the module with those layers in float; ``accuracy(module)`` its :class:`ModelAccuracy`.
    ``model_error``/``tolerance``: the model's rel L2 now and the one to meet, for the probe's guess
    (None: no guess). Returns the search, and the passing module and its accuracy (None, None when none
    passed)."""
    from compiler.engine_build.lower import lower_float
    from compiler.partitioning.dedup import canonical_weights
    from compiler.quantization.quantize import _captured, calibration_samples

    start = time.perf_counter()
    plan = compiled.plan
    recipe = plan.options.partition_quantization(partition, plan.options.precision_of(partition))
    by_name = {p.name: p for p in plan.partitions}

    def done(note: str, probe: LayerProbe | OpProbe | None = None, **found: Any) -> LayerSearch:
        return LayerSearch(
            partition,
            tuple(found.get("raised", ())),
            len(probe.layers) if probe else 0,
            found.get("measured", 0),
            found.get("verifications", 0),
            probe.full_error if probe else math.nan,
            bool(found.get("passed")),
            round(time.perf_counter() - start, 4),
            note,
            plan.options.precision_of(partition),
        )

    precision = plan.options.precision_of(partition)
    if not supports_layers(recipe) and precision not in REDUCED_FLOATS:
        return (
            done(f"its recipe ({recipe and recipe.get('graph')}) keeps no single layer in float"),
            None,
            None,
        )
    try:
        if precision in REDUCED_FLOATS:  # ops of its torch graph kept in fp32, on every backend
            feeds = _captured(plan, dataset.samples, [partition])[partition]
            probe: LayerProbe | OpProbe = OpProbe(plan, partition, feeds)
        else:
            calibration = ()
            if recipe["mode"] != "dynamic":
                calibration = calibration_samples(plan)[0].samples
            feeds = _captured(plan, [*calibration, *dataset.samples], [partition])[partition]
            own = lower_float(plan, by_name[partition], FLOAT).onnx
            probe = LayerProbe(
                own,
                canonical_weights(by_name[partition]),
                recipe,
                feeds[: len(calibration)],
                feeds[len(calibration) :],
            )
    except Exception as exc:  # calibration data gone, a quantizer failure: the partition is raised whole
        return (
            done(f"could not measure its layers: {type(exc).__name__}: {exc}".splitlines()[0][:300]),
            None,
            None,
        )
    tried: dict[tuple[str, ...], tuple[CompiledModule, Any]] = {}
    ranked: list[LayerSensitivity] = []
    measured = 0

    def verify_set(layers: Sequence[LayerSensitivity]) -> bool:
        names = tuple(sorted(r.layer.name for r in layers))
        if names not in tried:
            module = rebuild(compiled, {**plan.options.float_layers, partition: names})
            tried[names] = (module, accuracy(module))
        return not tried[names][1].failures

    def verify(count: int) -> bool:
        return verify_set(ranked[:count])

    guessing = bool(model_error and tolerance and math.isfinite(model_error) and probe.full_error > 0)

    def guess(low: int) -> tuple[int, int]:
        """(the fewest top layers in float whose guessed model error meets the tolerance, the most
        guessed to miss); (all of ``ranked``, the same) when even that is guessed to miss."""
        scale = model_error / probe.full_error

        def meets(count: int) -> bool:
            return scale * probe.error_without([r.layer.name for r in ranked[:count]]) <= tolerance

        miss, hit = low, len(ranked)
        if not meets(hit):
            return hit, hit
        while hit - miss > 1 and time.perf_counter() < deadline:
            middle = (miss + hit) // 2
            if meets(middle):
                hit = middle
            else:
                miss = middle
        return hit, miss

    # One ranking, by the error each layer adds on top of the others at int8 (LayerProbe.gain); a layer
    # that adds none is never raised: it would only add Q/DQ boundaries (an Add between quantized
    # neighbours kept in float runs as DequantizeLinear, Add, QuantizeLinear instead of one QLinearAdd).
    low, high = 0, None  # the most layers known to miss, the fewest known to pass
    try:
        found = []
        for layer in sorted(probe.layers, key=lambda x: -x.flops):  # the GEMMs first: the likeliest
            if time.perf_counter() > deadline:
                break
            found.append(probe.gain(layer))
        measured = len(found)
        seen = {m.layer.name for m in found}
        ranked += sorted((m for m in found if m.rel_l2 > 0), key=lambda m: (-m.rel_l2, _cost(m.layer)))
        if isinstance(probe, OpProbe):  # in float, ops help in runs (fp32 between them): none left out
            ranked += sorted((m for m in found if not m.rel_l2 > 0), key=lambda m: _cost(m.layer))
        count, floor = 1, 0
        if guessing and time.perf_counter() < deadline:
            count, floor = guess(0)
        if (
            isinstance(probe, LayerProbe)
            and guessing
            and floor == len(ranked)
            and time.perf_counter() < deadline
        ):
            # Guessed to miss with every layer that adds error on its own in float: the error is added
            # by layers together (a ViT's: no layer kept in float alone moved it). Ranked instead by the
            # error each adds quantized alone, the free ones (no weights, no GEMM FLOPs) first: on the
            # ViT, 5 elementwise layers met the tolerance where the 12 GEMMs found first did not.
            alone = []
            for layer in sorted(probe.layers, key=lambda x: x.costly):
                if time.perf_counter() > deadline:
                    break
                alone.append(dataclasses.replace(probe.sensitivity(layer), alone=True))
            free = [m for m in alone if not m.layer.costly]
            costly = [m for m in alone if m.layer.costly]
            ranked[:] = [
                *sorted(free, key=lambda m: -m.rel_l2),
                *sorted(costly, key=lambda m: -m.rel_l2),
            ]
            seen = {m.layer.name for m in alone}
            if time.perf_counter() < deadline:
                count, floor = guess(0)
        ranked += [LayerSensitivity(x, math.nan) for x in probe.layers if x.name not in seen]
        while high is None and low < len(ranked) and time.perf_counter() < deadline:
            count = min(max(count, low + 1), len(ranked))
            if verify(count):
                high = count
                low = max(low, min(floor, high - 1))  # the guess's miss, below the first hit
            else:
                low = count
                count *= 2
        while high is not None and high - low > 1 and time.perf_counter() < deadline:
            middle = (low + high) // 2
            if verify(middle):
                high = middle
            else:
                low = middle
        raised = list(ranked[: high or 0])
        if guessing and high is not None and high > 1 and time.perf_counter() < deadline:
            scale = model_error / probe.full_error
            raised = _relowered(raised, probe, scale, tolerance, deadline, verify_set)
    finally:
        probe.close()
    counted = {"measured": measured, "verifications": len(tried)}
    note = "" if measured == len(probe.layers) else f"{measured} of {len(probe.layers)} layers measured"
    if high is None:
        why = (
            "the deadline (repair_seconds) came first"
            if time.perf_counter() >= deadline
            else "every layer tried"
        )
        return done("; ".join(filter(None, [note, why])), probe, **counted), None, None
    if high - low > 1:
        note = "; ".join(
            filter(None, [note, f"bisection stopped at the deadline: {high} may be more than needed"])
        )
    module, reached = tried[tuple(sorted(r.layer.name for r in raised))]
    return done(note, probe, raised=raised, passed=True, **counted), module, reached


def _cost(layer: Layer) -> tuple[int, int]:
    """What keeping ``layer`` in float costs in latency, to order by: its GEMM/convolution FLOPs (int8
    kernels ran ~3x fp32 on ONNX Runtime's CPU), then its parameters."""
    return (layer.flops, layer.params)


def _relowered(
    raised: list[LayerSensitivity],
    probe: LayerProbe | OpProbe,
    scale: float,
    tolerance: float,
    deadline: float,
    verify: Callable[[Sequence[LayerSensitivity]], bool],
) -> list[LayerSensitivity]:
    """``raised`` (a prefix of the ranking that passed) with the layers put back at int8 that the
    probe's guess says the tolerance does without, the costliest in latency tried first (a GEMM before
    an elementwise op); kept only when the rebuild of what is left passes too. The prefix is fewest by
    count, not by cost: errors do not add, so a costly layer high in the ranking may be covered by the
    ones after it."""
    left = list(raised)
    for candidate in sorted(raised, key=lambda r: _cost(r.layer), reverse=True):
        if time.perf_counter() > deadline or len(left) == 1:
            break
        trial = [r for r in left if r is not candidate]
        if scale * probe.error_without([r.layer.name for r in trial]) <= tolerance:
            left = trial
    if len(left) < len(raised) and time.perf_counter() < deadline and verify(left):
        return left
    return raised


def _finite(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)
