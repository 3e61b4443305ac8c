"""Prepare: the copy of a program's graph that partitioning cuts up.

Asserts dropped, simple in-place ops made functional where that is exact, and each symbolic size
computation private to its one user, so a partition never takes a size from another partition and a
saved plan replays on the loaded program node for node.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import torch
from torch.export import ExportedProgram

from compiler.program.symbolic import is_symbolic

_DROPPED_OPS = (torch.ops.aten._assert_tensor_metadata.default,)


def prepared_copy(program: ExportedProgram) -> torch.fx.GraphModule:
    """A copy of the program's graph to cut up: asserts dropped, simple in-place ops made functional,
    symbolic sizes private to each user."""
    gm = copy.deepcopy(program.graph_module)
    _functionalize_simple_inplace(gm.graph)
    for node in list(gm.graph.nodes):
        # Unused multi-output items appear or vanish across torch.export.save/load: drop them so a saved
        # plan replays on the loaded program node for node.
        dead_item = node.target is operator.getitem and not node.users
        if node.op == "call_function" and (node.target in _DROPPED_OPS or dead_item) and not node.users:
            gm.graph.erase_node(node)
    _privatize_symbolic_nodes(gm.graph)
    gm.recompile()
    return gm


def _functionalize_simple_inplace(graph: torch.fx.Graph) -> None:
    """``x.add_(y)`` -> ``z = x.add(y)`` with later uses of ``x`` reading ``z``, where that is exact.

    Partitioning runs on torch.export's graph as it comes (decomposing a 24-layer model first costs a
    minute; the ONNX exporter decomposes each unique partition anyway), and that graph may still hold
    in-place ops. An engine cannot mutate a tensor it received, so a mutation is rewritten when its
    target is a fresh intermediate that no view aliases; any other mutation stays in PyTorch.
    """
    order = {node: i for i, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        functional = _functional_variant(node)
        if functional is None:
            continue
        target = node.args[0]
        if not isinstance(target, torch.fx.Node) or target.op != "call_function" or _is_view(target):
            continue
        if any(_is_view(user) for user in target.users if user is not node):
            continue
        with graph.inserting_before(node):
            new = graph.call_function(functional, node.args, node.kwargs)
        new.meta = copy.copy(node.meta)
        node.replace_all_uses_with(new)
        for user in list(target.users):
            if user is not node and user is not new and order.get(user, -1) > order[node]:
                user.replace_input_with(target, new)
        graph.erase_node(node)


def _functional_variant(node: torch.fx.Node) -> Any:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return None
    schema = target._schema
    first = schema.arguments[0] if schema.arguments else None
    if first is None or first.alias_info is None or not first.alias_info.is_write:
        return None
    name = schema.name.split("::")[-1]
    if not name.endswith("_") or name.startswith("_"):
        return None
    packet = getattr(torch.ops.aten, name[:-1], None)
    return getattr(packet, target._overloadname, None) if packet is not None else None


def _is_view(node: torch.fx.Node) -> bool:
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    return any(ret.alias_info is not None for ret in target._schema.returns)


def _privatize_symbolic_nodes(graph: torch.fx.Graph) -> None:
    """Give every user of a symbolic size its own copy of the computation, right before it.

    A size (``sym_size``, arithmetic on sizes) shared by two partitions would otherwise cross an engine
    boundary as a SymInt, which no engine takes; with private copies each partition computes its own
    sizes from the tensors it receives. Placing each copy right before its user also gives repeated
    blocks one node order, so their fingerprints agree.
    """

    def clone(node: torch.fx.Node) -> torch.fx.Node:
        args = torch.fx.node.map_arg(node.args, lambda a: clone(a) if is_symbolic(a) else a)
        kwargs = torch.fx.node.map_arg(node.kwargs, lambda a: clone(a) if is_symbolic(a) else a)
        new = graph.call_function(node.target, args, kwargs)
        new.meta = copy.copy(node.meta)
        return new

    for user in list(graph.nodes):
        if is_symbolic(user) or user.op == "output":
            continue
        for arg in list(user.all_input_nodes):
            if is_symbolic(arg):
                with graph.inserting_before(user):
                    user.replace_input_with(arg, clone(arg))
    for node in reversed(list(graph.nodes)):
        if is_symbolic(node) and not node.users:
            graph.erase_node(node)
