"""Layers of an int8/fp8 partition that Inductor quantizes in its torch graph (issue 46): torchao's PT2E
flow on the CPU (:mod:`compiler.quantization.pt2e`) and the dynamic rowwise GEMMs on CUDA
(:mod:`compiler.quantization.rowwise`).

A layer here is a node of the partition's own graph, named by its position in it (``n42``,
:func:`compiler.engine_build.float_ops.named`): the unit ``CompileOptions.float_layers`` holds for every
Inductor partition, as for an fp16/bf16 partition's ops. Each recipe leaves the layers named there in
float by its own mechanism: the x86 quantizer is told to (``set_module_name_qconfig(name, None)``) and
their embedding lookups keep the float table; the rowwise rewrite skips their linears.

:class:`TorchLayerProbe` takes the measurements accuracy repair's layer search ranks by
(:mod:`compiler.accuracy.layers`), as :class:`compiler.quantization.layers.LayerProbe` does for ONNX
Runtime's quantizer: the recipe's own quantized module run in PyTorch (PT2E's converted graph with its
Q/DQ ops; the rewritten rowwise graph with its GEMMs) on the validation samples' activations at the
partition's inputs, against its float graph. Inductor's fused int8 kernels round a little differently
from those eager ops: the errors rank layers and guess counts; each set chosen is rebuilt and validated.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from compiler.backends.capabilities import PT2E_GRAPH, ROWWISE_GRAPHS
from compiler.engine_build.float_ops import named, op_flops
from compiler.partitioning.partition import PartitionPlan
from compiler.quantization.layers import GraphAccount, Layer, LayerSensitivity, added_error, relative_error

TORCH_GRAPHS = (PT2E_GRAPH, *ROWWISE_GRAPHS.values())
# Ops whose weight a layer stores at low precision when quantized (a matmul's or a product's inputs are
# activations: its FLOPs count, no weight).
WEIGHT_OPS = ("linear", "conv1d", "conv2d", "convolution", "embedding")


def is_torch_graph(recipe: Mapping[str, Any] | None) -> bool:
    """Whether a partition of this recipe is quantized in its torch graph (Inductor)."""
    return bool(recipe) and recipe.get("graph") in TORCH_GRAPHS


def graph_layers(
    plan: PartitionPlan, name: str, names: Collection[str], activations: Sequence[torch.Tensor] | None
) -> list[Layer]:
    """The nodes ``names`` of partition ``name``'s graph as layers: op, the largest weight each reads
    (its key, elements), and GEMM/convolution FLOPs at ``activations``' shapes (0 without them)."""
    partition = next(p for p in plan.partitions if p.name == name)
    sub = plan.submodule(name)
    every = plan.weights()
    weights = [every[key] for key in partition.weight_keys]
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    weight_of, index = {}, 0
    for node, source in zip(placeholders, partition.inputs, strict=True):
        if source.kind == "weight":
            weight_of[node] = (partition.weight_keys[index], weights[index].numel())
            index += 1
    flops: dict[str, int] = {}
    if activations is not None:
        device = weights_device(plan)
        acts = iter(a.to(device) for a in activations)
        tensors = iter(w.detach().to(device) for w in weights)
        kinds = [i.kind for i in partition.inputs]
        args = tuple(next(acts) if k == "activation" else next(tensors) for k in kinds)
        flops = op_flops(sub, args)
    wanted = set(names)
    layers = []
    for canonical, node in named(sub):
        if canonical not in wanted:
            continue
        read = [weight_of[a] for a in node.all_input_nodes if a in weight_of]
        layers.append(
            Layer(
                canonical,
                str(node.target).replace("aten.", "").removesuffix(".default"),
                max(read, key=lambda r: r[1])[0] if read else "",
                sum(r[1] for r in read),
                flops.get(canonical, 0),
            )
        )
    return layers


def weights_device(plan: PartitionPlan) -> torch.device:
    """Where the plan holds its weights (the device its program was exported on): what a probe runs on."""
    return next((t.device for t in plan.weights().values()), torch.device(plan.options.device))


def quantized_layers(plan: PartitionPlan, name: str) -> list[str]:
    """The canonical names of the nodes partition ``name``'s recipe quantizes."""
    return _model(plan, name).names


def torch_account(
    plan: PartitionPlan, name: str, activations: Sequence[torch.Tensor], float_layers: Collection[str]
) -> GraphAccount:
    """What partition ``name`` holds at low precision with ``float_layers`` kept in float, counted
    from its graph: weights (elements) its quantized layers store int8/fp8, of every float weight it
    holds; GEMM/convolution FLOPs of those layers, of all (at ``activations``' shapes)."""
    names = quantized_layers(plan, name)
    every = graph_layers(plan, name, [n for n, _ in named(plan.submodule(name))], activations)
    low = [x for x in every if x.name in set(names) - set(float_layers)]
    partition = next(p for p in plan.partitions if p.name == name)
    weights = plan.weights()
    sizes = {k: weights[k].numel() for k in partition.weight_keys if weights[k].is_floating_point()}
    stored = {x.weight for x in low if op_name_of(x) in WEIGHT_OPS and x.weight in sizes}
    return GraphAccount(
        sum(sizes[k] for k in stored),
        sum(s for s in sizes.values() if s > 1),
        sum(x.flops for x in low),
        sum(x.flops for x in every),
    )


def op_name_of(layer: Layer) -> str:
    return layer.op.split(".")[0]


class TorchLayerProbe:
    """One Inductor int8/fp8 partition's layers and what keeping each in float does to its output error
    (vs its float graph), the interface of :class:`~compiler.quantization.layers.LayerProbe`.

    ``calibration``/``evaluation``: feeds (``x0..xk`` -> array) captured at the partition's inputs;
    calibration only sets PT2E's scales (rowwise scales are dynamic)."""

    def __init__(
        self,
        plan: PartitionPlan,
        name: str,
        calibration: Sequence[Mapping[str, np.ndarray]],
        evaluation: Sequence[Mapping[str, np.ndarray]],
    ) -> None:
        self.model = _model(plan, name)
        self.calibration = [dict(f) for f in calibration]
        self.evaluation = [
            tuple(torch.from_numpy(np.asarray(f[f"x{k}"])).to(self.model.device) for k in range(len(f)))
            for f in evaluation
        ]
        self.reference = self._outputs(self.model.reference())
        first = self.evaluation[0] if self.evaluation else None
        self.layers = graph_layers(plan, name, self.model.names, first)
        self.full_error = self.error_without(())

    def _outputs(self, module: Callable[..., Any]) -> list[list[np.ndarray]]:
        with torch.no_grad():
            return [
                [o.detach().float().cpu().numpy() for o in torch.utils._pytree.tree_leaves(module(*acts))]
                for acts in self.evaluation
            ]

    def error_without(self, names: Sequence[str]) -> float:
        """The partition's relative L2 error vs its float graph with the layers ``names`` in float."""
        return relative_error(self._outputs(self.model.quantized(names, self.calibration)), self.reference)

    def gain(self, layer: Layer) -> LayerSensitivity:
        """The error ``layer`` adds on top of every other layer quantized (what repair ranks by)."""
        return LayerSensitivity(layer, added_error(self.full_error, self.error_without([layer.name])))

    def sensitivity(self, layer: Layer) -> LayerSensitivity:
        """The error ``layer`` adds quantized alone: every other layer in float."""
        return LayerSensitivity(layer, self.error_without([n for n in self.model.names if n != layer.name]))

    def close(self) -> None:
        pass


def _model(plan: PartitionPlan, name: str) -> _Pt2eModel | _RowwiseModel:
    recipe = plan.options.partition_quantization(name, plan.options.precision_of(name)) or {}
    if recipe.get("graph") == PT2E_GRAPH:
        return _Pt2eModel(plan, name, bool(recipe.get("reduce_range")))
    if recipe.get("graph") in ROWWISE_GRAPHS.values():
        return _RowwiseModel(plan, name)
    raise ValueError(f"{name}: its recipe ({recipe.get('graph')}) is not quantized in its torch graph")


class _Pt2eModel:
    """PT2E: the partition exported once; each variant quantized and calibrated from it."""

    def __init__(self, plan: PartitionPlan, name: str, reduce_range: bool) -> None:
        from compiler.quantization.pt2e import Exported

        self.base, self.reduce_range = Exported.of(plan, name), reduce_range
        self.names = self.base.layers()
        self.device = self.base.device

    def reference(self) -> Callable[..., Any]:
        return self.base.module

    def quantized(self, float_layers: Collection[str], calibration: Sequence[Mapping]) -> Callable[..., Any]:
        return self.base.converted(calibration, float_layers, reduce_range=self.reduce_range)


class _RowwiseModel:
    """Rowwise: the partition's graph rewritten with the recipe's GEMMs (no calibration)."""

    def __init__(self, plan: PartitionPlan, name: str) -> None:
        from compiler.quantization.rowwise import RECIPES, layers

        self.plan, self.name = plan, name
        self.recipe = RECIPES[plan.options.precision_of(name)]
        self.names = layers(plan, name)
        self.device = weights_device(plan)

    def _bound(self, precision: str, rewritten: Any, weights: Sequence[torch.Tensor]) -> Callable[..., Any]:
        from compiler.engine_build.lower import _engine_module, engine_io

        partition = next(p for p in self.plan.partitions if p.name == self.name)
        io_spec = engine_io(self.plan, partition)
        module = _engine_module(self.plan, partition, precision, io_spec, rewritten)[0]
        tensors = [w.to(self.device) for w in weights]
        return lambda *acts: module(*acts, *tensors)

    def reference(self) -> Callable[..., Any]:
        partition = next(p for p in self.plan.partitions if p.name == self.name)
        every = self.plan.weights()
        return self._bound("fp32", None, [every[k].detach() for k in partition.weight_keys])

    def quantized(self, float_layers: Collection[str], calibration: Sequence[Mapping]) -> Callable[..., Any]:
        from compiler.quantization.rowwise import _rewritten, instance_tensors

        graph, kinds, eligible = _rewritten(self.plan, self.name, self.recipe, float_layers)
        weights = instance_tensors(self.plan, self.name, self.recipe, eligible)
        compute = self.plan.options.compute_precision(self.name)
        return self._bound(compute, (graph, kinds), weights)
