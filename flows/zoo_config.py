"""The zoo file: which models to compile, how, and where the run happens (pydantic v2 schema).

A zoo file has run-wide ``settings`` and a list of ``models``. The file as a whole must parse (valid
YAML, a mapping, known top-level keys, unique model names, valid settings): otherwise the whole run
stops with a :class:`ZooConfigError`. Each model entry is then validated on its own, so one bad entry
(a typo in a field, min > max, an unknown backend) fails that model with a message naming the field
and the fix, while the others still compile.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from compiler.errors import KilnError

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
_TARGET_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")
_FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

# Backends a zoo may name. The compiler's registry is the authority when it exists; the fallback
# keeps the schema usable (and its error messages helpful) before that registry lands.
_FALLBACK_BACKENDS = ("onnxruntime", "tensorrt", "tensorrt_rtx")

# Accuracy tolerance (relative L2 vs eager) per precision, used when a model sets none.
DEFAULT_REL_L2 = {"fp32": 1e-4, "fp16": 2e-2, "bf16": 5e-2}


class ZooConfigError(KilnError, ValueError):
    """A zoo file or one of its entries is invalid; the message names the field and the fix."""


def known_backends() -> tuple[str, ...]:
    """Backend names the compiler knows (installed or not)."""
    try:
        import compiler.backends as backends
    except ImportError:  # pragma: no cover - compiler is part of this repo
        return _FALLBACK_BACKENDS
    for attr in ("BACKENDS", "BACKEND_NAMES", "KNOWN_BACKENDS"):
        names = getattr(backends, attr, None)
        if names:
            return tuple(names)
    fn = getattr(backends, "backend_names", None) or getattr(backends, "known_backends", None)
    if callable(fn):
        return tuple(fn())
    return _FALLBACK_BACKENDS


class _Strict(BaseModel):
    # A typo in a field name must fail loudly, not be ignored.
    model_config = ConfigDict(extra="forbid", frozen=True)


class DimRange(_Strict):
    """One dynamic axis of one input: its axis, the dimension's name and its range."""

    axis: int = Field(ge=0, description="axis index in the input tensor")
    name: str = Field(description="dimension name; inputs that share a name share the dimension")
    min: int = Field(ge=0)
    max: int = Field(ge=1)

    @field_validator("name")
    @classmethod
    def _identifier(cls, v: str) -> str:
        if not v.isidentifier():
            raise ValueError(f"dimension name {v!r} must be a Python identifier like 'batch' or 'seq'")
        return v

    @model_validator(mode="after")
    def _ordered(self) -> DimRange:
        if self.min > self.max:
            raise ValueError(
                f"dimension {self.name!r} (axis {self.axis}) has min {self.min} > max {self.max}; "
                "set min <= max"
            )
        return self


class InputOverride(_Strict):
    """Replaces the factory's dynamic dims for one input. ``dims: []`` makes the input static."""

    dims: list[DimRange] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_axes(self) -> InputOverride:
        axes = [d.axis for d in self.dims]
        if len(axes) != len(set(axes)):
            raise ValueError(f"axes {axes} repeat; give each axis at most once")
        return self


class Tolerances(_Strict):
    rel_l2: float | None = Field(
        default=None, gt=0, description="max relative L2 error vs eager; default by precision"
    )
    max_latency_ratio: float | None = Field(
        default=None, gt=0, description="max compiled/eager latency ratio; unset = not gated"
    )


class PartitionOptions(_Strict):
    min_block_size: int = Field(default=1, ge=1)
    torch_executed_ops: list[str] = Field(default_factory=list)
    split_modules: list[str] | None = None


class ZooEntry(_Strict):
    """One model of the zoo: where it comes from and how to compile it."""

    name: str = Field(description="package name: lowercase letters, digits, '_', '-', '.'")
    factory: str = Field(description="'module:function' returning zoo.models.ModelCase")
    factory_kwargs: dict[str, Any] = Field(default_factory=dict)
    seed: int = Field(default=0, description="torch seed for the factory's random weights")
    inputs: dict[str, InputOverride] = Field(default_factory=dict)
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"
    backend: str = "onnxruntime"
    targets: list[str] = Field(default_factory=lambda: ["cpu"], min_length=1)
    tolerances: Tolerances = Field(default_factory=Tolerances)
    partition: PartitionOptions = Field(default_factory=PartitionOptions)
    strip_weights: bool = False
    on_build_failure: Literal["torch", "onnxruntime", "error"] = Field(
        default="torch",
        description="a partition whose engine build fails: runs in PyTorch, on ONNX Runtime, or fails",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError(
                f"name {v!r} must be lowercase letters, digits, '_', '-' or '.', starting with a letter or "
                "digit (it names the package directory), e.g. 'bert-base'"
            )
        return v

    @field_validator("factory")
    @classmethod
    def _factory(cls, v: str) -> str:
        if not _FACTORY_RE.match(v):
            raise ValueError(
                f"factory {v!r} must look like 'package.module:function', e.g. zoo.models:tiny_bert"
            )
        return v

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        names = known_backends()
        if v not in names:
            raise ValueError(f"unknown backend {v!r}; use one of {', '.join(names)}")
        return v

    @field_validator("targets")
    @classmethod
    def _targets(cls, v: list[str]) -> list[str]:
        for t in v:
            if not _TARGET_RE.match(t):
                raise ValueError(f"target {t!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'")
        if len(v) != len(set(v)):
            raise ValueError(f"targets {v} repeat a device; list each once")
        return v

    @model_validator(mode="after")
    def _fallback_differs(self) -> ZooEntry:
        if self.on_build_failure == "onnxruntime" and self.backend == "onnxruntime":
            raise ValueError(
                "on_build_failure 'onnxruntime' with backend 'onnxruntime': ONNX Runtime cannot fall back to "
                "itself; use 'torch' or 'error'"
            )
        return self

    @model_validator(mode="after")
    def _shared_dims_agree(self) -> ZooEntry:
        seen: dict[str, tuple[str, int, int]] = {}
        for input_name, override in self.inputs.items():
            for d in override.dims:
                if d.name in seen and seen[d.name][1:] != (d.min, d.max):
                    other, lo, hi = seen[d.name]
                    raise ValueError(
                        f"dimension {d.name!r} is [{lo}, {hi}] in input {other!r} but [{d.min}, {d.max}] in "
                        f"input {input_name!r}; a shared dimension needs one range"
                    )
                seen[d.name] = (input_name, d.min, d.max)
        return self

    def rel_l2(self) -> float:
        """The accuracy tolerance this entry is held to."""
        return (
            self.tolerances.rel_l2 if self.tolerances.rel_l2 is not None else DEFAULT_REL_L2[self.precision]
        )

    def compile_options(self) -> dict[str, Any]:
        """Keyword arguments for ``compiler.CompileOptions``."""
        return {
            "backend": self.backend,
            "precision": self.precision,
            "strip_weights": self.strip_weights,
            "min_block_size": self.partition.min_block_size,
            "torch_executed_ops": tuple(self.partition.torch_executed_ops),
            "split_modules": tuple(self.partition.split_modules) if self.partition.split_modules else None,
            "on_build_failure": self.on_build_failure,
        }


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
    engine_cache: str | None = Field(default=".kiln/engine-cache", description="unset = no persistent cache")
    task_runner: Literal["thread", "dask"] = "thread"
    max_workers: int = Field(default=2, ge=1, description="threads for engine builds per model")
    parallel_models: int = Field(default=2, ge=1)
    dask: DaskSettings = Field(default_factory=DaskSettings)
    build_concurrency: dict[str, int] = Field(
        default_factory=lambda: {"cpu": 2, "cuda": 1},
        description="concurrent engine builds per target ('cuda' covers every cuda:N)",
    )
    build_retries: int = Field(default=2, ge=0)
    build_retry_backoff: float = Field(default=2.0, ge=0, description="seconds; doubles per retry")
    tracking: bool | None = Field(default=None, description="record packages in MLflow; unset = if installed")
    validation: ValidationSettings = Field(default_factory=ValidationSettings)

    @field_validator("build_concurrency")
    @classmethod
    def _limits(cls, v: dict[str, int]) -> dict[str, int]:
        for target, n in v.items():
            if not _TARGET_RE.match(target) or n < 1:
                raise ValueError(f"build_concurrency {target!r}: {n} needs a device key and a limit >= 1")
        return v

    def build_limit(self, target: str) -> int:
        family = target.split(":")[0]
        return self.build_concurrency.get(target, self.build_concurrency.get(family, 1))

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


class _ZooFile(_Strict):
    settings: ZooSettings = Field(default_factory=ZooSettings)
    models: list[dict[str, Any]] = Field(min_length=1)


@dataclass(frozen=True)
class InvalidEntry:
    """A model entry that failed validation: reported as a failed model, never compiled."""

    name: str
    error: str


@dataclass
class Zoo:
    settings: ZooSettings
    entries: list[ZooEntry] = field(default_factory=list)
    invalid: list[InvalidEntry] = field(default_factory=list)
    source: str | None = None

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries] + [i.name for i in self.invalid]


def _format_errors(exc: ValidationError, prefix: str) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        where = f"{prefix}.{loc}" if loc else prefix
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown field; remove it or check its spelling against deploy/zoo.yaml"
        elif err["type"] == "missing":
            msg = "required field is missing; add it"
        got = err.get("input")
        # The offending scalar helps; a whole echoed mapping (model-level checks) only adds noise.
        shown = err["type"] not in ("missing", "extra_forbidden") and not isinstance(got, dict | list)
        got_text = f" (got {got!r})" if shown and got is not None else ""
        lines.append(f"{where}: {msg}{got_text}")
    return "; ".join(lines)


def parse_zoo(data: Any, source: str = "<zoo>") -> Zoo:
    """Validate an already-loaded zoo mapping. Whole-file problems raise; entry problems are collected."""
    if not isinstance(data, dict):
        raise ZooConfigError(
            f"{source}: expected a mapping with 'settings' and 'models', got {type(data).__name__}"
        )
    try:
        zoo_file = _ZooFile.model_validate(data)
    except ValidationError as exc:
        raise ZooConfigError(f"{source}: {_format_errors(exc, 'zoo')}") from None
    zoo = Zoo(settings=zoo_file.settings, source=source)
    seen: set[str] = set()
    for i, raw in enumerate(zoo_file.models):
        raw_name = raw.get("name") if isinstance(raw, dict) else None
        label = str(raw_name) if isinstance(raw_name, str) and raw_name else f"models[{i}]"
        if label in seen:
            raise ZooConfigError(f"{source}: models[{i}].name: {label!r} is used twice; names must be unique")
        seen.add(label)
        try:
            zoo.entries.append(ZooEntry.model_validate(raw))
        except ValidationError as exc:
            zoo.invalid.append(InvalidEntry(label, _format_errors(exc, f"models[{i}] ({label})")))
    return zoo


def load_zoo(path: str | Path) -> Zoo:
    """Read and validate a zoo file (see deploy/zoo.yaml for an annotated example)."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ZooConfigError(f"cannot read zoo file {str(path)!r}: {exc.strerror}; check the path") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ZooConfigError(f"{path}: not valid YAML: {exc}; fix the syntax at the position shown") from None
    return parse_zoo(data, source=str(path))


def resolve_factory(spec: str, field_name: str = "factory") -> Callable[..., Any]:
    """Import ``module:function``; a failure names the field, the cause and the fix."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ZooConfigError(
            f"{field_name}: cannot import module {module_name!r} ({exc}); "
            "make sure it is installed or on PYTHONPATH (run from the repository root)"
        ) from None
    except Exception as exc:  # a module that raises on import is still the user's module to fix
        raise ZooConfigError(
            f"{field_name}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from None
    fn = getattr(module, attr, None)
    if fn is None:
        # Suggest the functions the module itself defines (not what it imports).
        defined = sorted(
            n
            for n, v in vars(module).items()
            if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_")
        )
        raise ZooConfigError(
            f"{field_name}: module {module_name!r} has no {attr!r}; "
            f"functions there: {', '.join(defined[:15])}"
        )
    if not callable(fn):
        raise ZooConfigError(f"{field_name}: {spec!r} is a {type(fn).__name__}, not a callable factory")
    return fn


def check_target(target: str) -> None:
    """Raise ZooConfigError unless ``target`` is a device present on this machine."""
    if target == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise ZooConfigError(
            f"targets: {target!r} needs a CUDA device, but none is visible here; run this model on a GPU "
            "worker (see deploy/prefect.yaml) or set targets: [cpu]"
        )
    index = int(target.split(":")[1]) if ":" in target else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise ZooConfigError(f"targets: {target!r} does not exist; this machine has cuda:0..cuda:{count - 1}")


def check_backend_available(backend: str, target: str | None = None) -> None:
    """Raise ZooConfigError when the backend is not installed here or cannot build for ``target``."""
    try:
        import compiler.backends as backends
    except ImportError:  # pragma: no cover
        return
    get_backend = getattr(backends, "get_backend", None)
    if get_backend is None:
        return
    try:
        instance = get_backend(backend)
    except KilnError as exc:
        raise ZooConfigError(f"backend: {backend!r} cannot be used here: {exc}") from None
    if target is not None and target.startswith("cuda"):
        builds_for = instance.target_device()
        if not builds_for.startswith("cuda"):
            raise ZooConfigError(
                f"targets: {target!r} needs GPU engines, but backend {backend!r} builds for {builds_for!r} "
                "here; use backend: tensorrt (or auto) for cuda targets, or targets: [cpu]"
            )
