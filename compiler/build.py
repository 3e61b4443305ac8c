"""Engine build: one engine per unique fingerprint, through the persistent engine cache.

The cache key is the fingerprint plus backend name and version, target device and build settings,
so a structure built once (by any model, run or worker) is never built again, and a corrupt entry is
rebuilt rather than used.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from compiler.backends import get_backend
from compiler.backends.base import EngineIO
from compiler.cache import EngineCache
from compiler.dedup import DedupPlan
from compiler.errors import EngineBuildError
from compiler.lower import engine_io, lower
from compiler.partition import PartitionPlan


@dataclass(frozen=True)
class EngineArtifact:
    """A built (or cache-hit) engine for one fingerprint."""

    fingerprint: str
    cache_key: str
    engine: bytes
    io: EngineIO
    stripped: bool
    cache_hit: bool
    seconds: float
    lower_seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return len(self.engine)

    def summary(self) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "cache_key": self.cache_key,
            "bytes": self.bytes,
            "stripped": self.stripped,
            "cache_hit": self.cache_hit,
            "seconds": round(self.seconds, 4),
            "lower_seconds": round(self.lower_seconds, 4),
        }


def build_engine(
    plan: PartitionPlan, dedup: DedupPlan, fingerprint: str, *, cache: EngineCache | None = None
) -> EngineArtifact:
    """Lower and build the engine for ``fingerprint`` unless the cache already holds it."""
    start = time.perf_counter()
    backend = get_backend(plan.options.backend)
    settings = plan.options.build_settings()
    representative = next(p for p in plan.partitions if p.name == dedup.unique[fingerprint])
    io = engine_io(plan, representative)
    key = EngineCache.key(
        fingerprint=fingerprint,
        backend=backend.name,
        library_version=backend.library_version(),
        target_device=backend.target_device(),
        settings=settings.to_dict(),
    )
    lowered_seconds = 0.0

    def build() -> bytes:
        nonlocal lowered_seconds
        lowered = lower(plan, dedup, fingerprint)
        lowered_seconds = lowered.seconds
        try:
            return backend.build(lowered.onnx, lowered.io, settings)
        except EngineBuildError as exc:
            if exc.partition is None:  # the backend sees ONNX only; name the partition for the report
                raise EngineBuildError(
                    f"{representative.name} ({fingerprint[:12]}): {exc}",
                    partition=representative.name,
                    node=exc.node,
                ) from exc
            raise

    if cache is None:
        engine, hit = build(), False
    else:
        engine, hit = cache.get_or_build(
            key, build, meta={"partition": representative.name, "io": io.to_dict()}
        )
    return EngineArtifact(
        fingerprint,
        str(key),
        engine,
        io,
        settings.strip_weights,
        hit,
        time.perf_counter() - start,
        lowered_seconds,
    )
