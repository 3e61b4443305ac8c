"""Quantize: int8 and fp8 partitions, calibrated on the user's data, with the recipe of the backend that
builds them (``CompileOptions.quantization_settings``).

Each recipe is one module with one entry point, ``quantize_fingerprint(RecipeCall)`` -> (the fingerprint's
quantized graph, each instance's tensors) (:mod:`compiler.quantization.recipe`); :func:`recipe_for` picks it:
:mod:`compiler.quantization.onnxruntime` (ONNX Runtime and TensorRT engines: ONNX Runtime's own
quantizer), :mod:`compiler.quantization.pt2e` (Inductor int8 on the CPU: torchao's PT2E flow) and
:mod:`compiler.quantization.rowwise` (Inductor int8 and fp8 on CUDA: torchao's dynamic rowwise recipes).

Runs after partitioning, before dedup and the engine builds (``compiler.compile`` and the partition
task call it); a plan without int8 partitions passes through unchanged.

1. Calibration inputs: the first ``calibration.samples`` samples of ``calibration.data`` (read by
   ``compiler.inputs.data``: names, dtypes and ranks checked there; NaN and inf refused here).
   Random inputs give meaningless scales: refused unless ``calibration.allow_random``. Dynamic
   quantization needs none.
2. One fp32 pass of the partitioned graph (every partition in PyTorch) over them captures the
   activations arriving at each partition: each instance is calibrated on its own inputs.
3. ONNX Runtime's recipe: each partition is lowered to fp32 ONNX (once per fingerprint; other
   instances get their weights put in), its constant subgraphs folded (``Transpose(w)`` becomes a
   transposed weight), put through ONNX Runtime's basic optimizations (Conv+BatchNorm fused), and
   quantized by
   ``onnxruntime.quantization``: ``quantize_static`` (QDQ, per-channel weights; ONNX Runtime: uint8
   activations, int8 weights; TensorRT: symmetric int8 or E4M3 fp8 at GEMM and convolution inputs)
   or ``quantize_dynamic`` (ONNX Runtime).
4. The quantized graph is canonicalized: every initializer (quantized weights, scales, zero points,
   int32 biases) is named ``w<k>`` by position, every other value ``v<n>``. Instances of one
   fingerprint give the same graph apart from those values, so the fingerprint still builds one
   engine and each instance's values are its refit tensors (``PartitionPlan.quantized``), stored in
   packages with the weights. An instance whose quantized graph differs, or a quantizer failure, puts
   every partition of that fingerprint back in fp32 (named in the record); nothing is cached for it.
   For TensorRT, which compiles scales into its kernels and will not refit them, scales and zero
   points are constants of each instance's own graph instead: every instance builds its own engine,
   and only its weights are refit tensors.
5. Inductor quantizes each instance's program with torchao's PT2E flow instead of steps 3-4
   (``compiler.quantization.pt2e``): weights and scales frozen into its program, its own engine. Its
   int8 and fp8 on CUDA rewrite each fingerprint's graph with torchao's dynamic rowwise recipes as
   ATen ops (``compiler.quantization.rowwise``): quantized weights and their scales are each instance's
   refit tensors.

The samples used are recorded by digest; validation never uses them
(``compiler.inputs.data.held_out``).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import numpy as np
import torch

from compiler.backends.base import QUANTIZED_PRECISIONS, to_numpy
from compiler.backends.capabilities import PT2E_GRAPH, ROWWISE_GRAPHS
from compiler.errors import CalibrationError, CalibrationWarning, ValidationDataError
from compiler.inputs.data import ValidationData, random_data, sample_digest, validation_data
from compiler.partitioning.partition import QUANTIZED_PREFIX, PartitionPlan
from compiler.program.tracing import custom_op_lock
from compiler.quantization.recipe import RecipeCall

# The float precision a partition falls back to when quantizing it fails.
FALLBACK_PRECISION = "fp32"


@dataclass(frozen=True)
class QuantizationRecord:
    """What quantization did: on which data, which samples (by digest), which partitions, and which
    fell back to float (partition -> reason)."""

    mode: str
    method: str | None
    per_channel: bool
    data_source: str | None  # None: dynamic (no calibration)
    samples: int
    sample_digests: tuple[str, ...]
    partitions: tuple[str, ...]
    fallbacks: Mapping[str, str] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()
    seconds: float = 0.0

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["sample_digests"] = list(self.sample_digests)
        data["partitions"] = list(self.partitions)
        data["warnings"] = list(self.warnings)
        data["fallbacks"] = dict(self.fallbacks)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> QuantizationRecord:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        for key in ("sample_digests", "partitions", "warnings"):
            values[key] = tuple(values.get(key, ()))
        return cls(**values)


def quantize(
    plan: PartitionPlan,
    data: str | os.PathLike | Mapping[str, object] | ValidationData | None = None,
    *,
    seed: int = 0,
    only: Collection[str] | None = None,
) -> PartitionPlan:
    """``plan`` with its int8 partitions quantized (see the module docstring). ``data`` overrides
    ``options.calibration.data`` (e.g. a ``compiler.inputs.hf_data.dataset_data`` result).

    ``only``: quantize these partitions again (their ``float_layers`` changed: accuracy repair) and
    keep every other partition's graph and tensors as ``plan`` holds them."""
    options = plan.options
    names = [p.name for p in plan.partitions if options.precision_of(p.name) in QUANTIZED_PRECISIONS]
    if only is not None:
        names = [name for name in names if name in set(only)]
    if not names:
        return plan
    from compiler.partitioning.dedup import dedup  # dedup imports partition; quantize sits between them

    start = time.perf_counter()
    dataset, notes = (
        (None, []) if options.quantization == "dynamic" else calibration_samples(plan, data, seed)
    )
    samples = dataset.samples if dataset is not None else ()
    feeds = _captured(plan, samples, names) if samples else {}
    unique = dedup(plan)
    tensors: dict[str, torch.Tensor] = {}
    graphs: dict[str, bytes] = {}
    fallbacks: dict[str, str] = {}
    for fp, representative in unique.unique.items():
        parts = [i.partition for i in unique.instances_of(fp) if i.partition in names]
        if not parts:
            continue
        recipe = options.partition_quantization(representative, options.precision_of(representative))
        # Scales compiled into the engine (TensorRT, Inductor): each instance is its own graph and engine.
        for group in [[p] for p in parts] if recipe["scales"] == "graph" else [parts]:
            try:
                recipe_module = recipe_for(recipe["graph"])
                graph, own = recipe_module.quantize_fingerprint(RecipeCall(plan, group, feeds, recipe, fp))
            except Exception as exc:  # ONNX Runtime's quantizer raises any type
                reason = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
                fallbacks.update({name: reason for name in group})
                continue
            graphs[group[0]] = graph
            tensors.update(own)
    levels = {**options.partition_precision, **dict.fromkeys(fallbacks, FALLBACK_PRECISION)}
    if only is not None:  # the others as they were; the record keeps naming every quantized partition
        kept = {
            k: v for k, v in plan.quantized.items() if k[len(QUANTIZED_PREFIX) :].split("/")[0] not in names
        }
        tensors = {**kept, **tensors}
        graphs = {**{k: v for k, v in plan.quantized_graphs.items() if k not in names}, **graphs}
        earlier = QuantizationRecord.from_dict(plan.quantization) if plan.quantization else None
        if earlier is not None:
            fallbacks = {**{k: v for k, v in earlier.fallbacks.items() if k not in names}, **fallbacks}
            names = [*earlier.partitions, *(n for n in names if n not in earlier.partitions)]
    settings = options.quantization_settings(
        options.precision if options.precision in QUANTIZED_PRECISIONS else "int8"
    )
    record = QuantizationRecord(
        mode=options.quantization,
        method=settings.get("method"),
        per_channel=bool(settings["per_channel"]),
        data_source=dataset.source if dataset is not None else None,
        samples=len(samples),
        sample_digests=tuple(sample_digest(s) for s in samples),
        partitions=tuple(n for n in names if n not in fallbacks),
        fallbacks=fallbacks,
        warnings=tuple(notes),
        seconds=round(time.perf_counter() - start, 4),
    )
    return dataclasses.replace(
        plan,
        options=dataclasses.replace(options, partition_precision=levels),
        quantized=tensors,
        quantized_graphs=graphs,
        quantization=record.to_dict(),
    )


def recipe_for(graph: str) -> ModuleType:
    """The recipe module for a kind of quantized graph (``CompileOptions.quantization_settings()``'s
    ``graph``). Each has one entry point, ``quantize_fingerprint(RecipeCall)``
    (:mod:`compiler.quantization.recipe`)."""
    if graph == PT2E_GRAPH:  # Inductor int8 on the CPU: torchao's PT2E flow
        from compiler.quantization import pt2e as module
    elif graph in ROWWISE_GRAPHS.values():  # Inductor on CUDA: torchao's dynamic rowwise recipes
        from compiler.quantization import rowwise as module
    else:  # ONNX Runtime and TensorRT: ONNX Runtime's quantizer
        from compiler.quantization import onnxruntime as module
    return module


def calibration_samples(
    plan: PartitionPlan,
    data: str | os.PathLike | Mapping[str, object] | ValidationData | None = None,
    seed: int = 0,
) -> tuple[ValidationData, list[str]]:
    """The calibration inputs and the warnings about them; a :class:`CalibrationError` naming the
    field when they cannot be used."""
    calibration = plan.options.calibration
    source = data if data is not None else calibration.data
    if source is None:
        if not calibration.allow_random:
            raise CalibrationError(
                "calibration.data: precision int8 (static quantization) needs recorded inputs to set its "
                "scales (a .safetensors or .npz file, one array per model input with a leading sample "
                "axis); random inputs give meaningless scales. Set calibration.data, use quantization: "
                "dynamic, or set calibration.allow_random: true (tests only)"
            )
        dataset = random_data(plan.specs, calibration.samples, seed)
    else:
        try:
            dataset = validation_data(
                plan.specs,
                source,
                samples=calibration.samples,
                seed=seed,
                ignore_fields=calibration.ignore_fields,
                ignore_option="calibration.ignore_fields",
            )
        except ValidationDataError as exc:
            raise CalibrationError(f"calibration.data: {exc}") from exc
    chosen = dataset.samples[: calibration.samples]
    for index, sample in enumerate(chosen):
        for spec, tensor in zip(plan.specs, sample, strict=True):
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                raise CalibrationError(
                    f"calibration.data: input {spec.name!r} of sample {index} holds NaN or inf "
                    f"({dataset.source}); calibration ranges must be finite"
                )
    notes = [f"calibration.data: {line}" for line in dataset.skipped]
    if len(chosen) < calibration.samples:
        note = (
            f"calibration.data: {len(chosen)} usable sample(s) where calibration.samples asks for "
            f"{calibration.samples}; scales from few samples may clip real inputs"
        )
        warnings.warn(note, CalibrationWarning, stacklevel=2)
        notes.append(note)
    return ValidationData(dataset.source, tuple(chosen), dataset.skipped), notes


def _captured(
    plan: PartitionPlan, samples: Sequence[Sequence[torch.Tensor]], names: Sequence[str]
) -> dict[str, list[dict[str, np.ndarray]]]:
    """Partition -> one feed (engine input name -> array) per sample: the activations reaching it when
    the whole graph runs in fp32 PyTorch."""
    device = plan.options.device
    weights = plan.weights()
    # The runtime's own feed (CompiledModule): no program read for a plan loaded from a package.
    template = [None if key is None else weights[key] for key in plan.signature.inputs]
    feeds: dict[str, list[dict[str, np.ndarray]]] = {name: [] for name in names}
    by_name = {p.name: p for p in plan.partitions}

    def hook(name: str):
        positions = [i for i, src in enumerate(by_name[name].inputs) if src.kind == "activation"]

        def capture(module: torch.nn.Module, args: tuple) -> None:
            feeds[name].append({f"x{k}": to_numpy(args[i]).copy() for k, i in enumerate(positions)})

        return capture

    handles = [plan.submodule(name).register_forward_pre_hook(hook(name)) for name in names]
    try:
        with custom_op_lock(plan.graph_module), torch.no_grad():
            for sample in samples:
                user = iter(t.to(device) for t in sample)
                plan.graph_module(*[next(user) if value is None else value for value in template])
    finally:
        for handle in handles:
            handle.remove()
    return feeds
