"""Repeated modules of an exported program, from the module stack export keeps on each node.

:func:`detect_repeated_module` finds the module class whose instances cover the most compute nodes (each
transformer block, say); :func:`block_key` says which instance a node runs in. Partitioning cuts engines
at block boundaries with them (``split_modules``), and the Inductor backend cuts an engine's program at
load (``compiler.backends.inductor.blocks``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from compiler.program.symbolic import SYMBOLIC_OPS, is_symbolic


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


def block_key(classes: tuple[str, ...]) -> Callable[[torch.fx.Node], str | None]:
    """A node's block: the path of the instance of ``classes`` it runs in (None: outside any)."""

    def key(node: torch.fx.Node) -> str | None:
        # A (privatized) size computation belongs to the block of its one user.
        while is_symbolic(node) and len(node.users) == 1:
            node = next(iter(node.users))
        return _block_of(node, classes)

    return key
