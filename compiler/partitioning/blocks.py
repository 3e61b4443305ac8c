"""Blocks: partitions cut at the boundaries of a repeated module (``split_modules``).

:func:`split_by_block` cuts each supported group into runs of one block each (the repeated module and
each node's instance: ``compiler.program.blocks``), where cutting makes no cycle, so build time grows
with the number of unique blocks, not with depth.
"""

from __future__ import annotations

import torch
from torch.fx.passes.utils.fuser_utils import validate_partition

from compiler.program.blocks import block_key, detect_repeated_module


def split_by_block(
    gm: torch.fx.GraphModule, groups: list[list[torch.fx.Node]], split: str | tuple[str, ...]
) -> tuple[list[list[torch.fx.Node]], dict[str, str | None]]:
    key = block_key(detect_repeated_module(gm) if split == "auto" else tuple(split))
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
