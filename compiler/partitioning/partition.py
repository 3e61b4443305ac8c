"""Partition: which nodes run in engines and which fall back to PyTorch.

Capability-based over the core ATen graph with torch.fx's ``CapabilityBasedPartitioner``:
a node goes into an engine when the backend supports its op and the user did not force it to
PyTorch (``torch_executed_ops``); partitions with fewer than ``min_block_size`` compute ops fall back.
Opt-in, partitions are also cut at instances of a repeated module (``split_modules``) so that each
transformer block becomes its own engine and dedup can build one per unique block.

Weights stay graph inputs (lifted placeholders): a partition's inputs are either activations or
weights, which lowering turns into canonically named initializers.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.fx.passes.infra.partitioner import CapabilityBasedPartitioner
from torch.fx.passes.operator_support import OperatorSupportBase
from torch.fx.passes.utils.fuser_utils import fuse_by_partitions

from compiler.backends import get_backend
from compiler.backends.onnx_support import op_name
from compiler.errors import KilnError, OptionsError, PackageError, PartitionError
from compiler.inputs.profiles import check_profiles
from compiler.inputs.specs import InputSpec
from compiler.options import CompileOptions
from compiler.partitioning.blocks import split_by_block
from compiler.partitioning.prepare import prepared_copy
from compiler.partitioning.runtime_graph import CallSignature, RuntimeGraph
from compiler.program.export import input_specs
from compiler.program.symbolic import SYMBOLIC_OPS, is_symbolic
from compiler.program.tracing import TRACING

# Weight keys of quantized partitions' own tensors: "kiln.int8/<partition>/w<k>" (PartitionPlan.quantized).
QUANTIZED_PREFIX = "kiln.int8/"

ENGINE_PREFIX = "engine_"
_WEIGHT_KINDS = (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR)


@dataclass(frozen=True)
class PartitionInput:
    """One input of an engine partition: the parent-graph node feeding it, and whether it is a weight."""

    node: str
    kind: str  # "activation" | "weight"
    weight_key: str | None = None


@dataclass(frozen=True)
class Partition:
    name: str
    nodes: tuple[str, ...]
    inputs: tuple[PartitionInput, ...]
    num_outputs: int
    ops: Mapping[str, int]
    block: str | None = None

    @property
    def weight_keys(self) -> tuple[str, ...]:
        return tuple(i.weight_key for i in self.inputs if i.kind == "weight")

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "nodes": list(self.nodes),
            "block": self.block,
            "ops": dict(self.ops),
            "num_outputs": self.num_outputs,
            "inputs": [vars(i) for i in self.inputs],
        }


@dataclass
class PartitionPlan:
    """The program, its split graph (engine partitions as submodules) and what falls back.

    ``program`` is read on first use where a package load ran from its runtime graph
    (``compiler.partitioning.runtime_graph``): ``read_program`` reads it then, and it gets the plan's
    weights."""

    specs: tuple[InputSpec, ...]
    options: CompileOptions
    graph_module: torch.fx.GraphModule
    partitions: tuple[Partition, ...]
    fallback_ops: dict[str, int]
    symbols: dict[str, tuple[str, int, int, int]] = field(default_factory=dict)
    seconds: float = 0.0
    # User inputs that are really weights (the torch.compile path lifts parameters to inputs).
    input_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    # Quantized partitions (compiler.quantize): each instance's own engine tensors (quantized weights,
    # scales, zero points) under "<QUANTIZED_PREFIX><partition>/w<k>", refitted like weights; the
    # quantized graph of each int8 structure, by the partition it was made from (what its engine is
    # built from, for every instance of that structure; not saved in packages,
    # whose engines hold it); and what quantization did (QuantizationRecord.to_dict()).
    quantized: dict[str, torch.Tensor] = field(default_factory=dict)
    quantized_graphs: dict[str, bytes] = field(default_factory=dict)
    quantization: dict | None = None
    # Weights a package left out (compiler.save(int8_weights_only=True)): only int8 engines read them.
    elided_weights: frozenset[str] = frozenset()
    # Weights a package stored at their engines' precision (compiler.save(engine_precision_weights=True)),
    # key -> that dtype: held so (the program, where read, gets them at its own dtype).
    reduced_weights: dict[str, torch.dtype] = field(default_factory=dict)
    # How a call reaches the split graph, and the program's lifted weights by key (what it is fed).
    signature: CallSignature | None = None
    program_weights: dict[str, torch.Tensor] = field(default_factory=dict)
    read_program: Callable[[], ExportedProgram] | None = field(default=None, repr=False)
    _program: ExportedProgram | None = field(default=None, repr=False)
    # Whether graph_module's nodes carry torch.export's metadata (shapes, dtypes: what fingerprints,
    # lowering and quantization read). A package's runtime graph does not: describe() adds it.
    described: bool = True
    origin: str = ""  # where a plan read back from a package came from, for its errors

    def __post_init__(self) -> None:
        if self._program is not None:
            self.program = self._program

    @property
    def program(self) -> ExportedProgram:
        if self._program is None:
            if self.read_program is None:
                raise PartitionError("this plan has neither its program nor a way to read it")
            self._program = with_weights(self.read_program(), self.program_weights)
        return self._program

    @program.setter
    def program(self, program: ExportedProgram) -> None:
        self._program = program
        self.program_weights = program_weights(program)
        self.signature = CallSignature.of(program)

    def reweighted(self, state: Mapping[str, torch.Tensor]) -> PartitionPlan:
        """A copy of the plan with ``state`` over its weights (the program's lifted ones and user inputs
        that are weights); its program, where already read, carries them too."""
        plan = copy.copy(self)
        own = {k: v for k, v in state.items() if k in self.program_weights}
        plan.program_weights = {**self.program_weights, **own}
        plan.input_weights = {**self.input_weights, **{k: v for k, v in state.items() if k not in own}}
        if self._program is not None:
            plan._program = with_weights(self._program, own)
        return plan

    def submodule(self, name: str) -> torch.fx.GraphModule:
        """A partition's graph, with its node metadata (:meth:`describe`)."""
        self.describe()
        return getattr(self.graph_module, name)

    def describe(self) -> None:
        """Give the split graph its node metadata where it came from a package's runtime graph.

        A load runs from the runtime graph, which holds no shapes or dtypes (they cost its cold start).
        What rebuilds, re-fingerprints, quantizes or compares a partition needs them: the plan is then
        replayed on the package's program, read on first use, and that graph replaces this one (same
        nodes, same partitions; modules already assembled keep their own copy)."""
        if self.described:
            return
        try:
            replayed = replay(self.program, self.to_dict())
        except KilnError as exc:
            raise PackageError(
                f"{self.origin or 'this package'}: its runtime graph carries no shapes or dtypes, and "
                f"replaying its plan on its program failed ({exc}); recompile the model, or re-save the "
                "package with this kiln"
            ) from exc
        self.graph_module, self.described = replayed.graph_module, True

    def float_weights_missing(self, partitions: Iterable[str]) -> list[str]:
        """Those of ``partitions`` whose float weights this plan lacks (left out of its package)."""
        by_name = {p.name: p for p in self.partitions}
        return [n for n in partitions if set(by_name[n].weight_keys) & self.elided_weights]

    def weights(self) -> dict[str, torch.Tensor]:
        """Every weight by key: the program's lifted weights, user inputs flagged as weights and the
        quantized partitions' own tensors."""
        return {**self.program_weights, **self.input_weights, **self.quantized}

    def to_dict(self) -> dict:
        data = {
            "options": self.options.to_dict(),
            "partitions": [p.to_dict() for p in self.partitions],
            "fallback_ops": dict(self.fallback_ops),
        }
        if self.quantization is not None:
            data["quantization"] = self.quantization
        return data


def partition(
    program: ExportedProgram,
    options: CompileOptions | None = None,
    *,
    input_weights: Mapping[str, torch.Tensor] | None = None,
) -> PartitionPlan:
    """Split ``program`` into engine partitions and a PyTorch fallback graph.

    ``input_weights`` names user inputs (placeholder name -> current value) that are weights: engines
    take them as canonically named constants, refitted from these values.
    """
    options = options or CompileOptions()
    start = time.perf_counter()
    specs = input_specs(program)
    check_profiles(specs, options.profiles)  # a bad profile fails before any build
    # Graph edits take the tracing lock: a node created while another thread exports gets that
    # trace's meta (torch.fx's preserved-meta state is process-wide), which fusing then refuses.
    with TRACING:
        gm = prepared_copy(program)
        support = _Support(get_backend(options.backend), _resolve_ops(options.torch_executed_ops))
        proposals = CapabilityBasedPartitioner(
            gm, support, allows_single_node_partition=True
        ).propose_partitions()
        groups = [sorted(p.nodes, key=_order(gm)) for p in proposals]
        blocks: dict[str, str | None] = {}
        if options.split_modules is not None:
            groups, blocks = split_by_block(gm, groups, options.split_modules)
        groups = [g for g in groups if _compute_count(g) >= options.min_block_size]
        seconds = time.perf_counter() - start
        return _fuse(program, specs, options, gm, groups, blocks, seconds, dict(input_weights or {}))


def replay(program: ExportedProgram, plan: Mapping[str, Any]) -> PartitionPlan:
    """Re-create a saved plan (``PartitionPlan.to_dict()``) on the same program, without re-deciding."""
    start = time.perf_counter()
    options = CompileOptions.from_dict(plan["options"])
    specs = input_specs(program)
    with TRACING:  # graph edits: see partition()
        gm = prepared_copy(program)
        by_name = {n.name: n for n in gm.graph.nodes}
        groups, blocks = [], {}
        for saved in plan["partitions"]:
            missing = [name for name in saved["nodes"] if name not in by_name]
            if missing:
                raise PartitionError(
                    f"partition {saved['name']} names nodes the program lacks: {missing[:5]}"
                )
            groups.append([by_name[name] for name in saved["nodes"]])
            blocks[saved["nodes"][0]] = saved.get("block")
        replayed = _fuse(program, specs, options, gm, groups, blocks, time.perf_counter() - start)
    replayed.quantization = plan.get("quantization")
    for saved, part in zip(plan["partitions"], replayed.partitions, strict=True):
        if [vars(i) for i in part.inputs] != saved["inputs"] or part.num_outputs != saved["num_outputs"]:
            raise PartitionError(
                f"partition {saved['name']} does not replay on this program (inputs or outputs differ); "
                "the package's program and plan disagree"
            )
    return replayed


def from_runtime_graph(
    graph: RuntimeGraph,
    specs: tuple[InputSpec, ...],
    plan: Mapping[str, Any],
    weights: Mapping[str, torch.Tensor],
    input_weights: Iterable[str],
    read_program: Callable[[], ExportedProgram],
    origin: str = "",
) -> PartitionPlan:
    """A saved plan (``PartitionPlan.to_dict()``) on its saved split graph, without the program: what
    a package load runs. Each partition must be called in the graph with the inputs it was saved with.
    ``weights``: the program's lifted weights by key (those the signature names); ``input_weights``: the
    user inputs that are weights."""
    start = time.perf_counter()
    nodes = graph.graph_module.graph.nodes
    calls = {n.target: n for n in nodes if n.op == "call_module"}
    placeholders = [n.name for n in nodes if n.op == "placeholder"]
    # What feeds each placeholder that is a weight: its key (user inputs that are weights: their name).
    keys = {name: key for name, key in zip(placeholders, graph.signature.inputs, strict=True) if key}
    keys.update({name: name for name in input_weights})
    partitions = []
    for saved in plan["partitions"]:
        call = calls.get(saved["name"])
        inputs = tuple(PartitionInput(**i) for i in saved["inputs"])
        sub = getattr(graph.graph_module, saved["name"], None)
        outputs = next((n.args[0] for n in sub.graph.nodes if n.op == "output"), ()) if sub else ()
        if (
            call is None
            or [a.name for a in call.args] != [i.node for i in inputs]
            or any(i.weight_key != keys.get(i.node) for i in inputs)
            or any((i.kind == "weight") != bool(i.weight_key) for i in inputs)
            or len(outputs) != saved["num_outputs"]
        ):
            raise PartitionError(
                f"partition {saved['name']} is not called in the saved graph as the plan records it"
            )
        partitions.append(
            Partition(
                saved["name"],
                tuple(saved["nodes"]),
                inputs,
                saved["num_outputs"],
                dict(saved["ops"]),
                saved.get("block"),
            )
        )
    return PartitionPlan(
        specs=specs,
        options=CompileOptions.from_dict(plan["options"]),
        graph_module=graph.graph_module,
        partitions=tuple(partitions),
        fallback_ops=dict(plan["fallback_ops"]),
        symbols=graph.symbols,
        signature=graph.signature,
        seconds=time.perf_counter() - start,
        quantization=plan.get("quantization"),
        program_weights={k: weights[k] for k in graph.signature.weight_keys()},
        read_program=read_program,
        described=False,
        origin=origin,
    )


def program_weights(program: ExportedProgram) -> dict[str, torch.Tensor]:
    weights: dict[str, torch.Tensor] = {}
    for spec in program.graph_signature.input_specs:
        if spec.kind in _WEIGHT_KINDS:
            source = program.state_dict if spec.target in program.state_dict else program.constants
            weights[spec.target] = source[spec.target]
    return weights


def with_weights(program: ExportedProgram, state: Mapping[str, torch.Tensor]) -> ExportedProgram:
    """A shallow copy of the program whose state dict / constants carry the given tensors."""
    if not state:
        return program

    def like(old: object, value: torch.Tensor) -> torch.Tensor:
        if not isinstance(old, torch.Tensor):
            return value
        # A weight a package stored at its engines' precision (reduced_weights) is run here at the
        # program's own dtype, as the graph was traced.
        if value.dtype != old.dtype and value.is_floating_point() and old.is_floating_point():
            value = value.to(old.dtype)
        # The program's verifier wants parameters to stay nn.Parameter.
        if isinstance(old, torch.nn.Parameter) and not isinstance(value, torch.nn.Parameter):
            return torch.nn.Parameter(value.detach(), requires_grad=False)
        return value

    new = copy.copy(program)
    new._state_dict = {
        **program.state_dict,
        **{k: like(program.state_dict[k], v) for k, v in state.items() if k in program.state_dict},
    }
    new._constants = {
        **program.constants,
        **{k: like(program.constants[k], v) for k, v in state.items() if k in program.constants},
    }
    return new


def weight_placeholders(program: ExportedProgram) -> dict[str, str]:
    """Placeholder name -> weight key for every lifted weight."""
    return {s.arg.name: s.target for s in program.graph_signature.input_specs if s.kind in _WEIGHT_KINDS}


class _Support(OperatorSupportBase):
    def __init__(self, backend: Any, forced: frozenset[Any]):
        self.backend, self.forced = backend, forced

    def is_node_supported(self, submodules: Mapping[str, torch.nn.Module], node: torch.fx.Node) -> bool:
        if node.op != "call_function" or node.target in self.forced:
            return False
        packet = getattr(node.target, "overloadpacket", None)
        if packet is not None and packet in self.forced:
            return False
        if is_symbolic(node):
            # A size goes where the op reading it goes (prepare gives each reader its own copy): one
            # merged into an engine whose reader stays in PyTorch (a higher-order op, a forced op) would
            # leave the engine as a SymInt output, which no engine returns.
            return all(self.is_node_supported(submodules, user) for user in node.users)
        return node.target in SYMBOLIC_OPS or bool(self.backend.supports(node.target))


def _resolve_ops(names: Iterable[str]) -> frozenset[Any]:
    """``aten.gelu`` (every overload) or ``aten.gelu.default`` -> op objects; unknown names fail loudly."""
    ops = set()
    for name in names:
        parts = name.removeprefix("torch.ops.").split(".")
        try:
            obj: Any = torch.ops
            for part in parts:
                obj = getattr(obj, part)
        except (AttributeError, RuntimeError):
            obj = None
        if not isinstance(obj, torch._ops.OpOverload | torch._ops.OpOverloadPacket):
            raise OptionsError(
                f"torch_executed_ops: {name!r} is not an ATen op; expected names like 'aten.gelu' or "
                "'aten.gelu.default'"
            )
        ops.add(obj)
    return frozenset(ops)


def _order(gm: torch.fx.GraphModule):
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    return lambda node: index[node]


def _compute_count(nodes: Iterable[torch.fx.Node]) -> int:
    return sum(1 for n in nodes if n.op == "call_function" and n.target not in SYMBOLIC_OPS)


def _fuse(
    program: ExportedProgram,
    specs: tuple[InputSpec, ...],
    options: CompileOptions,
    gm: torch.fx.GraphModule,
    groups: list[list[torch.fx.Node]],
    blocks: Mapping[str, str | None],
    seconds: float,
    input_weights: dict[str, torch.Tensor] | None = None,
) -> PartitionPlan:
    start = time.perf_counter()
    input_weights = input_weights or {}
    order = _order(gm)
    groups = sorted((sorted(g, key=order) for g in groups if g), key=lambda g: order(g[0]))
    names = [[n.name for n in g] for g in groups]
    ops = [Counter(op_name(n.target) for n in g if n.target not in SYMBOLIC_OPS) for g in groups]
    split = fuse_by_partitions(
        gm, [dict.fromkeys(g) for g in groups], prefix=ENGINE_PREFIX, always_return_tuple=True
    )
    weights = {**weight_placeholders(program), **{name: name for name in input_weights}}
    partitions = []
    for index, node_names in enumerate(names):
        name = f"{ENGINE_PREFIX}{index}"
        call = next(n for n in split.graph.nodes if n.op == "call_module" and n.target == name)
        inputs = []
        for arg in call.args:
            if not isinstance(arg.meta.get("val"), torch.Tensor):
                raise PartitionError(
                    f"partition {name} would take a non-tensor input {arg.name}; report this graph"
                )
            key = weights.get(arg.name)
            inputs.append(PartitionInput(arg.name, "weight" if key else "activation", key))
        outputs = next(n for n in getattr(split, name).graph.nodes if n.op == "output").args[0]
        partitions.append(
            Partition(
                name,
                tuple(node_names),
                tuple(inputs),
                len(outputs),
                dict(ops[index]),
                blocks.get(node_names[0]),
            )
        )
    unknown = sorted(set(options.partition_precision) - {p.name for p in partitions})
    if unknown:
        raise OptionsError(
            f"partition_precision names {unknown}, which this plan does not have; its partitions are "
            f"{[p.name for p in partitions]}"
        )
    fallback = Counter(
        op_name(n.target)
        for n in split.graph.nodes
        if n.op == "call_function" and n.target not in SYMBOLIC_OPS
    )
    return PartitionPlan(
        _program=program,
        specs=specs,
        options=options,
        graph_module=split,
        partitions=tuple(partitions),
        fallback_ops=dict(fallback),
        symbols=_symbols(program, specs),
        seconds=seconds + time.perf_counter() - start,
        input_weights=input_weights,
    )


def _symbols(program: ExportedProgram, specs: tuple[InputSpec, ...]) -> dict[str, tuple[str, int, int, int]]:
    """Each shape symbol of the program -> (dimension name, min, opt, max) from the specs."""
    names = set(program.graph_signature.user_inputs)
    nodes = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in names]
    symbols = {}
    for node, spec in zip(nodes, specs, strict=True):
        for axis, size in enumerate(node.meta["val"].shape):
            if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                symbols.setdefault(
                    str(size.node.expr),
                    (
                        spec.dynamic_dims.get(axis, str(size.node.expr)),
                        spec.min_shape[axis],
                        spec.opt_shape[axis],
                        spec.max_shape[axis],
                    ),
                )
    return symbols
