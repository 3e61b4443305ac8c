"""A backend kiln does not ship, to show what adding one takes: this module and its record.

``torchgraph`` runs a partition's own exported program with PyTorch (no compiler): its engine is the
torch graph archive lowering hands it (``graph_format "torch.export"``), its weights refit by name. It
is a real backend, meeting ``EngineBackend`` through build, load and refit; the tests register
:data:`RECORD` (``compiler.backends.capabilities.register``) and compile, save and load with it. Nothing
under ``compiler/`` names it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import safetensors.torch
import torch

from compiler.backends.base import (
    BuildSettings,
    EngineIO,
    RecordedBackend,
    check_backend_options,
    pack_torch_graph,
    unpack_torch_graph,
)
from compiler.backends.capabilities import BackendRecord
from compiler.errors import RefitError

NAME = "torchgraph"

RECORD = BackendRecord(
    name=NAME,
    summary="the partition's exported program run by PyTorch (a test backend)",
    create=f"{__name__}:create",
    graph_format="torch.export",
    runs_on=("cpu",),
    build_profiles="none",  # one graph serves every shape
    cuda_graph_capture=True,  # it launches on PyTorch's own stream
)


def create(name: str, device: str, trust_engine_code: bool) -> TorchGraphBackend:
    return TorchGraphBackend()  # an exported program is read as data: trust changes nothing


def _ordered(weights: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    # The program takes its canonical weights w0, w1, ... by position, after the activations.
    return tuple(weights[k] for k in sorted(weights, key=lambda k: int(k[1:])))


class TorchGraphEngine:
    def __init__(self, module: torch.nn.Module, weights: tuple[torch.Tensor, ...]) -> None:
        self.module, self.weights = module, weights

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            out = self.module(*inputs, *self.weights)
        return tuple(out) if isinstance(out, list | tuple) else (out,)


class TorchGraphBackend(RecordedBackend):
    name = NAME

    def library_version(self) -> str:
        return f"{torch.__version__}+torchgraph1"

    def engine_target(self) -> str:
        return "cpu"

    def supports(self, target: Any) -> bool:
        return isinstance(target, torch._ops.OpOverload) and target.namespace in ("aten", "prims")

    def build(
        self,
        lowered: bytes,
        io: EngineIO,
        settings: BuildSettings,
        *,
        partition: str | None = None,
        cache_dir: str | os.PathLike | None = None,
    ) -> bytes:
        check_backend_options(settings, set(), "torchgraph")
        program, weights = unpack_torch_graph(lowered)
        self._module(program)  # a program that does not load fails its build, not its first run
        kept = {} if settings.strip_weights else safetensors.torch.load(weights)
        return pack_torch_graph(program, kept)

    def load(
        self,
        engine: bytes,
        io: EngineIO,
        weights: Mapping[str, torch.Tensor] | None,
        *,
        siblings: int = 0,
        cache: object = None,  # compiles nothing at load
    ) -> TorchGraphEngine:
        program, stored = unpack_torch_graph(engine)
        given = dict(weights) if weights is not None else safetensors.torch.load(stored)
        if not given and weights is None:
            raise RefitError("this torchgraph engine is weight-stripped: load it with its weights")
        return TorchGraphEngine(self._module(program), _ordered(given))

    def refit(self, engine: bytes, weights: Mapping[str, torch.Tensor]) -> bytes:
        program, _ = unpack_torch_graph(engine)
        return pack_torch_graph(program, dict(weights))

    @staticmethod
    def _module(program: bytes) -> torch.nn.Module:
        from compiler.program.export import load_program_bytes

        return load_program_bytes(program, "torchgraph engine", modules=()).module()
