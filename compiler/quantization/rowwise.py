"""Quantized GEMMs on Inductor (CUDA): torchao's dynamic rowwise recipes, as ATen ops in the
partition's own graph.

Two recipes, one shape. Each eligible linear's weight ``w [N, K]`` is stored quantized with one fp32
scale per output row; each call scales the activation rows the same way at run time and multiplies
in the low type; the partition's other ops run in bf16, as torchao's recipes run.

- **fp8** (torchao's ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())``): E4M3,
  scale ``amax(|row|) / 448``, ``torch._scaled_mm`` (cuBLASLt's fp8 GEMM, compute capability 8.9+),
  output in bf16. Weight sizes must be multiples of 16.
- **int8** (torchao's ``Int8DynamicActivationInt8WeightConfig``): symmetric int8 in [-127, 127],
  scale ``amax(|row|) / 127``, ``torch._int_mm`` (int32 out), then both scales multiplied in. Weight
  sizes must be multiples of 8. cuBLAS's int8 GEMM refuses 16 rows or fewer; where the specs allow
  that few, the activation is padded by 16 zero rows and the result sliced back.

Why not torchao's ``quantize_`` itself: it swaps ``nn.Linear`` weights for tensor subclasses, which an
exported program holds as pickled objects calling torchao's custom ops; a kiln program is ATen only,
read without unpickling (docs/security.md). Each recipe is a handful of ops, written here.

What stays as with float engines: weights are engine inputs. Each eligible weight becomes two refit
tensors (its quantized values, its row scales), so identical blocks still build one engine, each
instance passes its own values (``PartitionPlan.quantized``), and stripped engines take them at load.
Dynamic: no calibration data. A linear is eligible when its weight is a weight input used only as
linear weights, 2-D, with both sizes multiples of the recipe's alignment; others stay in float, and so
do the linears accuracy repair keeps in float (``CompileOptions.float_layers``: canonical node names of
the partition's graph, the unit every Inductor partition's layers are named in).
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Collection
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from compiler.engine_build.float_ops import named
from compiler.engine_build.lower import export_partition
from compiler.engine_build.weights import PRECISION_DTYPES
from compiler.errors import QuantizationError
from compiler.partitioning.dedup import canonical_weights
from compiler.partitioning.partition import QUANTIZED_PREFIX, PartitionPlan
from compiler.quantization.recipe import RecipeCall

E4M3_MAX = 448.0
INT8_MAX = 127.0
# cuBLAS's int8 GEMM (torch._int_mm on CUDA) needs more than this many rows.
INT_MM_MIN_ROWS = 16


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def _row_scale(rows: torch.Tensor, largest: float) -> torch.Tensor:
    return rows.abs().amax(dim=-1, keepdim=True).float().clamp(min=1e-12) / largest


def _finish(out: torch.Tensor, x: torch.Tensor, bias: torch.Tensor | None, n: int) -> torch.Tensor:
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], n)


def fp8_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear(x, w, bias)`` with ``weight`` (E4M3, ``[N, K]``) and its row ``scale`` (``[N, 1]``):
    the activation rows scaled dynamically, one fp8 GEMM (traced into the graph as ATen ops)."""
    rows = _rows(x)
    x_scale = _row_scale(rows, E4M3_MAX)
    quantized = (rows.float() / x_scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    out = torch._scaled_mm(
        quantized, weight.t(), scale_a=x_scale, scale_b=scale.t(), out_dtype=torch.bfloat16
    )
    return _finish(out, x, bias, weight.shape[0])


def int8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    pad: bool = False,
) -> torch.Tensor:
    """``F.linear(x, w, bias)`` with ``weight`` (int8, ``[N, K]``) and its row ``scale`` (``[N, 1]``):
    the activation rows quantized dynamically, one int8 GEMM with int32 results, both scales applied.
    ``pad``: the rows may be too few for cuBLAS (:data:`INT_MM_MIN_ROWS`): pad, multiply, slice."""
    rows = _rows(x)
    x_scale = _row_scale(rows, INT8_MAX)
    quantized = (rows.float() / x_scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    if pad:
        quantized = F.pad(quantized, (0, 0, 0, INT_MM_MIN_ROWS))
    out = torch._int_mm(quantized, weight.t())
    if pad:
        out = out[: rows.shape[0]]
    return _finish(out.float() * x_scale * scale.t(), x, bias, weight.shape[0])


def fp8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 values, fp32 row scales ``[N, 1]``) of a float ``[N, K]`` weight."""
    w = weight.detach().float()
    scale = _row_scale(w, E4M3_MAX)
    return (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(symmetric int8 values, fp32 row scales ``[N, 1]``) of a float ``[N, K]`` weight."""
    w = weight.detach().float()
    scale = _row_scale(w, INT8_MAX)
    return (w / scale).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8).contiguous(), scale.contiguous()


@dataclass(frozen=True)
class RowwiseRecipe:
    """One dynamic rowwise recipe: its GEMM (the graph's call), how a weight is quantized, the
    weight-size alignment its GEMM needs, and whether too few rows must be padded."""

    linear: Callable[..., torch.Tensor]
    weight: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    align: int
    pads_few_rows: bool


RECIPES = {
    "fp8": RowwiseRecipe(fp8_linear, fp8_weight, align=16, pads_few_rows=False),
    "int8": RowwiseRecipe(int8_linear, int8_weight, align=8, pads_few_rows=True),
}


def quantize_fingerprint(call: RecipeCall) -> tuple[bytes, dict[str, torch.Tensor]]:
    """(the saved program, each instance's tensors) for the call's partitions, of one fingerprint: the
    graph rewritten once, each instance's eligible weights quantized with their scales, by the recipe of
    the partitions' precision (dynamic: no feeds needed). The linears the recipe's ``float_layers``
    names (accuracy repair's choice) are left in float. :class:`QuantizationError` where no linear is
    eligible."""
    plan, parts = call.plan, call.parts
    partition = next(p for p in plan.partitions if p.name == parts[0])
    precision = plan.options.precision_of(parts[0])
    recipe = RECIPES[precision]
    graph, kinds, eligible = _rewritten(plan, parts[0], recipe, call.recipe.get("float_layers", ()))
    if not eligible:
        raise QuantizationError(
            f"{parts[0]}: no linear whose weight is 2-D with sizes multiples of {recipe.align} "
            f"({precision} GEMM)" + (" left out of float_layers" if call.recipe.get("float_layers") else "")
        )
    tensors: dict[str, torch.Tensor] = {}
    representative: list[torch.Tensor] = []
    for name in parts:
        own = instance_tensors(plan, name, recipe, eligible)
        tensors.update({f"{QUANTIZED_PREFIX}{name}/w{j}": t for j, t in enumerate(own)})
        representative = representative or own
    weights = {f"w{j}": t for j, t in enumerate(representative)}
    exported = export_partition(plan, partition, weights, rewritten=(graph, kinds)).program
    buffer = io.BytesIO()
    torch.export.save(exported, buffer)
    return buffer.getvalue(), tensors


def instance_tensors(
    plan: PartitionPlan, name: str, recipe: RowwiseRecipe, eligible: Collection[int]
) -> list[torch.Tensor]:
    """Partition ``name``'s weights as its rewritten graph takes them: each eligible one (canonical
    index) quantized and followed by its row scales, the others in the precision the rest computes in."""
    partition = next(p for p in plan.partitions if p.name == name)
    every = plan.weights()
    rest = PRECISION_DTYPES[plan.options.compute_precision(name)]
    own: list[torch.Tensor] = []
    for k, key in sorted(canonical_weights(partition).items(), key=lambda item: int(item[0][1:])):
        tensor = every[key].detach()
        if int(k[1:]) in eligible:
            own.extend(recipe.weight(tensor))
        else:  # in the precision the rest of the graph computes in
            own.append((tensor.to(rest) if tensor.is_floating_point() else tensor).contiguous())
    return own


def layers(plan: PartitionPlan, name: str) -> list[str]:
    """The canonical names (:func:`compiler.engine_build.float_ops.named`) of the linears the recipe of
    partition ``name``'s precision rewrites: what accuracy repair may keep in float."""
    recipe = RECIPES[plan.options.precision_of(name)]
    sub = plan.submodule(name)
    linears = {
        user for node in sub.graph.nodes if _is_linear_weight(node, recipe.align) for user in node.users
    }
    return [canonical for canonical, node in named(sub) if node in linears]


def _rewritten(
    plan: PartitionPlan, name: str, recipe: RowwiseRecipe, float_layers: Collection[str] = ()
) -> tuple[torch.fx.GraphModule, list[str], set[int]]:
    """The partition's graph with every eligible ``aten.linear`` calling the recipe's GEMM, a scale
    input after each of their weights; its input kinds; the canonical indices of those weights. A
    weight read by a linear named in ``float_layers`` stays float for all its linears (one weight is
    stored once, either way)."""
    partition = next(p for p in plan.partitions if p.name == name)
    graph = copy.deepcopy(plan.submodule(name))
    kept = {node for canonical, node in named(graph) if canonical in set(float_layers)}
    placeholders = [n for n in graph.graph.nodes if n.op == "placeholder"]
    on_cuda = plan.options.device.startswith("cuda")
    kinds: list[str] = []
    eligible: set[int] = set()
    weight_index = 0
    for node, source in zip(placeholders, partition.inputs, strict=True):
        kinds.append(source.kind)
        if source.kind != "weight":
            continue
        index, weight_index = weight_index, weight_index + 1
        if not _is_linear_weight(node, recipe.align) or kept & set(node.users):
            continue
        eligible.add(index)
        kinds.append("weight")
        with graph.graph.inserting_after(node):
            scale = graph.graph.placeholder(f"{node.name}_scale")
        for user in list(node.users):
            x, _, *bias = user.args
            args: tuple = (x, node, scale, *bias)
            if recipe.pads_few_rows and on_cuda and _fewest_rows(x, plan.symbols) <= INT_MM_MIN_ROWS:
                args = (x, node, scale, bias[0] if bias else None, True)
            with graph.graph.inserting_before(user):
                replacement = graph.graph.call_function(recipe.linear, args)
            replacement.meta = dict(user.meta)
            user.replace_all_uses_with(replacement)
            graph.graph.erase_node(user)
    graph.graph.lint()
    graph.recompile()
    return graph, kinds, eligible


def _fewest_rows(x: torch.fx.Node, symbols: dict[str, tuple[str, int, int, int]]) -> int:
    """The fewest rows ``x`` (a linear's input) can have within the input specs: its leading sizes'
    product at each dynamic dimension's minimum (1 where a size is not one of the specs' own)."""
    value = x.meta.get("val")
    if value is None:
        return 1
    rows = 1
    for size in value.shape[:-1]:
        if isinstance(size, int):
            rows *= size
            continue
        expr = size.node.expr
        if any(str(s) not in symbols for s in expr.free_symbols):
            return 1
        rows *= int(expr.subs({s: symbols[str(s)][1] for s in expr.free_symbols}))
    return rows


def _is_linear_weight(node: torch.fx.Node, align: int) -> bool:
    value = node.meta.get("val")
    # A node of a dynamic partition's graph can hold a size (a SymInt), not a tensor.
    if not isinstance(value, torch.Tensor) or value.dim() != 2 or not value.is_floating_point():
        return False
    if any(not isinstance(size, int) or size % align for size in value.shape):
        return False
    return bool(node.users) and all(
        user.target is torch.ops.aten.linear.default
        and len(user.args) >= 2
        and user.args[1] is node
        and node not in (user.args[0], *user.args[2:])
        for user in node.users
    )
