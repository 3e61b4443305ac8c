"""The one small protocol every engine backend meets.

A backend turns a lowered partition (an ONNX model whose weights are initializers with canonical
names ``w0, w1, ...``) into engine bytes, and engine bytes plus weights into a callable. A new
backend is one package that implements :class:`EngineBackend` plus its record in
:mod:`compiler.backends.capabilities` (what it builds from, quantizes, captures, builds profiles for),
which :func:`get_backend` reads to make it.
"""

from __future__ import annotations

import io
import os
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from compiler.backends.capabilities import capabilities
from compiler.inputs.specs import InputSpec

if TYPE_CHECKING:  # the settings and records here are read without torch (zoo files, manifests)
    import numpy as np
    import torch

FLOAT_PRECISIONS = ("fp32", "fp16", "bf16")
# Integer precisions: weights and activations quantized (compiler.quantize), per partition.
QUANTIZED_PRECISIONS = ("int8", "fp8")
PRECISIONS = (*FLOAT_PRECISIONS, *QUANTIZED_PRECISIONS)

# Lowering names every weight initializer ``w<position>``; other initializers are graph constants.
WEIGHT_NAME = re.compile(r"^w\d+$")


def is_weight_name(name: str) -> bool:
    return bool(WEIGHT_NAME.match(name))


@dataclass(frozen=True)
class EngineIO:
    """An engine's activation inputs (with min/opt/max ranges) and outputs, in call order."""

    inputs: tuple[InputSpec, ...]
    output_names: tuple[str, ...]
    output_dtypes: tuple[str, ...]

    def to_dict(self) -> dict:
        return {
            "inputs": [s.to_dict() for s in self.inputs],
            "output_names": list(self.output_names),
            "output_dtypes": list(self.output_dtypes),
        }

    @classmethod
    def from_dict(cls, data: dict) -> EngineIO:
        return cls(
            inputs=tuple(InputSpec.from_dict(d) for d in data["inputs"]),
            output_names=tuple(data["output_names"]),
            output_dtypes=tuple(data["output_dtypes"]),
        )


@dataclass(frozen=True)
class BuildSettings:
    """Everything that changes the bytes of an engine (and so enters fingerprints and cache keys)."""

    precision: str = "fp32"
    strip_weights: bool = False
    workspace_bytes: int | None = None
    optimization_level: int | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    # Quantized partitions only: how the graph is quantized (mode, calibration method, per-channel),
    # which decides where Q/DQ nodes go. Left out of to_dict when None, so float engines keep their keys.
    quantization: Mapping[str, Any] | None = None
    # Shape profiles ({dimension name: size or (min[, opt], max)} each) a backend builds engines for
    # (Inductor: one static-shape compile per fixed profile; TensorRT: one optimization profile each);
    # empty for backends that build one dynamic engine.
    profiles: tuple[Mapping[str, Any], ...] = ()
    # fp16/bf16 partitions only: the ops kept in fp32 (compiler.engine_build.float_ops). Left out of
    # to_dict when empty, so every other engine keeps its key.
    float_ops: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        data = {
            "precision": self.precision,
            "strip_weights": self.strip_weights,
            "workspace_bytes": self.workspace_bytes,
            "optimization_level": self.optimization_level,
            "options": dict(sorted(self.options.items())),
        }
        if self.quantization is not None:
            data["quantization"] = dict(sorted(self.quantization.items()))
        if self.profiles:  # left out when empty: engines without profiles keep their cache keys
            data["profiles"] = [
                {k: list(v) if isinstance(v, tuple) else v for k, v in sorted(p.items())}
                for p in self.profiles
            ]
        if self.float_ops:
            data["float_ops"] = list(self.float_ops)
        return data


def check_backend_options(settings: BuildSettings, allowed: frozenset[str] | set[str], library: str) -> None:
    """Refuse ``backend_options`` a backend does not know: a typo must not be silently ignored."""
    unknown = sorted(set(settings.options) - set(allowed))
    if unknown:
        from compiler.errors import BuildSettingsError

        raise BuildSettingsError(
            f"unknown backend_options {unknown} for {library}; it takes {sorted(allowed)}"
        )


@runtime_checkable
class Engine(Protocol):
    """A loaded engine: torch tensors in (activations, in EngineIO order), torch tensors out."""

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]: ...


@runtime_checkable
class EngineBackend(Protocol):
    name: str  # its record's name in compiler.backends.capabilities

    @property
    def graph_format(self) -> str:
        """What ``build`` takes: the record's ``graph_format`` (:func:`graph_format` reads it)."""
        ...

    def library_version(self) -> str:
        """Version of the library that builds and runs engines (part of every cache key)."""
        ...

    def engine_target(self) -> str:
        """The engine target: what engines built now run on, e.g. ``cpu`` or ``cuda:sm_90`` (part of
        every cache key, recorded in the manifest). Not the device a model runs on."""
        ...

    def check_runnable(self) -> None:
        """BackendUnavailableError unless engines built now can also run on this machine (TensorRT-RTX
        builds on an H100 but cannot run there); ``get_backend("auto")`` skips a backend that raises."""
        ...

    def supports(self, target: Any) -> bool:
        """Whether an ATen op overload (an fx node target) can go into an engine."""
        ...

    def build(
        self,
        lowered: bytes,
        io: EngineIO,
        settings: BuildSettings,
        *,
        partition: str | None = None,
        cache_dir: str | os.PathLike | None = None,
    ) -> bytes:
        """Engine bytes for a lowered partition; stripped of weights when settings.strip_weights.
        ``lowered`` is the partition in the backend's ``graph_format``: an ONNX model (``"onnx"``), or
        a torch graph archive (:func:`pack_torch_graph`, ``"torch.export"``). An EngineBuildError names
        ``partition`` (the ONNX graph cannot: one lowered graph serves every partition of its
        fingerprint) and the failing node where the library says it.
        ``cache_dir`` is the engine cache's directory, beside which a backend may keep build-time
        caches (TensorRT's timing cache)."""
        ...

    def load(
        self, engine: bytes, io: EngineIO, weights: Mapping[str, torch.Tensor] | None, *, siblings: int = 0
    ) -> Engine:
        """A callable engine. Stripped engines need ``weights`` (canonical name -> tensor); for full
        engines, given weights replace the built-in ones (refit). ``siblings``: how many other engines
        of this backend the same module runs (a backend may size its threads for sharing the CPU)."""
        ...

    def refit(self, engine: bytes, weights: Mapping[str, torch.Tensor]) -> bytes:
        """New engine bytes with new weights, without a rebuild (full engines)."""
        ...


# What a backend's ``build`` takes (its record's ``graph_format``): the lowered ONNX model, or a torch
# graph archive (:func:`pack_torch_graph`) for backends that compile the partition's exported program
# themselves (Inductor).
GRAPH_FORMATS = ("onnx", "torch.export")
_GRAPH_PROGRAM, _GRAPH_WEIGHTS = "program.pt2", "weights.safetensors"


def graph_format(backend: EngineBackend) -> str:
    """What ``backend.build`` takes, from its record (compiler.backends.capabilities)."""
    return capabilities(backend.name).graph_format


class RecordedBackend:
    """What every backend's record already says, for a backend class to inherit: ``graph_format``, and
    a ``check_runnable`` that finds nothing to refuse (a backend that can refuse overrides it)."""

    name: str

    @property
    def graph_format(self) -> str:
        return graph_format(self)  # type: ignore[arg-type]

    def check_runnable(self) -> None:
        return None


def pack_torch_graph(program: bytes, weights: Mapping[str, torch.Tensor]) -> bytes:
    """A lowered partition as a torch graph: the partition's exported program (``torch.export.save``
    bytes, activations then canonical weights ``w0..wN`` as inputs, precision cast in the graph) and the
    representative instance's weights (safetensors), in one uncompressed zip."""
    import safetensors.torch

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        archive.writestr(_GRAPH_PROGRAM, program)
        archive.writestr(_GRAPH_WEIGHTS, safetensors.torch.save(dict(weights)))
    return buffer.getvalue()


def unpack_torch_graph(graph: bytes) -> tuple[bytes, bytes]:
    """(exported program bytes, safetensors weight bytes) of :func:`pack_torch_graph`'s archive."""
    with zipfile.ZipFile(io.BytesIO(graph)) as archive:
        return archive.read(_GRAPH_PROGRAM), archive.read(_GRAPH_WEIGHTS)


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU copy of ``tensor``; bfloat16 through ml_dtypes (numpy has none)."""
    import torch

    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()
