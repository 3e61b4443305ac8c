"""A zoo file's run-wide ``settings`` (pydantic v2): where packages, workspace and engine cache go, how
models and engine builds run in parallel, validation runs, tracking, and which packages may build
models. CLI flags and deployment parameters override them (:meth:`ZooSettings.with_overrides`). The
models' entries are :mod:`zoo.config`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from compiler.cache.paths import choose
from compiler.device_name import DEVICE_RE
from zoo.sources.factory import DEFAULT_FACTORY_PACKAGES


class _Strict(BaseModel):
    # A typo in a field name must fail loudly, not be ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class DaskSettings(_Strict):
    address: str | None = Field(default=None, description="scheduler address; unset = a LocalCluster")
    n_workers: int = Field(default=2, ge=1)
    threads_per_worker: int = Field(default=1, ge=1)
    processes: bool = False


class ValidationSettings(_Strict):
    samples: int = Field(default=3, ge=1)
    warmup: int = Field(default=3, ge=0)
    runs: int = Field(default=20, ge=1)
    seed: int = 0


class ZooSettings(_Strict):
    """Run-wide settings. CLI flags override them."""

    out_dir: str = "out"
    workspace: str = ".kiln/workspace"
    engine_cache: str | bool | None = Field(
        default=None,
        description=(
            "a directory or an object-store URL shared by workers (s3://bucket/prefix, gs://..., file://...; "
            "credentials from the environment, never here); false: none; unset: $KILN_CACHE_DIR, "
            "else .kiln/engine-cache"
        ),
    )
    task_runner: Literal["thread", "dask"] = "thread"
    max_workers: int = Field(default=2, ge=1, description="threads for engine builds per model")
    parallel_models: int = Field(default=2, ge=1)
    dask: DaskSettings = Field(default_factory=DaskSettings)
    build_concurrency: dict[str, int] = Field(
        default_factory=lambda: {"cpu": 2, "cuda": 1},
        description="concurrent engine builds per device ('cuda' covers every cuda:N)",
    )
    build_retries: int = Field(default=2, ge=0)
    build_retry_backoff: float = Field(default=2.0, ge=0, description="seconds; doubles per retry")
    tracking: bool | None = Field(default=None, description="record packages in MLflow; unset = if installed")
    validation: ValidationSettings = Field(default_factory=ValidationSettings)
    factory_packages: list[str] = Field(
        default_factory=lambda: list(DEFAULT_FACTORY_PACKAGES),
        description="packages whose functions may build models (besides the zoo file's own directory)",
    )

    @field_validator("build_concurrency")
    @classmethod
    def _limits(cls, v: dict[str, int]) -> dict[str, int]:
        for device, n in v.items():
            if not DEVICE_RE.match(device) or n < 1:
                raise ValueError(f"build_concurrency {device!r}: {n} needs a device key and a limit >= 1")
        return v

    def build_limit(self, device: str) -> int:
        family = device.split(":")[0]
        return self.build_concurrency.get(device, self.build_concurrency.get(family, 1))

    def with_overrides(self, overrides: dict[str, Any] | None) -> ZooSettings:
        """These settings with CLI flags or deployment parameters written over them (validated again)."""
        if not overrides:
            return self
        return ZooSettings.model_validate({**self.model_dump(exclude_unset=True), **overrides})

    def engine_cache_dir(self) -> str | None:
        """The engine cache of this run: the zoo file's (or CLI's), else $KILN_CACHE_DIR, else the default."""
        return self.engine_cache_choice()[0]

    def engine_cache_choice(self) -> tuple[str | None, str]:
        """(directory or URL, or None, where the choice came from) for the summary: the compiler's one
        decision (compiler.cache.paths.choose), with the project's default folder."""
        return choose(self.engine_cache, named="settings.engine_cache", project=True)

    def tracking_enabled(self) -> bool:
        if self.tracking is not None:
            return self.tracking
        return registry_available()


def registry_available() -> bool:
    """Whether the MLflow registry seam can be used (the other half of the pipeline is installed)."""
    import importlib.util

    try:
        return (
            importlib.util.find_spec("registry") is not None
            and importlib.util.find_spec("tasks.registry") is not None
        )
    except (ImportError, ValueError):
        return False
