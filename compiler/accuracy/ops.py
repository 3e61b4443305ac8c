"""Ops of an fp16/bf16 partition, measured for accuracy repair's layer search (issue 46): the same search
as int8's (:mod:`compiler.accuracy.layers`), over the ops of the partition's torch graph instead of the
quantizer's nodes, each kept in fp32 by :mod:`compiler.engine_build.float_ops`.

:class:`OpProbe` runs the partition's engine module (what lowering gives every backend: the graph
retyped to the precision, the chosen ops in fp32) in PyTorch on the validation samples' activations at
its inputs: the error of a set of ops in fp32 costs one eager run, no build. Eager bf16 rounds after
every op where a compiler may fuse several in fp32 registers (Inductor), so its errors are upper
bounds: they rank ops and guess counts; each set chosen is rebuilt by the backend and validated.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from compiler.engine_build.float_ops import candidates, fp32_weights, op_flops
from compiler.engine_build.lower import _EngineGraph, engine_io
from compiler.engine_build.weights import PRECISION_DTYPES
from compiler.partitioning.partition import PartitionPlan
from compiler.quantization.layers import Layer, LayerSensitivity, relative_error
from compiler.quantization.torch_layers import graph_layers, weights_device

REDUCED_FLOATS = ("fp16", "bf16")


class OpProbe:
    """One fp16/bf16 partition's ops and what keeping each in fp32 does to its output error (vs fp32).

    ``feeds``: one dict (``x0..xk`` -> array) per evaluation sample, captured at the partition's inputs."""

    def __init__(self, plan: PartitionPlan, name: str, feeds: Sequence[Mapping[str, np.ndarray]]) -> None:
        self.partition = next(p for p in plan.partitions if p.name == name)
        self.precision = plan.options.precision_of(name)
        self.dtype = PRECISION_DTYPES[self.precision]
        self.sub = plan.submodule(name)
        self.kinds = [i.kind for i in self.partition.inputs]
        self.out_dtypes = engine_io(plan, self.partition).output_dtypes
        self.device = torch.device(plan.options.device)
        every = plan.weights()
        self.weights = [every[key].detach().to(self.device) for key in self.partition.weight_keys]
        self.feeds = [
            [torch.from_numpy(np.asarray(f[f"x{k}"])).to(self.device) for k in range(len(f))] for f in feeds
        ]
        self.reference = self._outputs(self._module((), "fp32"))
        first = self.feeds[0] if self.feeds else None
        self.layers = graph_layers(plan, name, [n for n, _ in candidates(self.sub)], first)
        self.full_error = self.error_without(())
        self._names: list[str] | None = None

    def _module(self, names: Sequence[str], precision: str | None = None) -> tuple[Any, list]:
        precision = precision or self.precision
        module = _EngineGraph(self.sub, self.kinds, precision, self.out_dtypes, tuple(names))
        kept = fp32_weights(self.sub, self.kinds, names) if precision != "fp32" else set()
        dtype = PRECISION_DTYPES[precision]
        weights = [
            w.to(torch.float32 if i in kept else dtype) if w.is_floating_point() else w
            for i, w in enumerate(self.weights)
        ]
        return module, weights

    def _outputs(self, built: tuple[Any, list]) -> list[list[np.ndarray]]:
        module, weights = built
        with torch.no_grad():
            return [
                [o.detach().float().cpu().numpy() for o in module(*feed, *weights)] for feed in self.feeds
            ]

    def error_without(self, names: Sequence[str]) -> float:
        """The partition's relative L2 error vs fp32 with the ops ``names`` kept in fp32 (``inf`` where
        an output is not finite: an overflow)."""
        return relative_error(self._outputs(self._module(names)), self.reference)

    def gain(self, layer: Layer) -> LayerSensitivity:
        """The error ``layer`` adds alone: the partition's error with every other op in fp32. Not, as
        int8's, every other op at the low precision less this one: kept in fp32 alone, an op still
        reads and writes bf16 tensors, so on a bf16 BERT every op but one LayerNorm measured ~0 so,
        while the errors each op adds alone roughly add up (no scales shared between ops)."""
        if self._names is None:
            self._names = [x.name for x in self.layers]
        return LayerSensitivity(layer, self.error_without([n for n in self._names if n != layer.name]))

    def close(self) -> None:
        pass


def float_kept(initial: Any, final: Any, dataset: Any, precision: str) -> dict[str, Any] | None:
    """Of the partitions compiled at fp16/bf16: the share of weight elements stored and of GEMM/
    convolution FLOPs run at ``precision`` after repair (ops kept in fp32, partitions raised whole),
    as :func:`compiler.accuracy.mixed.kept_fractions` counts int8's."""
    from compiler.quantization.quantize import _captured

    plan = initial.plan
    asked = [p.name for p in plan.partitions if plan.options.precision_of(p.name) == precision]
    if not asked or not dataset.samples:
        return None
    feeds = _captured(plan, dataset.samples[:1], asked)
    weights_low = weights_total = flops_low = flops_total = 0
    for name in asked:
        partition = next(p for p in plan.partitions if p.name == name)
        sub = plan.submodule(name)
        kinds = [i.kind for i in partition.inputs]
        every = plan.weights()
        sizes = [every[k].numel() if every[k].is_floating_point() else 0 for k in partition.weight_keys]
        device = weights_device(plan)  # the captured activations are host arrays; run beside the weights
        acts = iter(torch.from_numpy(np.asarray(v)).to(device) for v in feeds[name][0].values())
        tensors = iter(every[k] for k in partition.weight_keys)
        args = tuple(next(acts) if kind == "activation" else next(tensors) for kind in kinds)
        flops = op_flops(sub, args)
        weights_total += sum(sizes)
        flops_total += sum(flops.values())
        if final.plan.options.precision_of(name) != precision:
            continue  # raised whole
        ops = set(final.plan.options.float_ops(name))
        kept = fp32_weights(sub, kinds, ops)
        weights_low += sum(s for i, s in enumerate(sizes) if i not in kept)
        flops_low += sum(f for op, f in flops.items() if op not in ops)
    return {
        "precision": precision,
        "weights": round(weights_low / weights_total, 4) if weights_total else None,
        "flops": round(flops_low / flops_total, 4) if flops_total else None,
        "weights_int8": weights_low,  # the same keys as int8's record: "int8" reads "at the precision"
        "weights_total": weights_total,
        "flops_int8": flops_low,
        "flops_total": flops_total,
    }
