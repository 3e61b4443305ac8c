"""fp8 on Inductor (CUDA): torchao's float8 rowwise recipe, as ATen ops in the partition's own graph.

The recipe (torchao's ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``): each
linear's weight ``w [N, K]`` is stored in E4M3 with one fp32 scale per output row
(``amax(|w|, row) / 448``); each call scales the activation rows the same way, casts them to E4M3 and
multiplies with ``torch._scaled_mm`` (cuBLASLt's fp8 GEMM, compute capability 8.9+), output in bf16;
the partition's other ops run in bf16, as torchao's recipes run.

Why not torchao's ``quantize_`` itself: it swaps ``nn.Linear`` weights for tensor subclasses, which an
exported program holds as pickled objects calling torchao's custom ops; a kiln program is ATen only,
read without unpickling (docs/security.md). The recipe is four ops, written here into the graph.

What stays as with float engines: weights are engine inputs. Each eligible weight becomes two refit
tensors (its E4M3 values, its row scales), so identical blocks still build one engine, each instance
passes its own values (``PartitionPlan.quantized``), and stripped engines take them at load. Dynamic:
no calibration data. A linear is eligible when its weight is a weight input used only as linear
weights, 2-D, with both sizes multiples of 16 (the fp8 GEMM's alignment); others stay in float.
"""

from __future__ import annotations

import copy
import io
from collections.abc import Sequence

import torch

from compiler.dedup import canonical_weights
from compiler.errors import QuantizationError
from compiler.lower import PRECISION_DTYPES, QUANTIZED_GRAPH_PRECISION, export_partition
from compiler.partition import QUANTIZED_PREFIX, PartitionPlan

E4M3_MAX = 448.0
_ALIGN = 16


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, w, bias)`` with ``weight`` (E4M3, ``[N, K]``) and its row ``scale`` (``[N, 1]``):
    the activation rows scaled dynamically, one fp8 GEMM (traced into the graph as ATen ops)."""
    rows = x.reshape(-1, x.shape[-1])
    x_scale = rows.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / E4M3_MAX
    quantized = (rows.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(
        quantized, weight.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=torch.bfloat16
    )
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values, fp32 row scales ``[N, 1]``) of a float ``[N, K]`` weight."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / E4M3_MAX
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def quantize_fingerprint(plan: PartitionPlan, parts: Sequence[str]) -> tuple[bytes, dict[str, torch.Tensor]]:
    """(the saved program, each instance's tensors) for the partitions ``parts`` of one fingerprint:
    the graph rewritten once, each instance's eligible weights in E4M3 with their scales.
    :class:`QuantizationError` where no linear is eligible."""
    by_name = {p.name: p for p in plan.partitions}
    partition = by_name[parts[0]]
    graph, kinds, eligible = _rewritten(plan, parts[0])
    if not eligible:
        raise QuantizationError(
            f"{parts[0]}: no linear whose weight is 2-D with sizes multiples of {_ALIGN} (fp8 GEMM)"
        )
    every = plan.weights()
    rest = PRECISION_DTYPES[QUANTIZED_GRAPH_PRECISION["fp8"]]
    tensors: dict[str, torch.Tensor] = {}
    representative: list[torch.Tensor] = []
    for name in parts:
        own: list[torch.Tensor] = []
        for k, key in sorted(canonical_weights(by_name[name]).items(), key=lambda item: int(item[0][1:])):
            tensor = every[key].detach()
            if int(k[1:]) in eligible:
                own.extend(fp8_weight(tensor))
            else:  # in the precision the rest of the graph computes in
                own.append((tensor.to(rest) if tensor.is_floating_point() else tensor).contiguous())
        tensors.update({f"{QUANTIZED_PREFIX}{name}/w{j}": t for j, t in enumerate(own)})
        representative = representative or own
    weights = {f"w{j}": t for j, t in enumerate(representative)}
    exported = export_partition(plan, partition, weights, rewritten=(graph, kinds)).program
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    return buffer.getvalue(), tensors


def _rewritten(plan: PartitionPlan, name: str) -> tuple[torch.fx.GraphModule, list[str], set[int]]:
    """The partition's graph with every eligible ``aten.linear`` calling :func:`fp8_linear`, a scale
    input after each of their weights; its input kinds; the canonical indices of those weights."""
    partition = next(p for p in plan.partitions if p.name == name)
    graph = copy.deepcopy(plan.submodule(name))
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    kinds: list[str] = []
    eligible: set[int] = set()
    weight_index = 0
    for node, source in zip(placeholders, partition.inputs, strict=True):
        kinds.append(source.kind)
        if source.kind != "weight":
            continue
        index, weight_index = weight_index, weight_index + 1
        if not _is_linear_weight(node):
            continue
        eligible.add(index)
        kinds.append("weight")
        with graph.graph.inserting_after(node):
            scale = graph.graph.placeholder(f"{node.name}_fp8_scale")
        for user in list(node.users):
            x, _, *bias = user.args
            with graph.graph.inserting_before(user):
                replacement = graph.graph.call_function(fp8_linear, (x, node, scale, *bias))
            replacement.meta = dict(user.meta)
            user.replace_all_uses_with(replacement)
            graph.graph.erase_node(user)
    graph.graph.lint()
    graph.recompile()
    return graph, kinds, eligible


def _is_linear_weight(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    if value is None or value.dim() != 2 or not value.is_floating_point():
        return False
    if any(not isinstance(size, int) or size % _ALIGN for size in value.shape):
        return False
    return bool(node.users) and all(
        user.target is torch.ops.aten.linear.default
        and len(user.args) >= 2
        and user.args[1] is node
        and node not in (user.args[0], *user.args[2:])
        for user in node.users
    )
