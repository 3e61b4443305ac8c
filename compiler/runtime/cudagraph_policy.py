"""CUDA graphs policy: the compile-time check's record and :func:`decide`.

The half of :mod:`compiler.runtime.cudagraphs` that needs no torch: a manifest's report decodes its
``CaptureCheck`` here, so reading a package never imports the CUDA-graph runtime. The option's modes
and their check (``check_mode``) live with every other option check in :mod:`compiler.options`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from compiler.backends.capabilities import capturable
from compiler.errors import CudaGraphError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class CaptureCheck:
    """The compile-time capture check: whether the module captures and replays correctly, and why not."""

    capturable: bool
    reason: str | None = None
    shapes: tuple[tuple[int, ...], ...] = ()
    seconds: float = 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["shapes"] = [list(s) for s in self.shapes]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CaptureCheck:
        return cls(
            bool(data["capturable"]),
            data.get("reason"),
            tuple(tuple(int(d) for d in s) for s in data.get("shapes", ())),
            float(data.get("seconds", 0.0)),
        )


@dataclass(frozen=True)
class Decision:
    """Whether a module replays CUDA graphs, and why not."""

    enabled: bool
    reason: str | None


def decide(
    mode: str, device: torch.device, engine_backends: Iterable[str], check: CaptureCheck | None
) -> Decision:
    """The one policy: graphs where the mode allows, the device is CUDA, every engine runs on PyTorch's
    stream and the compile-time check (when recorded) passed. ``"on"`` where that fails: CudaGraphError."""
    if mode == "off":
        return Decision(False, "cuda_graphs is 'off'")
    reason = None
    if device.type != "cuda":
        reason = f"the model runs on {device}"
    else:
        # Only engines on PyTorch's current CUDA stream are recorded by a stream capture (each
        # backend's record says: ONNX Runtime launches on its own streams, never captured).
        outside = sorted({b for b in engine_backends if not capturable(b)})
        if outside:
            reason = f"engines of {outside} run outside PyTorch's CUDA stream"
        elif check is not None and not check.capturable:
            reason = f"the compile-time capture check failed: {check.reason}"
    if reason is not None and mode == "on":
        raise CudaGraphError(f"cuda_graphs 'on', but this module cannot be graphed: {reason}")
    return Decision(reason is None, reason)
