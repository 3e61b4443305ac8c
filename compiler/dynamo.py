"""The ``torch.compile`` front end: the same partition/dedup/cache/strip pipeline as the AOT path.

Recent PyTorch lifts every parameter to a graph input of the graph a backend receives; that is why
Torch-TensorRT's weight stripping silently does nothing there. Here those inputs are
recognised as weights (dynamo marks their source as a parameter/buffer) and handed to partitioning as
weights, so engines hold them as canonically named constants: ``strip_weights=True`` really strips,
and the engines are refitted from the live parameters.

    torch.compile(model, backend="kiln", options={"strip_weights": True}, dynamic=False)
    torch.compile(model, backend=KilnBackend(strip_weights=True), dynamic=False)

Each shape dynamo specialises on compiles to static engines; recompiles on new shapes go through the
same persistent engine cache, so structures seen before (in this process or any other) are not rebuilt.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from compiler.cache.local import EngineCache, resolve_setting
from compiler.engine_build.engine import build_engine
from compiler.errors import BackendError, OptionsError
from compiler.options import CompileOptions
from compiler.partitioning.dedup import dedup
from compiler.partitioning.partition import partition
from compiler.program.tracing import TRACING
from compiler.runtime.module import CompiledModule, assemble


class KilnBackend:
    """A ``torch.compile`` backend; ``compiled`` keeps each graph's CompiledModule (reports, engines)."""

    def __init__(
        self,
        options: CompileOptions | None = None,
        *,
        cache: EngineCache | str | os.PathLike | bool | None = None,
        **settings: Any,
    ):
        self.options = dataclasses.replace(options or CompileOptions(), **settings)
        self.cache = resolve_setting(cache)  # False where there is none: None is the default cache
        self.compiled: list[CompiledModule] = []

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        if any(not isinstance(t, torch.Tensor) for t in example_inputs):
            raise BackendError(
                "the kiln torch.compile backend builds static-shape engines; dynamo passed symbolic sizes. "
                "Call torch.compile(..., dynamic=False);"
                " each new shape then compiles through the engine cache"
            )
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        with TRACING, torch.no_grad():
            program = torch.export.export(gm, tuple(example_inputs), strict=False)
        user_inputs = program.graph_signature.user_inputs
        weights = {
            name: tensor.detach()
            for name, node, tensor in zip(user_inputs, placeholders, example_inputs, strict=True)
            if _is_weight(node, tensor)
        }
        # The graph runs where dynamo's inputs are: that is the engines' device.
        device = next((t.device for t in example_inputs if t.device.type != "cpu"), torch.device("cpu"))
        options = dataclasses.replace(self.options, device=str(device))
        if options.quantized:
            raise OptionsError(
                "precision int8 is compiled ahead of time (compiler.compile, kiln compile), where "
                "calibration data is given; torch.compile(backend='kiln') takes fp32, fp16 or bf16"
            )
        plan = partition(program, options, input_weights=weights)
        unique = dedup(plan)
        engines = {fp: build_engine(plan, unique, fp, cache=self.cache) for fp in unique.fingerprints}
        compiled = assemble(plan, unique, engines, cache=self.cache)
        self.compiled.append(compiled)
        return compiled.forward


def kiln_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None):
    """Function form for ``torch.compile(backend="kiln", options={...})``; options are CompileOptions fields
    plus ``cache`` (a directory, or False)."""
    options = dict(options or {})
    cache = options.pop("cache", None)
    return KilnBackend(cache=cache, **options)(gm, example_inputs)


def _is_weight(node: torch.fx.Node, tensor: torch.Tensor) -> bool:
    if isinstance(tensor, torch.nn.Parameter):
        return True
    source = getattr(node.meta.get("grapharg"), "source", None)
    while source is not None:
        if "ParamBufferSource" in type(source).__name__:
            return True
        source = getattr(source, "base", None)
    return False


def register() -> None:
    """Make ``backend="kiln"`` known to torch.compile (idempotent)."""
    from torch._dynamo import list_backends, register_backend

    if "kiln" not in list_backends(exclude_tags=()):
        register_backend(kiln_backend, name="kiln")


register()
