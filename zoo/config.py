"""The zoo file: which models to compile, how, and where the run happens (pydantic v2 schema).

A zoo file has run-wide ``settings`` and a list of ``models``. The file as a whole must parse (valid
YAML without aliases, a mapping, known top-level keys, unique model names, valid settings): otherwise
the whole run stops with a :class:`ZooConfigError`. Each model entry is then validated on its own, so
one bad entry (a typo in a field, min > max, an unknown backend) fails that model with a message naming
the field and the fix, while the others still compile. The run-wide settings are :mod:`zoo.settings`.

An entry becomes one typed :class:`zoo.request.CompileRequest` per device (:meth:`ZooEntry.requests`);
nothing above this layer reads an entry's fields. ``kiln compile`` flags build an entry through this
same schema, so a flag and a zoo field cannot mean different things. Reading the file (YAML, the
whole-file checks, collecting invalid entries) is :mod:`zoo.zoo_file`.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    Field,
    field_validator,
    model_validator,
)

from compiler.backends.capabilities import backend_names
from compiler.device_name import check_device
from compiler.errors import KilnError
from compiler.options import DEFAULT_REPAIR_SECONDS, ON_BUILD_FAILURE, Calibration, CompileOptions
from compiler.validation.report import Tolerances
from zoo.generation import TASK as GENERATION_TASK
from zoo.generation import GenerationOptions
from zoo.request import CompileRequest, ValidationPlan
from zoo.settings import ZooSettings, _Strict
from zoo.sources import HF_TASKS, SOURCE_KINDS, source_for, source_kind
from zoo.sources.factory import FACTORY_RE, FactoryPolicy
from zoo.sources.hf_tasks import attention_problem

__all__ = ["ZooEntry"]

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]*$")
# A name becomes a directory (<name>-<device>.kiln, run copies add a suffix) and a registered model name
# (kiln.<name>.<target>): well under the 255 bytes a file name may have on common filesystems.
MAX_NAME_LENGTH = 100
# YAML nesting deeper than any zoo needs; the composer recurses per level (20,000 '[' overflow the stack).


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
    """Replaces the source's dynamic dims for one input. ``dims: []`` makes the input static;
    ``drop: true`` leaves out an optional input the source would pass (``token_type_ids`` of an
    ``hf:`` model: the compiled model then answers as with every token in segment A)."""

    dims: list[DimRange] = Field(default_factory=list)
    drop: bool = Field(default=False, description="compile without this (optional) input")

    @model_validator(mode="after")
    def _unique_axes(self) -> InputOverride:
        axes = [d.axis for d in self.dims]
        if len(axes) != len(set(axes)):
            raise ValueError(f"axes {axes} repeat; give each axis at most once")
        if self.drop and self.dims:
            raise ValueError("drop: true takes no dims (a dropped input has no ranges); remove one of them")
        return self


class PartitionOptions(_Strict):
    min_block_size: int = Field(default=1, ge=1)
    torch_executed_ops: list[str] = Field(default_factory=list)
    split_modules: Literal["auto"] | list[str] | None = Field(
        default=None, description="'auto' (each repeated block its own engine) or module class names"
    )
    precision: dict[str, Literal["fp32", "fp16", "bf16", "int8", "fp8", "torch"]] = Field(
        default_factory=dict, description="per-partition exceptions to the entry's precision (engine_3: fp32)"
    )


def _ignored_need_data(data: str | None, ignore_fields: list[str], where: str) -> None:
    if ignore_fields and data is None:
        raise ValueError(
            f"{where}.ignore_fields applies to recorded data (fields of {where}.data to leave out); "
            f"set {where}.data, or remove ignore_fields"
        )


class EntryValidation(_Strict):
    """What an entry is validated on: recorded inputs (else random inputs inside the ranges)."""

    data: str | None = Field(
        default=None, description="a .safetensors or .npz file, one array per input with a sample axis"
    )
    ignore_fields: list[str] = Field(
        default_factory=list,
        description="fields of data that name no model input, to leave out (e.g. token_type_ids)",
    )

    @model_validator(mode="after")
    def _ignore_needs_data(self) -> EntryValidation:
        _ignored_need_data(self.data, self.ignore_fields, "validation")
        return self


class EntryCalibration(_Strict):
    """What int8 (static) partitions are calibrated on (compiler.options.Calibration)."""

    data: str | None = Field(
        default=None,
        description="a .safetensors or .npz file, one array per input with a sample axis (as validation)",
    )
    samples: int = Field(default=16, ge=1, description="how many samples (the first N) to calibrate on")
    method: Literal["minmax", "entropy", "percentile"] = "minmax"
    allow_random: bool = Field(
        default=False, description="calibrate on random inputs when data is unset (meaningless scales)"
    )
    ignore_fields: list[str] = Field(
        default_factory=list,
        description="fields of data that name no model input, to leave out (as validation.ignore_fields)",
    )

    @model_validator(mode="after")
    def _ignore_needs_data(self) -> EntryCalibration:
        _ignored_need_data(self.data, self.ignore_fields, "calibration")
        return self


class ZooEntry(_Strict):
    """One model of the zoo: where it comes from and how to compile it (every CompileOptions field).

    The model comes from exactly one of ``source`` (any kind: docs/sources.md) and ``factory`` (the
    older spelling of ``source: factory:module:function``).
    """

    name: str = Field(description="package name: lowercase letters, digits, '_', '-', '.'")
    source: str | None = Field(
        default=None,
        description="hf:<folder or hub id>, pt2:<file>, models:/NAME/VERSION, models:/NAME@ALIAS, "
        "or factory:module:function",
    )
    factory: str | None = Field(default=None, description="'module:function' returning zoo.models.ModelCase")
    factory_kwargs: dict[str, Any] = Field(default_factory=dict)
    seed: int = Field(default=0, description="torch seed for the factory's random weights")
    task: str | None = Field(default=None, description="hf: sources: what the model is loaded for")
    revision: str | None = Field(default=None, description="hf: hub ids: a branch, tag or commit")
    trust_remote_code: bool = Field(
        default=False, description="hf: sources: run the Python code shipped with the model"
    )
    attn_implementation: str | None = Field(
        default=None,
        description="hf: sources: transformers' attention (eager, sdpa, ...); hub kernels are refused",
    )
    inputs: dict[str, InputOverride] = Field(default_factory=dict)
    precision: Literal["fp32", "fp16", "bf16", "int8", "fp8"] = "fp32"
    quantization: Literal["static", "dynamic"] = Field(
        default="static", description="int8: calibrated QDQ (static) or dynamic activation scales"
    )
    calibration: EntryCalibration = Field(default_factory=EntryCalibration)
    backend: str = "onnxruntime"
    # Where the model runs. ``targets`` is the older spelling of the same field.
    devices: list[str] = Field(
        default_factory=lambda: ["cpu"], min_length=1, validation_alias=AliasChoices("devices", "targets")
    )
    tolerances: dict[str, float | None] = Field(
        default_factory=dict,
        description="compiler.Tolerances fields; rel_l2 defaults by precision",
    )
    partition: PartitionOptions = Field(default_factory=PartitionOptions)
    strip_weights: bool = False
    workspace_bytes: int | None = Field(default=None, gt=0, description="TensorRT builder workspace")
    optimization_level: int | None = Field(default=None, ge=0, description="TensorRT builder level")
    backend_options: dict[str, Any] = Field(default_factory=dict, description="backend-specific settings")
    on_accuracy_failure: Literal["repair", "error"] = Field(
        default="repair",
        description="int8/fp16/bf16 missing its tolerances: raise its worst partitions' precision, or fail",
    )
    repair_seconds: float = Field(
        default=DEFAULT_REPAIR_SECONDS,
        ge=0,
        description="how long repair may search for the fewest layers to raise before raising partitions",
    )
    validation: EntryValidation = Field(default_factory=EntryValidation)
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        default="auto",
        description="replay the whole model as CUDA graphs: auto (CUDA devices, where capture works), on "
        "(required), off",
    )
    profiles: list[dict[str, int | list[int]]] = Field(
        default_factory=list,
        description="shape profiles, one {dimension name: size or [min, max] / [min, opt, max]} each "
        "(e.g. [{batch: 1}, {batch: 8}, {batch: [9, 32]}]): CUDA graphs captured at load for the sizes, "
        "a TensorRT optimization profile for each, latency per profile in the manifest",
    )
    pad_to_profile: Literal["off", "auto"] = Field(
        default="off",
        description="auto: pad a batch up to the next profile where the compile-time check showed padded "
        "rows leave the real rows' outputs unchanged (refused per profile, with the reason, elsewhere)",
    )
    generation: GenerationOptions | None = Field(
        default=None,
        description="task: text-generation: batch, cache and prompt limits (zoo/generation.py)",
    )
    on_build_failure: Literal[ON_BUILD_FAILURE] = Field(  # type: ignore[valid-type]
        default="torch",
        description="a partition whose engine build fails: runs in PyTorch, on ONNX Runtime, or fails",
    )

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if len(v) > MAX_NAME_LENGTH:
            raise ValueError(
                f"name is {len(v)} characters; at most {MAX_NAME_LENGTH} (it names the package directory "
                "and the registered model), e.g. 'bert-base'"
            )
        if not _NAME_RE.match(v):
            raise ValueError(
                f"name {v!r} must be lowercase letters, digits, '_', '-' or '.', starting with a letter or "
                "digit (it names the package directory), e.g. 'bert-base'"
            )
        return v

    @field_validator("factory")
    @classmethod
    def _factory(cls, v: str | None) -> str | None:
        if v is not None and not FACTORY_RE.match(v):
            raise ValueError(
                f"factory {v!r} must look like 'package.module:function', e.g. zoo.models:tiny_bert"
            )
        return v

    @field_validator("source")
    @classmethod
    def _source(cls, v: str | None) -> str | None:
        if v is not None:
            source_kind(v)  # ValueError names what is wrong with the string
        return v

    @field_validator("task")
    @classmethod
    def _task(cls, v: str | None) -> str | None:
        if v is not None and v not in HF_TASKS:
            raise ValueError(f"unknown task {v!r}; use one of {', '.join(HF_TASKS)}")
        return v

    @field_validator("attn_implementation")
    @classmethod
    def _attention(cls, v: str | None) -> str | None:
        problem = attention_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _one_source(self) -> ZooEntry:
        if (self.source is None) == (self.factory is None):
            raise ValueError(
                "source: give exactly one of source (e.g. hf:./my-model, pt2:model.pt2, "
                "models:/name@alias) and factory (module:function)"
            )
        kind = source_kind(self.source_uri)[0]
        if kind == "hf" and self.task is None:
            raise ValueError(f"task: required for hf: sources; use one of {', '.join(HF_TASKS)}")
        hf_fields = ("task", "revision", "trust_remote_code", "attn_implementation")
        hf_only = [f for f in hf_fields if f in self.model_fields_set]
        if self.task == GENERATION_TASK:  # any source of a causal LM compiles for generation
            hf_only = [f for f in hf_only if f != "task"]
        if kind != "hf" and hf_only:
            raise ValueError(f"{hf_only[0]}: applies to hf: sources only; remove it for {SOURCE_KINDS[kind]}")
        factory_only = [f for f in ("factory_kwargs", "seed") if f in self.model_fields_set]
        if kind != "factory" and factory_only:
            raise ValueError(
                f"{factory_only[0]}: applies to factory: sources only; remove it for {SOURCE_KINDS[kind]}"
            )
        return self

    @model_validator(mode="after")
    def _generation_fits(self) -> ZooEntry:
        if (self.task == GENERATION_TASK) != (self.generation is not None):
            raise ValueError(
                "generation: give it with task: text-generation (max_batch, max_cache_len, prompt_length)"
                if self.generation is None
                else "task: generation applies to task: text-generation; set task: text-generation"
            )
        if self.generation is not None:
            if self.inputs:
                raise ValueError(
                    "inputs: a text-generation entry's input ranges come from generation.max_batch and "
                    "generation.prompt_length; remove inputs"
                )
            if self.precision in ("int8", "fp8"):
                raise ValueError(
                    f"precision: {self.precision} is not supported for text-generation; use fp32"
                )
        return self

    @property
    def source_uri(self) -> str:
        """The model's source as one string (``factory: x:y`` reads as ``factory:x:y``)."""
        return self.source if self.source is not None else f"factory:{self.factory}"

    @field_validator("backend")
    @classmethod
    def _backend(cls, v: str) -> str:
        if v not in backend_names():
            raise ValueError(f"unknown backend {v!r}; use one of {', '.join(backend_names())}")
        return v

    @field_validator("devices")
    @classmethod
    def _devices(cls, v: list[str]) -> list[str]:
        for device in v:
            check_device(device)
        if len(v) != len(set(v)):
            raise ValueError(f"devices {v} repeat a device; list each once")
        return v

    @field_validator("tolerances")
    @classmethod
    def _tolerances(cls, v: dict[str, float | None]) -> dict[str, float | None]:
        Tolerances.from_dict(v)  # the compiler's own check: unknown names and ranges are refused here
        return v

    @model_validator(mode="after")
    def _options_valid(self) -> ZooEntry:
        # CompileOptions checks itself (fallback vs backend, block size, ...): one set of rules, for
        # every device of the entry (cuda_graphs 'on' needs a CUDA one).
        try:
            for device in self.devices:
                self.compile_options(device)
        except KilnError as exc:
            raise ValueError(str(exc)) from None
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

    def compile_options(self, device: str) -> CompileOptions:
        return CompileOptions(
            backend=self.backend,
            precision=self.precision,
            # generation: engines hold no weights, so prefill and decode share the package's one copy
            strip_weights=self.strip_weights or self.generation is not None,
            min_block_size=self.partition.min_block_size,
            torch_executed_ops=tuple(self.partition.torch_executed_ops),
            split_modules=_split_modules(self.partition.split_modules),
            workspace_bytes=self.workspace_bytes,
            optimization_level=self.optimization_level,
            backend_options=dict(self.backend_options),
            on_build_failure=self.on_build_failure,
            on_accuracy_failure=self.on_accuracy_failure,
            repair_seconds=self.repair_seconds,
            partition_precision=dict(self.partition.precision),
            device=device,
            cuda_graphs=self.cuda_graphs,
            profiles=tuple(self.profiles),
            quantization=self.quantization,
            calibration=Calibration(**self.calibration.model_dump()),
            pad_to_profile=self.pad_to_profile,
        )

    def package_name(self, device: str) -> str:
        """``<name>``; with several devices ``<name>-<device>`` (engines are per device)."""
        return self.name if len(self.devices) == 1 else f"{self.name}-{device.replace(':', '')}"

    def requests(
        self, settings: ZooSettings | None = None, zoo_dir: str | None = None
    ) -> list[CompileRequest]:
        """One typed compile request per device of this entry."""
        settings = settings or ZooSettings()
        hf = source_kind(self.source_uri)[0] == "hf"
        source = source_for(
            self.source_uri,
            task=self.task if hf or self.generation is None else None,
            revision=self.revision,
            trust_remote_code=self.trust_remote_code,
            attn_implementation=self.attn_implementation,
            inputs=dict(self.inputs),
            factory_kwargs=dict(self.factory_kwargs),
            seed=self.seed,
            policy=FactoryPolicy(tuple(settings.factory_packages), zoo_dir),
            base_dir=zoo_dir,
        )
        data = self.validation.data
        if data is not None and zoo_dir is not None and not Path(data).is_absolute():
            data = str(Path(zoo_dir) / data)  # relative to the zoo file, like its other paths
        validation = ValidationPlan(
            **settings.validation.model_dump(), data=data, ignore_fields=tuple(self.validation.ignore_fields)
        )
        generation = None
        if self.generation is not None:
            prompts = self.generation.validation.prompts
            if prompts is not None and zoo_dir is not None and not Path(prompts).is_absolute():
                prompts = str(Path(zoo_dir) / prompts)
            # the loosest float precision of the entry and its partitions sets the default tolerance
            used = {self.precision, *self.partition.precision.values()}
            loosest = next((p for p in ("bf16", "fp16") if p in used), "fp32")
            generation = self.generation.plan(prompts, loosest)
        calibration = self.calibration.data
        if calibration is not None and zoo_dir is not None and not Path(calibration).is_absolute():
            calibration = str(Path(zoo_dir) / calibration)
        return [
            CompileRequest(
                name=self.name,
                source=source,
                options=dataclasses.replace(
                    self.compile_options(device),
                    calibration=Calibration(**{**self.calibration.model_dump(), "data": calibration}),
                ),
                tolerances=Tolerances.from_dict(self.tolerances).resolved(self.precision),
                inputs=dict(self.inputs),
                validation=validation,
                package_name=self.package_name(device),
                generation=generation,
            )
            for device in self.devices
        ]


def _split_modules(value: str | list[str] | None) -> str | tuple[str, ...] | None:
    """The zoo field as CompileOptions takes it: "auto" stays a word, class names become a tuple."""
    if value == "auto" or value == ["auto"]:
        return "auto"
    return tuple(value) if value else None
