"""Blocks: partitions cut at the boundaries of a repeated module (``split_modules``).

:func:`detect_repeated_module` finds the module class whose instances cover the most compute nodes (each
transformer block, say); :func:`split_by_block` cuts each supported group into runs of one block each,
where cutting makes no cycle, so build time grows with the number of unique blocks, not with depth.
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.fx.passes.utils.fuser_utils import validate_partition

from compiler.backends.onnx_support import SYMBOLIC_OPS
from compiler.partitioning.prepare import is_symbolic


def _block_of(node: torch.fx.Node, classes: tuple[str, ...]) -> str | None:
    for path, kind in (node.meta.get("nn_module_stack") or {}).values():
        name = kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"
        if name.rsplit(".", 1)[-1] in classes or name in classes:
            return path
    return None


def detect_repeated_module(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """The module class whose instances (>= 2) cover the most compute nodes: the repeated block."""
    coverage: Counter[str] = Counter()
    instances: dict[str, set[str]] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target in SYMBOLIC_OPS:
            continue
        for path, kind in list((node.meta.get("nn_module_stack") or {}).values())[1:]:
            name = kind if isinstance(kind, str) else f"{kind.__module__}.{kind.__qualname__}"
            name = name.rsplit(".", 1)[-1]
            coverage[name] += 1
            instances.setdefault(name, set()).add(path)
    repeated = [(count, name) for name, count in coverage.items() if len(instances[name]) >= 2]
    return (max(repeated)[1],) if repeated else ()


def split_by_block(
    gm: torch.fx.GraphModule, groups: list[list[torch.fx.Node]], split: str | tuple[str, ...]
) -> tuple[list[list[torch.fx.Node]], dict[str, str | None]]:
    classes = detect_repeated_module(gm) if split == "auto" else tuple(split)

    def key(node: torch.fx.Node) -> str | None:
        # A (privatized) size computation belongs to the block of its one user.
        while is_symbolic(node) and len(node.users) == 1:
            node = next(iter(node.users))
        return _block_of(node, classes)

    result, blocks = [], {}
    for group in groups:
        # Runs of consecutive nodes with one block key: a block, or the glue before/after blocks.
        runs: list[list[torch.fx.Node]] = []
        for node in group:
            if runs and key(runs[-1][-1]) == key(node):
                runs[-1].append(node)
            else:
                runs.append([node])
        # Cutting must not create a cycle between pieces; if it would, keep the group whole.
        if len(runs) > 1 and all(validate_partition(run) for run in runs):
            for run in runs:
                result.append(run)
                blocks[run[0].name] = key(run[0])
        else:
            result.append(group)
    return result, blocks
