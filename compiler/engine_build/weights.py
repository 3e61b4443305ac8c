"""The weights an engine takes: each instance's, by canonical name (``w0, w1, ...``), in the precision
its engine was built for: fp16/bf16 for a float partition (fp32 where only ops kept in fp32 read
one), as stored for a quantized one (its int8 tensors and scales are kept as the engine takes them).
A build lowers them so, a load casts them so, and a package may store them so
(``compiler.save(engine_precision_weights=True)``, :func:`engine_precision_keys`)."""

from __future__ import annotations

import copy

import torch

from compiler.engine_build.float_ops import fp32_weights
from compiler.partitioning.dedup import EngineInstance
from compiler.partitioning.partition import PartitionPlan

PRECISION_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
REDUCED_DTYPES = (torch.float16, torch.bfloat16)  # what a package may store an engine-only weight as


def engine_weight_dtypes(plan: PartitionPlan, instance: EngineInstance) -> dict[str, torch.dtype | None]:
    """Canonical name -> the dtype one instance's engine takes that weight at (None: as stored), in
    canonical order (w0, w1, ..., w10, whatever order the mapping arrived in: JSON may sort keys), the
    order the engine graph takes its weight inputs by."""
    target = PRECISION_DTYPES.get(plan.options.precision_of(instance.partition))
    kept = kept_in_fp32(plan, instance.partition)
    ordered = sorted(instance.weights, key=lambda name: int(name[1:]))
    return {name: torch.float32 if int(name[1:]) in kept else target for name in ordered}


def engine_weights(plan: PartitionPlan, instance: EngineInstance) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor for one instance, in the engine's precision."""
    weights = plan.weights()
    return {
        name: typed(weights[instance.weights[name]], dtype)
        for name, dtype in engine_weight_dtypes(plan, instance).items()
    }


def typed(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` as a float input of ``dtype`` takes it (anything else as it is), contiguous."""
    if dtype is not None and tensor.is_floating_point():
        tensor = tensor.to(dtype)
    return tensor.detach().contiguous()


def kept_in_fp32(plan: PartitionPlan, name: str) -> set[int]:
    """The weights of float partition ``name`` that only ops kept in fp32 read (stored in fp32)."""
    ops = plan.options.float_ops(name)
    if not ops:
        return set()
    partition = next(p for p in plan.partitions if p.name == name)
    # Only which nodes read which weights is needed, which the runtime graph of a package read back
    # holds too (the same nodes): plan.submodule would read the package's program, at a load's cost.
    return fp32_weights(getattr(plan.graph_module, name), [i.kind for i in partition.inputs], ops)


def engine_precision_keys(
    plan: PartitionPlan, instances: list[EngineInstance], engines: set[str]
) -> dict[str, torch.dtype]:
    """The program's fp32 weights (or weights a package read back already holds so) that only the engines
    of partitions ``engines`` read, each at one lower precision (fp16, bf16) wherever it is read: key ->
    that dtype. Stored so, the engines take exactly the values they took before (they cast them at load
    otherwise) in half the bytes; a weight that a fallback op, a partition running in PyTorch or an fp32
    engine also reads keeps its dtype."""
    feeds = {i.node: i.weight_key for p in plan.partitions for i in p.inputs if i.kind == "weight"}
    shared = {
        feeds[node.name]
        for node in plan.graph_module.graph.nodes
        if node.op == "placeholder"
        and node.name in feeds
        and any(user.op != "call_module" or user.target not in engines for user in node.users)
    }
    taken: dict[str, set[torch.dtype | None]] = {}
    for instance in instances:
        if instance.partition in engines:
            for name, dtype in engine_weight_dtypes(plan, instance).items():
                taken.setdefault(instance.weights[name], set()).add(dtype)
    program = plan.program_weights  # fp32, or already at that dtype (a package read back)
    return {
        key: dtype
        for key, dtypes in sorted(taken.items())
        if key not in shared
        and len(dtypes) == 1
        and (dtype := next(iter(dtypes))) in REDUCED_DTYPES
        and key in program
        and program[key].dtype in (torch.float32, dtype)
    }


def read_wider_than_stored(plan: PartitionPlan, instances: list[EngineInstance]) -> list[str]:
    """Partitions whose engines, under ``plan``'s options, would take a weight its package stored at
    a lower precision (``plan.reduced_weights``) at another float dtype (raised to fp32, or read by ops
    kept in fp32): its original values are not in the package."""
    return sorted(
        {
            instance.partition
            for instance in instances
            for name, dtype in engine_weight_dtypes(plan, instance).items()
            if (stored := plan.reduced_weights.get(instance.weights[name])) is not None
            and dtype not in (None, stored)
        }
    )


def at_program_dtype(
    plan: PartitionPlan, instances: list[EngineInstance], engines: set[str]
) -> PartitionPlan:
    """``plan`` with the weights its package stored at fp16/bf16 that not only engines of that precision
    read any more (a partition rebuilt to run in PyTorch, or whose engine did not build) at the
    program's dtype again, fp32, with the stored values: that graph runs at the dtype it was traced at."""
    fits = engine_precision_keys(plan, instances, engines)
    back = {key for key, dtype in plan.reduced_weights.items() if fits.get(key) != dtype}
    if not back:
        return plan
    plan = copy.copy(plan)
    plan.program_weights = {
        **plan.program_weights,
        **{key: plan.program_weights[key].to(torch.float32) for key in back if key in plan.program_weights},
    }
    plan.reduced_weights = {key: dtype for key, dtype in plan.reduced_weights.items() if key not in back}
    return plan
