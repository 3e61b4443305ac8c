"""Ops kept in fp32 inside an fp16/bf16 partition (accuracy repair's per-op raising, issue 46).

A float partition's engine computes in its precision because lowering casts its graph
(:func:`compiler.engine_build.lower._retyped`). Ops named in ``CompileOptions.float_layers`` for it are
put back in fp32 in that same torch graph, before any backend sees it: their floating inputs cast up
to fp32, the op computed in fp32, its output cast back down, and the weights only such ops read kept
in fp32. The precision is then in the graph every backend is given (strongly typed): Inductor compiles
the casts into its kernels, the ONNX exporter writes them as ``Cast`` nodes around the kept nodes, which
is how TensorRT (and TensorRT-RTX, which builds strongly typed networks only) keeps a layer in fp32.

An op is named by its position among the partition graph's nodes (``n57``): canonical, so it names the
same op in every instance of one structure and in every compile of the same model, as the quantizer's
layer names (:mod:`compiler.quantization.layers`) are.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import torch

FLOAT = torch.float32

# Ops that only move, view or look up values: never candidates (kept in float they change nothing but
# the casts around them).
MOVING = {
    "view",
    "_unsafe_view",
    "reshape",
    "permute",
    "transpose",
    "t",
    "expand",
    "squeeze",
    "unsqueeze",
    "slice",
    "select",
    "clone",
    "contiguous",
    "_to_copy",
    "to",
    "getitem",
    "flatten",
    "cat",
    "split",
    "alias",
    "detach",
    "lift_fresh_copy",
    "type_as",
    "dropout",
}
# The ops counted as FLOPs (a GEMM's or a convolution's).
COMPUTE = {"linear", "mm", "addmm", "bmm", "baddbmm", "matmul", "convolution", "conv2d", "conv1d", "einsum"}


def op_name(node: torch.fx.Node) -> str:
    """``aten.linear.default`` -> ``linear``."""
    target = node.target
    packet = getattr(target, "overloadpacket", None)
    name = getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))
    return name.split(".")[-1]


def named(sub: torch.fx.GraphModule) -> Iterator[tuple[str, torch.fx.Node]]:
    """(canonical name, node) for every node of the partition graph."""
    for index, node in enumerate(sub.graph.nodes):
        yield f"n{index}", node


def candidates(sub: torch.fx.GraphModule) -> list[tuple[str, torch.fx.Node]]:
    """The ops that could be kept in fp32: calls with one floating tensor output that compute."""
    found = []
    for name, node in named(sub):
        value = node.meta.get("val")
        if node.op != "call_function" or not isinstance(value, torch.Tensor):
            continue
        if value.is_floating_point() and op_name(node) not in MOVING:
            found.append((name, node))
    return found


def raised(sub: torch.fx.GraphModule, names: Collection[str], dtype: torch.dtype) -> torch.fx.GraphModule:
    """``sub`` (already retyped to ``dtype``) with the ops ``names`` computed in fp32. Their floating
    inputs are cast up, and their outputs stay fp32 (through the ops that only move values) up to the
    next op not kept, which reads them cast down: a run of kept ops passes fp32 between them. A kept op
    whose output were rounded to ``dtype`` would gain little: on a bf16 BERT most of the error is the
    bf16 tensors between ops, not the arithmetic inside one. ``sub`` itself is changed (pass a copy)."""
    wanted = set(names)
    if not wanted or dtype == FLOAT:
        return sub
    graph = sub.graph
    wide: set[torch.fx.Node] = set()  # nodes whose output is fp32 here

    def cast(node: torch.fx.Node, test, target: torch.dtype) -> None:
        def swap(arg: torch.fx.Node) -> torch.fx.Node:
            if not test(arg) or not _floating(arg):
                return arg
            return graph.call_function(torch.ops.aten._to_copy.default, (arg,), {"dtype": target})

        with graph.inserting_before(node):
            node.args = torch.fx.node.map_arg(node.args, swap)
            node.kwargs = torch.fx.node.map_arg(node.kwargs, swap)

    for name, node in list(named(sub)):
        if node.op != "call_function":
            continue
        if name in wanted:
            cast(node, lambda arg: arg not in wide, FLOAT)
            node.kwargs = {k: (FLOAT if v is dtype else v) for k, v in node.kwargs.items()}
            wide.add(node)
        elif op_name(node) in MOVING and not _casts(node):
            if any(arg in wide for arg in node.all_input_nodes):
                wide.add(node)
        else:
            cast(node, lambda arg: arg in wide, dtype)
    graph.lint()
    sub.recompile()
    return sub


def _casts(node: torch.fx.Node) -> bool:
    """A move that sets its dtype (``_to_copy(x, dtype=...)``, ``to.dtype(x, torch.float16)``: the
    model's own casts, positional as often as not): its output has that dtype, not its input's."""
    return "dtype" in node.kwargs or any(isinstance(a, torch.dtype) for a in node.args)


def _floating(arg: torch.fx.Node) -> bool:
    """A floating tensor, or a node without a recorded value (a cast this pass inserted). A size
    (``sym_size``: an int or SymInt) is never cast: ``new_zeros`` of a generation step takes one."""
    value = arg.meta.get("val")
    if value is None:
        return True
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def fp32_weights(sub: torch.fx.GraphModule, kinds: list[str], names: Collection[str]) -> set[int]:
    """Indices (among the partition's weights, ``w<k>``) of the weights that only ops kept in fp32
    read: they are stored in fp32 (a bf16 weight cast up would keep its bf16 rounding)."""
    wanted = {node for name, node in named(sub) if name in set(names)}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    found, index = set(), 0
    for node, kind in zip(placeholders, kinds, strict=True):
        if kind != "weight":
            continue
        if node.users and all(user in wanted for user in node.users):
            found.add(index)
        index += 1
    return found


def op_flops(sub: torch.fx.GraphModule, args: tuple) -> dict[str, int]:
    """Canonical name -> FLOPs (2 x multiply-adds) of each GEMM and convolution, from one run of
    ``sub`` (fp32) on ``args``."""
    names = {node: name for name, node in named(sub)}
    flops: dict[str, int] = {}

    class Counter(torch.fx.Interpreter):
        def run_node(self, node: torch.fx.Node):
            out = super().run_node(node)
            if node.op == "call_function" and op_name(node) in COMPUTE and isinstance(out, torch.Tensor):
                flops[names[node]] = _flops(node, out, self)
            return out

    with torch.no_grad():
        Counter(sub).run(*args)
    return flops


def _flops(node: torch.fx.Node, out: torch.Tensor, interp: torch.fx.Interpreter) -> int:
    args = [interp.env.get(a) if isinstance(a, torch.fx.Node) else a for a in node.args]
    op = op_name(node)
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if op in ("convolution", "conv2d", "conv1d") and len(tensors) > 1:
        weight = tensors[1]
        return 2 * out.numel() * (weight.numel() // max(weight.shape[0], 1))
    if op == "linear" and len(tensors) > 1:
        return 2 * out.numel() * tensors[1].shape[-1]
    if op in ("addmm", "baddbmm") and len(tensors) > 1:
        return 2 * out.numel() * tensors[1].shape[-1]
    if tensors and tensors[0].dim() > 0:
        return 2 * out.numel() * tensors[0].shape[-1]
    return 0
