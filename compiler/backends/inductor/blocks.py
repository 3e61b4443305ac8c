"""An engine's program compiled one repeated block at a time, for the load that must compile it.

An untrusted package's engine is compiled at load (its stored code never runs), and Inductor's time
grows with the graph: a 24-layer decoder's program holds its layer 24 times. Here the program is cut
where instances of its repeated module start and end (the module class that covers the most nodes:
``compiler.program.blocks.detect_repeated_module``, from the module stack that lowering keeps in
the program), each distinct piece is compiled once, and the pieces run in order: pieces of one
structure share one compiled graph, each called with its own instance's weights. The cut loses the
fusions across block boundaries, so it serves only the first load, while this machine's native
whole-graph package is built for the loads after it (``native.py``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.fx.passes.split_module import split_module

from compiler.program.blocks import block_key, detect_repeated_module

# Cut only where the distinct pieces hold at most this share of the program's nodes: compiling more
# graphs costs a fixed overhead each, so a cut must leave much less to compile (a 12-layer encoder
# leaves ~15%; an MLP whose "blocks" are its differently shaped layers leaves all of it: not cut).
MAX_DISTINCT_SHARE = 0.5


@dataclass(frozen=True)
class Cut:
    """The program as pieces called in order (``module``'s children), each piece's structure key, and
    the pieces that return one value (compiled as returning a 1-tuple)."""

    module: torch.fx.GraphModule
    keys: dict[str, str]
    single: frozenset[str]


class _Piece(torch.nn.Module):
    """One piece: its structure's compiled graph, called with this piece's inputs."""

    def __init__(self, compiled: Callable[..., Any], single: bool):
        super().__init__()
        self.compiled, self.single = compiled, single

    def forward(self, *args: Any) -> Any:
        out = self.compiled(*args)
        return out[0] if self.single else tuple(out)


def cut_by_block(module: torch.fx.GraphModule) -> Cut | None:
    """``module`` cut into runs of consecutive nodes of one block instance (or of the glue between
    blocks), each a submodule; None where the program has no repeated module or cutting would not
    leave much less to compile. Runs of a topological order depend only on earlier runs: no cycle."""
    classes = detect_repeated_module(module)
    if not classes:
        return None
    key = block_key(classes)
    run: dict[torch.fx.Node, int] = {}
    previous: object = object()
    run_id = -1
    for node in module.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        current = key(node)
        if current != previous:
            previous, run_id = current, run_id + 1
        run[node] = run_id
    if run_id < 2:  # fewer than three runs: no two blocks to share a compile
        return None
    cut = split_module(module, module, lambda node: run[node], keep_original_order=True)
    keys, single, sizes = {}, set(), {}
    for name, piece in cut.named_children():
        # Inductor compiles graphs that return a tuple; a piece with one output returns it bare.
        output = next(iter(reversed(piece.graph.nodes)))
        if not isinstance(output.args[0], list | tuple):
            output.args = ((output.args[0],),)
            piece.recompile()
            single.add(name)
        keys[name] = structure_key(piece)
        sizes[keys[name]] = len(piece.graph.nodes)
    if sum(sizes.values()) > MAX_DISTINCT_SHARE * len(module.graph.nodes):
        return None
    return Cut(cut, keys, frozenset(single))


def structure_key(piece: torch.fx.GraphModule) -> str:
    """Pieces with one key compute the same function of their inputs: the same ops on the same edges,
    every value of the same shape, stride and dtype (sizes by the program's own symbols)."""
    index: dict[torch.fx.Node, int] = {}
    rows = []
    for node in piece.graph.nodes:
        index[node] = len(index)
        edges = torch.fx.node.map_arg((node.args, node.kwargs), lambda used: f"%{index[used]}")
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            val = (val.dtype, tuple(val.shape), val.stride())
        # A placeholder's target is its name; an attribute's (a constant compiled in) tells pieces apart.
        target = None if node.op == "placeholder" else str(node.target)
        rows.append((node.op, target, edges, val))
    return hashlib.sha256(repr(rows).encode()).hexdigest()


def compile_cut(
    cut: Cut, compile_piece: Callable[[torch.fx.GraphModule], Callable[..., Any]]
) -> torch.fx.GraphModule:
    """The cut's module with each piece replaced by its structure's compiled graph (``compile_piece``,
    once per structure): it takes the program's inputs and returns its outputs."""
    compiled: dict[str, Callable[..., Any]] = {}
    for name, piece in list(cut.module.named_children()):
        key = cut.keys[name]
        if key not in compiled:
            compiled[key] = compile_piece(piece)
        setattr(cut.module, name, _Piece(compiled[key], name in cut.single))
    return cut.module
