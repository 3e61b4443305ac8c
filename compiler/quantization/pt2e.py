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

Each instance is therefore its own program and engine (its graph's digest is in its fingerprint),
like TensorRT's compiled-in scales; nothing of it is refit, and stripping leaves nothing out.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from compiler.engine_build.lower import export_partition
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


def pt2e_available() -> str | None:
    """None where torchao's PT2E quantizer imports here; else why not (the install hint)."""
    try:
        import_torchao("torchao.quantization.pt2e.quantize_pt2e")
    except ImportError as exc:
        return f"torchao is not installed ({exc}); pip install 'kiln[int8-inductor]'"
    return None


def quantize_fingerprint(call: RecipeCall) -> tuple[bytes, dict[str, torch.Tensor]]:
    """The entry point every recipe module shares (:mod:`compiler.quantization.recipe`): the program of
    the first of the call's partitions quantized (:func:`quantize_program`); its weights are frozen in,
    so it has no tensors of its own. Scales are compiled in: each instance is quantized on its own."""
    name = call.parts[0]
    return quantize_program(call.plan, name, call.feeds.get(name, [])), {}


def quantize_program(plan: PartitionPlan, name: str, feeds: Sequence[Mapping[str, np.ndarray]]) -> bytes:
    """The saved program of partition ``name`` quantized to int8 with its own weights frozen in,
    calibrated on ``feeds`` (its captured activations, ``x0..xk`` per sample). :class:`QuantizationError`
    where torchao is missing, nothing in it is quantizable, or no feed is given."""
    partition = next(p for p in plan.partitions if p.name == name)
    missing = pt2e_available()
    if missing is not None:
        raise QuantizationError(f"{partition.name}: {missing}")
    if not feeds:
        raise QuantizationError(f"{partition.name}: no calibration samples reached this partition")
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as x86
    from torchao.quantization.pt2e import MinMaxObserver
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    every = plan.weights()
    weights = {k: every[key].detach() for k, key in canonical_weights(partition).items()}
    exported = export_partition(plan, partition, weights, bind_weights=True)
    module = exported.program.module()
    for node in module.graph.nodes:
        if node.op == "call_function" and node.target in _SOURCES:
            node.meta["source_fn_stack"] = [(node.name, _SOURCES[node.target])]
    config = x86.get_default_x86_inductor_quantization_config()
    # minmax, the calibration method kiln's options name (the default recipe's is a histogram)
    activations = dataclasses.replace(
        config.input_activation, observer_or_fake_quant_ctr=MinMaxObserver.with_args(eps=2**-12)
    )
    config = dataclasses.replace(config, input_activation=activations)
    quantizer = x86.X86InductorQuantizer().set_global(config)
    device = next((t.device for t in exported.examples), torch.device("cpu"))
    with quiet_trace(), torch.no_grad():
        prepared = prepare_pt2e(module, quantizer)
        for feed in feeds:
            prepared(*(torch.from_numpy(feed[f"x{k}"]).to(device) for k in range(len(feed))))
        converted = convert_pt2e(prepared)
        tables = _int8_embeddings(converted)
        if not tables and not any(
            getattr(n.target, "namespace", None) == "quantized_decomposed" for n in converted.graph.nodes
        ):
            raise QuantizationError(
                f"{partition.name}: torchao's x86 quantizer found no linear or convolution to quantize, "
                "and it holds no embedding table"
            )
        program = torch.export.export(
            converted, exported.examples, dynamic_shapes=exported.dynamic_shapes, strict=False
        )
    program._example_inputs = None  # torch.export.save would pickle them
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    return buffer.getvalue()


def _int8_embeddings(module: torch.fx.GraphModule) -> int:
    """Every embedding lookup of a float table the module holds, rewritten to look up an int8 table and
    its per-row scales (symmetric, ``amax(|row|) / 127``) and multiply: weight-only int8, as ONNX
    Runtime's quantizer does for Gather. The x86 recipe leaves embeddings in fp32, and BERT-base's
    word embeddings (94 MB) are a third of its fp32 bytes. Returns how many tables were rewritten."""
    rewritten: set[str] = set()  # tables already stored int8 (one table may be looked up twice)
    count = 0
    graph = module.graph
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.embedding.default or node.args[0].op != "get_attr":
            continue
        table_node, indices = node.args[0], node.args[1]
        table = _attribute(module, table_node.target)
        if not table.is_floating_point() or table.dim() != 2:
            continue
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
        lookup.meta = dict(node.meta)
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
