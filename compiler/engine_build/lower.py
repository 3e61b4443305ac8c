"""Lower: one partition -> the engine input its backend builds: an ONNX model through the official
torch.onnx exporter (ONNX Runtime, TensorRT: :func:`lower`, :func:`lower_float`), or an exported
program of the partition alone (Inductor: :func:`lower_program`, :func:`export_partition`); a quantized
partition's graph is the one its quantization recipe made.

Precision is put into the graph (strongly typed): floating activations are cast to fp16/bf16 at the
engine's entry and back at its exit, and weights are stored in that precision. Weights are exported as
graph *inputs* (so the exporter's optimizer cannot fold them into new, unnamed constants) and turned
into initializers named ``w0, w1, ...`` afterwards: two structurally equal partitions lower to the
same graph apart from initializer values, and refit maps canonical name -> tensor.
"""

from __future__ import annotations

import copy
import io
import math
import time
from dataclasses import dataclass

import onnx
import torch
from onnx import numpy_helper
from torch.export import Dim

from compiler.backends.base import EngineIO, pack_torch_graph, to_numpy
from compiler.engine_build.export_memo import export_key, exported
from compiler.engine_build.float_ops import raised
from compiler.engine_build.weights import PRECISION_DTYPES, engine_weights, kept_in_fp32, typed
from compiler.errors import LoweringError
from compiler.inputs.specs import InputSpec, dtype_name
from compiler.partitioning.dedup import DedupPlan, canonical_weights
from compiler.partitioning.partition import Partition, PartitionPlan
from compiler.program.tracing import quiet_trace


@dataclass(frozen=True)
class LoweredPartition:
    fingerprint: str
    onnx: bytes
    io: EngineIO
    seconds: float
    # For backends that compile the torch graph themselves (graph_format "torch.export"): the
    # partition's exported program and weights (compiler.backends.base.pack_torch_graph); onnx is empty.
    program: bytes = b""

    def graph(self, graph_format: str) -> bytes:
        """What a backend of ``graph_format`` builds from."""
        return self.program if graph_format == "torch.export" else self.onnx


def engine_io(plan: PartitionPlan, partition: Partition) -> EngineIO:
    """Activation inputs with min/opt/max shapes (the engine profile) and outputs, in call order."""
    sub = plan.submodule(partition.name)
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    inputs = []
    for node, source in zip(placeholders, partition.inputs, strict=True):
        if source.kind != "activation":
            continue
        val = node.meta["val"]
        shapes = {point: _concrete(val.shape, plan.symbols, point) for point in ("min", "opt", "max")}
        dims = {axis: str(d.node.expr) for axis, d in enumerate(val.shape) if _is_dynamic(d)}
        named = {axis: plan.symbols.get(expr, (expr,))[0] for axis, expr in dims.items()}
        inputs.append(
            InputSpec(
                f"x{len(inputs)}", dtype_name(val.dtype), shapes["min"], shapes["opt"], shapes["max"], named
            )
        )
    outputs = next(n for n in sub.graph.nodes if n.op == "output").args[0]
    dtypes = tuple(dtype_name(o.meta["val"].dtype) for o in outputs)
    return EngineIO(tuple(inputs), tuple(f"y{i}" for i in range(len(outputs))), dtypes)


def lower(plan: PartitionPlan, dedup: DedupPlan, fp: str) -> LoweredPartition:
    """ONNX bytes for the representative partition of fingerprint ``fp``, weights as initializers.

    A quantized partition's graph was made by ``compiler.quantize`` (from :func:`lower_float`): it is
    taken from the plan."""
    partition = next(p for p in plan.partitions if p.name == dedup.unique[fp])
    precision = plan.options.precision_of(partition.name)
    if precision in PRECISION_DTYPES:
        return lower_float(plan, partition, precision, fp)
    return LoweredPartition(fp, _quantized_graph(plan, dedup, fp), engine_io(plan, partition), 0.0)


def _quantized_graph(plan: PartitionPlan, dedup: DedupPlan, fp: str) -> bytes:
    """The graph ``compiler.quantize`` made for fingerprint ``fp`` (ONNX, or a program for Inductor)."""
    # Keyed by the partition quantize built it from: any instance of this structure has the same graph.
    graph = next(
        (
            plan.quantized_graphs[i.partition]
            for i in dedup.instances_of(fp)
            if i.partition in plan.quantized_graphs
        ),
        None,
    )
    if graph is None:
        name = dedup.unique[fp]
        raise LoweringError(
            f"{name} ({fp[:12]}) is {plan.options.precision_of(name)} but the plan holds no quantized graph "
            "for it; run compiler.quantize(plan) before building"
        )
    return graph


def lower_float(plan: PartitionPlan, partition: Partition, precision: str, fp: str = "") -> LoweredPartition:
    """ONNX bytes for ``partition`` in float ``precision`` with its own weights as initializers."""
    start = time.perf_counter()
    io_spec = engine_io(plan, partition)
    every = plan.weights()
    dtype = PRECISION_DTYPES[precision]
    kept = (
        kept_in_fp32(plan, partition.name)
        if precision == plan.options.precision_of(partition.name)
        else set()
    )
    ordered = sorted(canonical_weights(partition).items(), key=lambda item: int(item[0][1:]))
    weights = {
        name: typed(every[key], torch.float32 if int(name[1:]) in kept else dtype) for name, key in ordered
    }
    module, examples, act_shapes = _engine_module(plan, partition, precision, io_spec)
    args = examples + tuple(weights.values())
    dynamic_shapes = (act_shapes + tuple(None for _ in weights),)
    names = [s.name for s in io_spec.inputs] + list(weights)

    def export() -> onnx.ModelProto:
        try:
            with quiet_trace():
                program = torch.onnx.export(
                    module,
                    args,
                    dynamo=True,
                    dynamic_shapes=dynamic_shapes,
                    input_names=names,
                    output_names=list(io_spec.output_names),
                    external_data=False,
                    optimize=True,
                    verbose=False,
                )
        except Exception as exc:
            raise LoweringError(f"{partition.name} ({fp[:12]}) could not be exported to ONNX: {exc}") from exc
        return program.model_proto

    # Quantizing, the layer search and repair each lower an int8 partition in fp32: one export serves all.
    traced = {
        "precision": precision,
        "float_ops": module.float_ops,
        "io": io_spec,
        "examples": [(str(e.dtype), tuple(e.shape)) for e in examples],
        "dynamic_shapes": dynamic_shapes,
    }
    key = export_key(plan.submodule(partition.name).graph, module.kinds, plan.symbols, traced, weights)
    model = exported(key, export, (names, list(io_spec.output_names)))
    _weights_to_initializers(model, weights)
    _canonicalize(model)
    buffer = io.BytesIO()
    onnx.save_model(model, buffer)
    return LoweredPartition(fp, buffer.getvalue(), io_spec, time.perf_counter() - start)


def lower_program(plan: PartitionPlan, dedup: DedupPlan, fp: str) -> LoweredPartition:
    """The representative partition of ``fp`` as an exported program, for backends that compile torch
    graphs (Inductor): the same module ONNX lowering exports (activations then canonical weights as
    inputs, precision cast in the graph, dynamic dims with their ranges), on the model's device.

    A quantized partition's program was made by ``compiler.quantize`` (its weights compiled in): it is
    taken from the plan."""
    start = time.perf_counter()
    partition = next(p for p in plan.partitions if p.name == dedup.unique[fp])
    io_spec = engine_io(plan, partition)
    # Quantized: its instance's refit tensors (none where they are frozen into the program).
    weights = engine_weights(plan, dedup.instance(partition.name))
    if plan.options.precision_of(partition.name) not in PRECISION_DTYPES:
        program = _quantized_graph(plan, dedup, fp)
        return LoweredPartition(fp, b"", io_spec, 0.0, program=pack_torch_graph(program, weights))
    exported = export_partition(plan, partition, weights).program
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    graph = pack_torch_graph(buffer.getvalue(), weights)
    return LoweredPartition(fp, b"", io_spec, time.perf_counter() - start, program=graph)


@dataclass(frozen=True)
class ExportedPartition:
    """A partition exported on its own: the program, its example activations and their dynamic shapes
    (what exporting it again, e.g. after quantizing, needs)."""

    program: torch.export.ExportedProgram
    examples: tuple[torch.Tensor, ...]
    dynamic_shapes: tuple[dict[int, object] | None, ...]


def export_partition(
    plan: PartitionPlan,
    partition: Partition,
    weights: dict[str, torch.Tensor],
    *,
    bind_weights: bool = False,
    rewritten: tuple[torch.fx.GraphModule, list[str]] | None = None,
) -> ExportedPartition:
    """``partition`` exported in fp32-or-its-precision, its activations symbolic in their dynamic dims.
    Its weights are inputs after the activations, or, with ``bind_weights``, constants of the program
    (what freezing compilers such as Inductor's int8 path want). ``rewritten``: the partition's graph
    as a quantizer rewrote it, with the kind of each of its inputs ("activation" or "weight")."""
    precision = plan.options.compute_precision(partition.name)  # a quantized one's other ops
    module: torch.nn.Module
    # The user's module stack kept on each op: the program's repeated blocks (inductor/blocks.py)
    module, examples, act_shapes = _engine_module(
        plan, partition, precision, engine_io(plan, partition), rewritten, keep_module_stack=True
    )
    args, shapes = examples + tuple(weights.values()), act_shapes + tuple(None for _ in weights)
    if bind_weights:
        module, args, shapes = _BoundWeights(module, tuple(weights.values())), examples, act_shapes
    try:
        program = _export(module, args, shapes, rewritten=rewritten is not None)
    except Exception as exc:
        raise LoweringError(f"{partition.name} could not be exported: {exc}") from exc
    program._example_inputs = None  # torch.export.save would pickle them
    return ExportedPartition(program, examples, act_shapes)


def _export(
    module: torch.nn.Module, args: tuple, shapes: tuple, *, rewritten: bool
) -> torch.export.ExportedProgram:
    with quiet_trace():
        try:
            return torch.export.export(module, args, dynamic_shapes=(shapes,), strict=False)
        except torch._dynamo.exc.UserError as exc:
            if not rewritten or "Constraints violated" not in str(exc):
                raise
            # A quantizer's rewrite of a graph that exported over these ranges, whose own size arithmetic
            # torch could not prove a guard for (torch 2.11: int8 GEMMs padding their rows, one linear
            # kept in float, seq*(8+seq-seq%8) > 1): the guard becomes a check at run time, which holds
            # or raises. A float partition's violation stays an error: it may be a real specialization.
            return torch.export.export(
                module,
                args,
                dynamic_shapes=(shapes,),
                strict=False,
                prefer_deferred_runtime_asserts_over_guards=True,
            )


def _engine_module(
    plan: PartitionPlan,
    partition: Partition,
    precision: str,
    io_spec: EngineIO,
    rewritten: tuple[torch.fx.GraphModule, list[str]] | None = None,
    *,
    keep_module_stack: bool = False,
) -> tuple[_EngineGraph, tuple[torch.Tensor, ...], tuple[dict[int, object] | None, ...]]:
    """What an exporter traces for ``partition`` (its graph, or the one a quantizer rewrote, taking
    activations then weights, ``precision`` cast in), its example activations and their dynamic
    shapes: the same for the ONNX exporter and torch.export."""
    sub = plan.submodule(partition.name)
    kinds = [i.kind for i in partition.inputs]
    graph, graph_kinds = rewritten if rewritten is not None else (sub, kinds)
    ops = (
        plan.options.float_ops(partition.name)
        if precision == plan.options.precision_of(partition.name)
        else ()
    )
    module = _EngineGraph(graph, graph_kinds, precision, io_spec.output_dtypes, ops, keep_module_stack)
    act_nodes = [n for n, kind in zip(_placeholders(sub), kinds, strict=True) if kind == "activation"]
    examples = tuple(_example(n.meta["val"], plan.symbols) for n in act_nodes)
    dims: dict[str, Dim] = {}
    act_shapes = tuple(_dynamic_axes(n.meta["val"].shape, plan.symbols, dims) for n in act_nodes)
    return module, examples, act_shapes


class _BoundWeights(torch.nn.Module):
    """An engine graph with its weights held as its own: it takes the activations only. Float weights
    are parameters, as in the user's model (graph passes such as torchao's Conv+BatchNorm fold put
    their results back as parameters of the same name); others are buffers."""

    def __init__(self, graph: torch.nn.Module, weights: tuple[torch.Tensor, ...]):
        super().__init__()
        self.graph = graph
        for index, tensor in enumerate(weights):
            if tensor.is_floating_point():
                self.register_parameter(f"w{index}", torch.nn.Parameter(tensor, requires_grad=False))
            else:
                self.register_buffer(f"w{index}", tensor)
        self.count = len(weights)

    def forward(self, *activations: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.graph(*activations, *(getattr(self, f"w{i}") for i in range(self.count)))


class _EngineGraph(torch.nn.Module):
    """The partition as a module taking (activations..., weights...), precision cast in the graph."""

    def __init__(
        self,
        sub: torch.fx.GraphModule,
        kinds: list[str],
        precision: str,
        out_dtypes: tuple[str, ...],
        float_ops: tuple[str, ...] = (),
        keep_module_stack: bool = False,  # True for torch.export programs; ONNX keeps names as they were
    ):
        super().__init__()
        # Ops kept in fp32 (compiler.engine_build.float_ops), after the retyping that lowers the rest.
        self.sub = raised(_retyped(sub, PRECISION_DTYPES[precision]), float_ops, PRECISION_DTYPES[precision])
        self.kinds = kinds
        self.float_ops = tuple(float_ops)
        self.dtype = PRECISION_DTYPES[precision]
        self.out_dtypes = [getattr(torch, d) for d in out_dtypes]
        self.keep_module_stack = keep_module_stack

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n_act = self.kinds.count("activation")
        acts = iter(t.to(self.dtype) if t.is_floating_point() else t for t in tensors[:n_act])
        weights = iter(tensors[n_act:])
        args = [next(acts) if kind == "activation" else next(weights) for kind in self.kinds]
        if self.keep_module_stack:  # each traced op keeps the user's module stack (an Interpreter sets it)
            with torch.fx.traceback.preserve_node_meta():
                outs = torch.fx.Interpreter(self.sub).run(*args)
        else:
            outs = self.sub(*args)
        return tuple(o.to(d) if o.dtype != d else o for o, d in zip(outs, self.out_dtypes, strict=True))


def _retyped(sub: torch.fx.GraphModule, dtype: torch.dtype) -> torch.fx.GraphModule:
    """The partition with every float32 the graph names (casts, factory ops) turned into ``dtype``.

    The graph was traced in float32: its explicit casts and constants would otherwise put float32
    back in the middle of an fp16/bf16 engine, which strongly typed engines reject.
    """
    if dtype == torch.float32:
        return sub
    sub = copy.deepcopy(sub)
    largest = torch.finfo(dtype).max

    def swap(value: object) -> object:
        return dtype if value is torch.float32 else value

    def fit(value: object) -> object:
        # float32's extremes (HF's attention masks fill with torch.finfo(float32).min) overflow fp16:
        # torch raises "cannot be converted to type c10::Half without overflow". The dtype's own extreme
        # is what the model computes natively in fp16.
        if isinstance(value, float) and math.isfinite(value) and abs(value) > largest:
            return math.copysign(largest, value)
        return value

    for node in sub.graph.nodes:
        if node.op == "call_function":
            node.args = torch.fx.node.map_aggregate(node.args, swap)
            node.kwargs = torch.fx.node.map_aggregate(node.kwargs, swap)
            if getattr(node.target, "overloadpacket", None) in _STORES_SCALAR:
                node.args = torch.fx.node.map_aggregate(node.args, fit)
                node.kwargs = torch.fx.node.map_aggregate(node.kwargs, fit)
    sub.recompile()
    return sub


# Ops that store a Python scalar as an element of a tensor of the graph's dtype (arithmetic with a
# scalar computes in higher precision, so ``x / 1e5`` must keep its 1e5).
_STORES_SCALAR = {
    torch.ops.aten.full,
    torch.ops.aten.full_like,
    torch.ops.aten.new_full,
    torch.ops.aten.scalar_tensor,
    torch.ops.aten.fill,
    torch.ops.aten.fill_,
    torch.ops.aten.masked_fill,
    torch.ops.aten.masked_fill_,
    torch.ops.aten.where,
    torch.ops.aten.constant_pad_nd,
}


def _placeholders(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "placeholder"]


def _is_dynamic(size: object) -> bool:
    return isinstance(size, torch.SymInt) and not size.node.expr.is_number


def _concrete(shape: torch.Size, symbols: dict, point: str) -> tuple[int, ...]:
    index = {"min": 1, "opt": 2, "max": 3}[point]
    out = []
    for size in shape:
        if _is_dynamic(size):
            expr = size.node.expr
            out.append(int(expr.subs({s: symbols[str(s)][index] for s in expr.free_symbols})))
        else:
            out.append(int(size))
    return tuple(out)


def _example_value(lo: int, opt: int, hi: int) -> int:
    # Sizes 0 and 1 make the exporter specialize; trace at opt, nudged to >= 2 where the range allows.
    return opt if opt >= 2 else min(2, hi)


def _example(val: torch.Tensor, symbols: dict) -> torch.Tensor:
    shape = []
    for size in val.shape:
        if _is_dynamic(size):
            expr = size.node.expr
            shape.append(int(expr.subs({s: _example_value(*symbols[str(s)][1:]) for s in expr.free_symbols})))
        else:
            shape.append(int(size))
    # On the trace's device: the partition may create tensors there (masks, positions) to combine with these.
    device = val.device
    if val.dtype.is_floating_point:
        return torch.randn(shape, dtype=val.dtype, device=device)
    if val.dtype == torch.bool:
        return torch.ones(shape, dtype=torch.bool, device=device)
    return torch.zeros(shape, dtype=val.dtype, device=device)


def _dynamic_axes(shape: torch.Size, symbols: dict, dims: dict[str, Dim]) -> dict[int, object] | None:
    axes: dict[int, object] = {}
    for axis, size in enumerate(shape):
        if not _is_dynamic(size):
            continue
        expr = size.node.expr
        if expr.is_Symbol and str(expr) in symbols:
            name, lo, _, hi = symbols[str(expr)]
            dims.setdefault(
                str(expr), Dim(f"{name}_{expr}".replace("[", "_").replace("]", "_"), min=lo, max=hi)
            )
            axes[axis] = dims[str(expr)]
        else:
            axes[axis] = Dim.AUTO  # a derived size (e.g. batch*heads): let export relate it
    return axes or None


def _weights_to_initializers(model: onnx.ModelProto, weights: dict[str, torch.Tensor]) -> None:
    graph = model.graph
    keep = [inp for inp in graph.input if inp.name not in weights]
    del graph.input[:]
    graph.input.extend(keep)
    for name, tensor in weights.items():
        graph.initializer.append(numpy_helper.from_array(to_numpy(tensor), name))


def _canonicalize(model: onnx.ModelProto) -> None:
    """Name values by position and drop debug metadata (source paths, program symbols).

    Equal structures then lower to byte-identical graphs whatever module path or program they came from.
    """
    graph = model.graph
    keep = {i.name for i in graph.input} | {o.name for o in graph.output}
    keep |= {i.name for i in graph.initializer if i.name.startswith("w") and i.name[1:].isdigit()}
    names: dict[str, str] = {}

    def rename(name: str) -> str:
        if not name or name in keep:
            return name
        return names.setdefault(name, f"v{len(names)}")

    for init in graph.initializer:
        init.name = rename(init.name)
    for index, node in enumerate(graph.node):
        node.name = f"n{index}"
        node.doc_string = ""
        del node.metadata_props[:]
        node.input[:] = [rename(n) for n in node.input]
        node.output[:] = [rename(n) for n in node.output]
    for info in graph.value_info:
        info.name = rename(info.name)
        info.doc_string = ""
        del info.metadata_props[:]
    for value in list(graph.input) + list(graph.output):
        value.doc_string = ""
        del value.metadata_props[:]
    graph.doc_string = ""
    del graph.metadata_props[:]
    del model.metadata_props[:]
    model.doc_string = ""
