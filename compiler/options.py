"""CompileOptions: every setting of one compile, in one value object (no long argument lists)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from compiler.backends.base import PRECISIONS, BuildSettings
from compiler.errors import PartitionError

# What a partition whose engine build fails becomes (see CompileOptions.on_build_failure).
ON_BUILD_FAILURE = ("torch", "onnxruntime", "error")
DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


@dataclass(frozen=True)
class CompileOptions:
    """What to build and how.

    ``split_modules``: ``None`` (capability partitioning only), ``"auto"`` (detect repeated blocks) or
    class names (e.g. ``("BertLayer",)``) whose instances each become their own engine, so build time
    grows with the number of unique blocks, not with depth.

    ``on_build_failure``: what a partition whose engine build fails (``EngineBuildError``) becomes:
    ``"torch"`` (its original submodule runs eagerly in PyTorch, in the model's own precision),
    ``"onnxruntime"`` (the same lowered ONNX is built with ONNX Runtime; if that fails too, PyTorch) or
    ``"error"`` (the compile fails: strict release pipelines). The report lists every failure. It does
    not change an engine's bytes, so it is not a build setting and stays out of engine cache keys.
    """

    backend: str = "onnxruntime"
    precision: str = "fp32"
    strip_weights: bool = False
    min_block_size: int = 1
    torch_executed_ops: tuple[str, ...] = ()
    split_modules: str | tuple[str, ...] | None = None
    workspace_bytes: int | None = None
    optimization_level: int | None = None
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    on_build_failure: str = "torch"
    # Where the model runs: its export inputs, engine builds, engine runtime and validation.
    device: str = "cpu"

    def __post_init__(self) -> None:
        if not isinstance(self.device, str) or not DEVICE_RE.match(self.device):
            raise PartitionError(f"device {self.device!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'")
        if self.precision not in PRECISIONS:
            raise PartitionError(
                f"precision {self.precision!r} is not supported; expected one of {PRECISIONS}"
            )
        if self.on_build_failure not in ON_BUILD_FAILURE:
            raise PartitionError(
                f"on_build_failure {self.on_build_failure!r} is not supported; expected one of "
                f"{ON_BUILD_FAILURE}"
            )
        if self.on_build_failure == "onnxruntime" and self.backend == "onnxruntime":
            raise PartitionError(
                "on_build_failure 'onnxruntime' with backend 'onnxruntime': ONNX Runtime cannot fall back "
                "to itself; use 'torch' or 'error'"
            )
        if not isinstance(self.min_block_size, int) or self.min_block_size < 1:
            raise PartitionError(f"min_block_size must be an integer >= 1, got {self.min_block_size!r}")
        object.__setattr__(self, "torch_executed_ops", tuple(str(op) for op in self.torch_executed_ops))
        split = self.split_modules
        if split is not None and split != "auto":
            split = (split,) if isinstance(split, str) else tuple(split)
            object.__setattr__(self, "split_modules", split)

    def build_settings(self) -> BuildSettings:
        # on_build_failure is left out on purpose: it decides what happens after a build, not its bytes.
        return BuildSettings(
            precision=self.precision,
            strip_weights=self.strip_weights,
            workspace_bytes=self.workspace_bytes,
            optimization_level=self.optimization_level,
            options=dict(self.backend_options),
        )

    def to_dict(self) -> dict:
        data = asdict(self)
        data["torch_executed_ops"] = list(self.torch_executed_ops)
        data["split_modules"] = (
            self.split_modules if isinstance(self.split_modules, str | None) else list(self.split_modules)
        )
        data["backend_options"] = dict(self.backend_options)
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompileOptions:
        data = dict(data)
        if isinstance(data.get("split_modules"), list):
            data["split_modules"] = tuple(data["split_modules"])
        data["torch_executed_ops"] = tuple(data.get("torch_executed_ops", ()))
        return cls(**data)
