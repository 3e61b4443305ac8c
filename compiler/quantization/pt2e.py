"""Quantize one partition for Inductor: torchao's PT2E flow with its x86 Inductor quantizer.

``compiler.quantize`` calls :func:`quantize_program` once per int8 instance when the backend is
Inductor (``CompileOptions.quantization_settings``: scales and weights "frozen"):

1. The partition is exported with this instance's weights as constants of the program
   (``compiler.engine_build.lower.export_partition``): Inductor's int8 kernels are oneDNN's, whose weights are
   prepacked when the graph is frozen, so weights cannot stay inputs as in kiln's float engines.
2. ``X86InductorQuantizer`` (uint8 activations, per-channel int8 weights) annotates its linear and
   convolution nodes; ``prepare_pt2e`` puts min/max observers on them; the captured activations
   of this instance run through it; ``convert_pt2e`` folds the weights to int8.
3. Embedding tables, which the x86 recipe leaves in fp32, are stored int8 with per-row scales
   (weight-only; :func:`_int8_embeddings`).
4. The converted graph is exported again, symbolic in the same dynamic dims, and saved
   (``torch.export.save``): the engine's program, int8 weights and scales inside it.

Layers accuracy repair keeps in float (``CompileOptions.float_layers``, canonical node names of the
partition's graph: :class:`Exported`) are left out of step 2 by the quantizer's own switch
(``set_module_name_qconfig(name, None)``) and out of step 3.

Each instance is therefore its own program and engine (its graph's digest is in its fingerprint),
like TensorRT's compiled-in scales; nothing of it is refit, and stripping leaves nothing out.
"""

from __future__ import annotations

import copy
import dataclasses
import io
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from compiler.engine_build.float_ops import named
from compiler.engine_build.lower import ExportedPartition, export_partition
from compiler.errors import QuantizationError
from compiler.partitioning.dedup import canonical_weights
from compiler.partitioning.partition import PartitionPlan
from compiler.program.tracing import quiet_trace
from compiler.quantization.recipe import RecipeCall
from compiler.quantization.torchao_guard import import_torchao

# aten ops the x86 quantizer finds by their source (``get_source_partitions``), and the functional
# they come from. A partition's program is traced from a GraphModule, so its nodes record no
# ``nn.Linear``/``nn.Conv2d`` source (torch 2.11 has no fallback to ``nn_module_stack`` either): we
# name the functional ourselves, as strict export would.
_SOURCES = {
    torch.ops.aten.linear.default: torch.nn.functional.linear,
    torch.ops.aten.conv1d.default: torch.nn.functional.conv1d,
    torch.ops.aten.conv2d.default: torch.nn.functional.conv2d,
}
# The ops whose nodes may be layers: those the x86 recipe quantizes (its anchors: their inputs get Q/DQ)
# and the lookups kiln stores int8. Which of them are is the quantizer's call (Exported.layers).
LAYER_OPS = (
    *_SOURCES,
    torch.ops.aten.matmul.default,
    torch.ops.aten.mul.Tensor,
    torch.ops.aten.embedding.default,
)
FLOAT_MODULE = "kiln.float"  # the module name accuracy repair's float layers are tagged with
ANNOTATION = "quantization_annotation"  # torchao's node.meta key (QUANT_ANNOTATION_KEY)
INT8_TABLE = "kiln_int8_table"  # node.meta key of a lookup _int8_embeddings rewrote


def pt2e_available() -> str | None:
    """None where torchao's PT2E quantizer imports here; else why not (the install hint)."""
    try:
        import_torchao("torchao.quantization.pt2e.quantize_pt2e")
    except ImportError as exc:
        return f"torchao is not installed ({exc}); pip install 'kiln[int8-inductor]'"
    return None


def quantize_fingerprint(call: RecipeCall) -> tuple[bytes, dict[str, torch.Tensor]]:
    """The entry point every recipe module shares (:mod:`compiler.quantization.recipe`): the program of
    the first of the call's partitions quantized (:func:`quantize_program`), the layers its recipe names
    (``float_layers``: accuracy repair's choice) left in float; its weights are frozen in, so it has no
    tensors of its own. Scales are compiled in: each instance is quantized on its own."""
    name = call.parts[0]
    layers = call.recipe.get("float_layers", ())
    reduce_range = bool(call.recipe.get("reduce_range"))
    program = quantize_program(
        call.plan, name, call.feeds.get(name, []), float_layers=layers, reduce_range=reduce_range
    )
    return program, {}


def quantize_program(
    plan: PartitionPlan,
    name: str,
    feeds: Sequence[Mapping[str, np.ndarray]],
    *,
    float_layers: Collection[str] = (),
    reduce_range: bool = False,
) -> bytes:
    """The saved program of partition ``name`` quantized to int8 with its own weights frozen in,
    calibrated on ``feeds`` (its captured activations, ``x0..xk`` per sample), the layers
    ``float_layers`` (canonical names, :class:`Exported`) left in float, activations at 7 bits where
    ``reduce_range`` (the recipe's, see compiler/backends/capabilities.py). :class:`QuantizationError`
    where torchao is missing, nothing in it is quantizable, or no feed is given."""
    base = Exported.of(plan, name)
    converted = base.converted(feeds, float_layers, reduce_range=reduce_range)
    if not any(
        getattr(n.target, "namespace", None) == "quantized_decomposed" or n.meta.get(INT8_TABLE)
        for n in converted.graph.nodes
    ):
        raise QuantizationError(
            f"{name}: torchao's x86 quantizer found no linear or convolution to quantize, "
            "and it holds no embedding table"
            + (" (accuracy repair keeps the rest in float)" if float_layers else "")
        )
    exported = base.exported
    with quiet_trace(), torch.no_grad():
        program = torch.export.export(
            converted, exported.examples, dynamic_shapes=exported.dynamic_shapes, strict=False
        )
    program._example_inputs = None  # torch.export.save would pickle them
    for node in program.graph.nodes:  # provenance naming Python object ids: the same program, other bytes
        node.meta.pop("from_node", None)
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


@dataclass(frozen=True)
class Exported:
    """One partition exported for the x86 quantizer, its weights bound, with each node the recipe can
    quantize named canonically: by its position in the partition's own graph (``n42``,
    :func:`compiler.engine_build.float_ops.named`), the name ``CompileOptions.float_layers`` uses for
    every Inductor partition (int8 here and rowwise on CUDA, fp16/bf16 ops). The program's nodes of
    one op come in the partition graph's order (it is traced from that graph), so the k-th linear is
    the k-th linear of each."""

    exported: ExportedPartition
    module: torch.fx.GraphModule
    canonical: Mapping[str, str]  # the module's node name -> canonical name (layer ops only)
    device: torch.device

    @classmethod
    def of(cls, plan: PartitionPlan, name: str) -> Exported:
        partition = next(p for p in plan.partitions if p.name == name)
        missing = pt2e_available()
        if missing is not None:
            raise QuantizationError(f"{name}: {missing}")
        every = plan.weights()
        weights = {k: every[key].detach() for k, key in canonical_weights(partition).items()}
        exported = export_partition(plan, partition, weights, bind_weights=True)
        module = exported.program.module()
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target in _SOURCES:
                node.meta["source_fn_stack"] = [(node.name, _SOURCES[node.target])]
        own: dict[Any, list[str]] = {}
        for canonical, node in named(plan.submodule(name)):
            if node.op == "call_function" and node.target in LAYER_OPS:
                own.setdefault(node.target, []).append(canonical)
        found: dict[Any, list[str]] = {}
        for node in module.graph.nodes:
            if node.op == "call_function" and node.target in LAYER_OPS:
                found.setdefault(node.target, []).append(node.name)
        if any(len(own.get(op, ())) != len(found.get(op, ())) for op in LAYER_OPS):
            raise QuantizationError(f"{name}: its exported program's layers do not match its graph's")
        canonical = {n: c for op in found for n, c in zip(found[op], own[op], strict=True)}
        device = next((t.device for t in exported.examples), torch.device("cpu"))
        return cls(exported, module, canonical, device)

    def layers(self) -> list[str]:
        """The canonical names of the nodes the recipe quantizes: those the x86 quantizer annotates
        (the linears, convolutions, matmuls, same-shape products) and the embedding lookups of float
        tables (:func:`_int8_embeddings`), in graph order."""
        module = copy.deepcopy(self.module)
        _quantizer(module, ()).annotate(module)
        names = []
        for node in module.graph.nodes:
            annotation = node.meta.get(ANNOTATION)
            quantized = annotation is not None and bool(getattr(annotation, "input_qspec_map", None))
            if node.name in self.canonical and (quantized or _float_lookup(module, node)):
                names.append(self.canonical[node.name])
        return names

    def converted(
        self,
        feeds: Sequence[Mapping[str, np.ndarray]],
        float_layers: Collection[str] = (),
        *,
        reduce_range: bool = False,
    ) -> torch.fx.GraphModule:
        """The module quantized and calibrated on ``feeds``, ``float_layers`` left in float: the x86
        quantizer is told to leave them (``set_module_name_qconfig(name, None)``, its own way), and
        their embedding tables stay float."""
        if not feeds:
            raise QuantizationError("no calibration samples reached this partition")
        from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

        module = copy.deepcopy(self.module)
        kept = {n for n, c in self.canonical.items() if c in set(float_layers)}
        quantizer = _quantizer(module, kept, reduce_range=reduce_range)
        with quiet_trace(), torch.no_grad():
            prepared = prepare_pt2e(module, quantizer)
            for feed in feeds:
                prepared(*(torch.from_numpy(feed[f"x{k}"]).to(self.device) for k in range(len(feed))))
            converted = convert_pt2e(prepared)
        _int8_embeddings(converted, kept)
        return converted


def _quantizer(module: torch.fx.GraphModule, kept: Collection[str], *, reduce_range: bool = False) -> Any:
    """The x86 quantizer kiln's recipe uses, the nodes named ``kept`` tagged as one module that it is
    told to leave in float. A kept linear in a fused pattern (linear + GELU) is left too: the pattern's
    other node is not tagged, so the quantizer annotates the linear alone, as float, first."""
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as x86
    from torchao.quantization.pt2e import MinMaxObserver

    config = x86.get_default_x86_inductor_quantization_config(reduce_range=reduce_range)
    # minmax, the calibration method kiln's options name (the default recipe's is a histogram)
    activations = dataclasses.replace(
        config.input_activation, observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2**-12)
    )
    quantizer = x86.X86InductorQuantizer().set_global(
        dataclasses.replace(config, input_activation=activations)
    )
    if kept:
        for node in module.graph.nodes:
            if node.name in kept:
                stack = dict(node.meta.get("nn_module_stack") or {})
                node.meta["nn_module_stack"] = {**stack, "kiln_float": (FLOAT_MODULE, "kiln")}
        quantizer.set_module_name_qconfig(FLOAT_MODULE, None)
    return quantizer


def _float_lookup(module: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    """Whether ``node`` looks up a float 2-D table the module holds (what :func:`_int8_embeddings`
    stores int8)."""
    if node.target is not torch.ops.aten.embedding.default or node.args[0].op != "get_attr":
        return False
    table = _attribute(module, node.args[0].target)
    return table.is_floating_point() and table.dim() == 2


def _int8_embeddings(module: torch.fx.GraphModule, kept: Collection[str] = ()) -> int:
    """Every embedding lookup of a float table the module holds, rewritten to look up an int8 table and
    its per-row scales (symmetric, ``amax(|row|) / 127``) and multiply: weight-only int8, as ONNX
    Runtime's quantizer does for Gather. The x86 recipe leaves embeddings in fp32, and BERT-base's
    word embeddings (94 MB) are a third of its fp32 bytes. Lookups named in ``kept`` (accuracy repair's
    float layers) read the float table. Returns how many lookups were rewritten."""
    rewritten: set[str] = set()  # tables already stored int8 (one table may be looked up twice)
    count = 0
    graph = module.graph
    for node in list(graph.nodes):
        if node.name in kept or not _float_lookup(module, node):
            continue
        table_node, indices = node.args[0], node.args[1]
        table = _attribute(module, table_node.target)
        name = table_node.target.replace(".", "_")
        if table_node.target not in rewritten:
            rewritten.add(table_node.target)
            scale = table.detach().float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127
            values = (table.detach().float() / scale).round().clamp(-127, 127).to(torch.int8)
            module.register_buffer(f"{name}_int8", values)
            module.register_buffer(f"{name}_scale", scale.to(table.dtype))
        with graph.inserting_before(node):
            rows = graph.call_function(
                torch.ops.aten.embedding.default, (graph.get_attr(f"{name}_int8"), indices, *node.args[2:])
            )
            scales = graph.call_function(
                torch.ops.aten.embedding.default, (graph.get_attr(f"{name}_scale"), indices)
            )
            floats = graph.call_function(torch.ops.aten.to.dtype, (rows, table.dtype))
            lookup = graph.call_function(torch.ops.aten.mul.Tensor, (floats, scales))
        lookup.meta = {**node.meta, INT8_TABLE: True}
        node.replace_all_uses_with(lookup)
        graph.erase_node(node)
        if not table_node.users:  # the float table is not saved with the program
            graph.erase_node(table_node)
            if not any(n.op == "get_attr" and n.target == table_node.target for n in graph.nodes):
                owner, _, leaf = table_node.target.rpartition(".")
                delattr(_attribute(module, owner) if owner else module, leaf)
        count += 1
    if count:
        graph.lint()
        graph.eliminate_dead_code()
        module.delete_all_unused_submodules()
        module.recompile()
    return count


def _attribute(module: torch.nn.Module, target: str) -> Any:
    owner: Any = module
    for part in target.split("."):
        owner = getattr(owner, part)
    return owner
