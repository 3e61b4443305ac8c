"""Tracing: the process-wide lock every trace holds, and the quieting of torch's loggers while tracing.

torch.export and the ONNX exporter built on it are not thread-safe: :data:`TRACING` serializes every
trace in kiln (export, ONNX lowering, quantization, Inductor compiles), and :func:`custom_op_lock`
says when running a graph must hold it too.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Iterator

import torch

# torch.export and the ONNX exporter built on it are not thread-safe (two traces in one process corrupt
# each other's dispatch state): every trace in kiln holds this lock, so callers may use threads.
TRACING = threading.RLock()


def custom_op_lock(graph: torch.fx.GraphModule) -> contextlib.AbstractContextManager:
    """What running ``graph`` must hold: torch runs a custom op through torch._dynamo.disable, which,
    while any thread exports, edits a process-wide fx annotation dict (KeyError 'custom' under torch
    2.13). A graph (or a partition kept in PyTorch) that calls an op outside aten and prims runs under
    :data:`TRACING`, so it never overlaps a trace; any other runs freely."""
    calls_custom_ops = any(
        isinstance(node.target, torch._ops.OpOverload) and node.target.namespace not in ("aten", "prims")
        for module in graph.modules()
        if isinstance(module, torch.fx.GraphModule)
        for node in module.graph.nodes
        if node.op == "call_function"
    )
    return TRACING if calls_custom_ops else contextlib.nullcontext()


@contextlib.contextmanager
def quiet_loggers(*names: str) -> Iterator[None]:
    """The named loggers at ERROR inside the block, their own levels after it. Read on entry: call it
    under the lock that serialises their other users (a level read while another block has it lowered
    would be restored for good)."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


@contextlib.contextmanager
def quiet_trace() -> Iterator[None]:
    """One trace at a time (:data:`TRACING`), without the warnings and progress lines torch.export and
    the ONNX exporter print for every partition: a compile of many drowns in them."""
    with TRACING, warnings.catch_warnings(), quiet_loggers("torch.onnx", "torch.export", "torch._dynamo"):
        warnings.simplefilter("ignore")
        yield
