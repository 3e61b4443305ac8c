"""CompileRequest: one model, one device, everything a compile needs, typed and validated once.

A zoo entry (``zoo.config.ZooEntry.requests``) and the ``kiln compile`` flags (which build an entry
through the same schema) produce it; tasks, flows and the registry read it by attribute. It holds the
model source (resolved to an identity without loading), the ``CompileOptions`` (which validate
themselves, device included), the input-range overrides, the tolerances the result is held to and the
validation settings.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiler.generation.spec import program_options
from compiler.options import CompileOptions
from compiler.quantization.torchao_guard import keep_torchao_out_of_transformers
from compiler.validation.report import Tolerances
from zoo.errors import ZooConfigError
from zoo.generation import GenerationPlan
from zoo.inputs import InputOverrideLike, apply_overrides
from zoo.sources.base import LoadedCase, ModelSource, SourceIdentity

if TYPE_CHECKING:  # requests are data: torch only where recorded inputs are read
    from compiler.inputs.data import ValidationData
    from compiler.inputs.specs import InputSpec


@dataclass(frozen=True)
class ValidationPlan:
    """How validation samples and times a compiled model (run-wide settings, or the CLI's)."""

    samples: int = 3
    warmup: int = 3
    runs: int = 20
    seed: int = 0
    data: str | None = None  # recorded inputs (compiler.validation_data); None: random inside the ranges
    ignore_fields: tuple[str, ...] = ()  # fields of data that name no model input, left out

    def dataset(self, specs: Sequence[InputSpec]) -> ValidationData | None:
        """The recorded inputs for a model with these input specs (None: validate on random inputs).

        A :class:`ValidationDataError` starting ``validation.data:``; a field no input takes is named
        with ``validation.ignore_fields``, the entry's way to leave it out."""
        if self.data is None:
            return None
        from compiler.errors import ValidationDataError
        from compiler.inputs.data import validation_data

        try:
            return validation_data(
                specs,
                self.data,
                ignore_fields=self.ignore_fields,
                ignore_option="validation.ignore_fields",
            )
        except ValidationDataError as exc:
            raise ValidationDataError(f"validation.data: {exc}") from exc


@dataclass(frozen=True)
class CompileRequest:
    name: str  # the model's name (registered model, summary rows)
    source: ModelSource
    options: CompileOptions
    tolerances: Tolerances  # resolved: rel_l2 is set (by the entry or the precision's default)
    inputs: Mapping[str, InputOverrideLike] = field(default_factory=dict)
    validation: ValidationPlan = field(default_factory=ValidationPlan)
    package_name: str = ""  # "<name>" or, for an entry with several devices, "<name>-<device>"
    generation: GenerationPlan | None = None  # task: text-generation (zoo.generation)

    @property
    def device(self) -> str:
        return self.options.device

    @property
    def trusted_modules(self) -> tuple[str, ...]:
        """Modules a package or program of this request may import for its custom ops: the source's own
        code, which the zoo file vouched for (docs/security.md). Anything else stays refused."""
        return tuple(getattr(self.source, "trusted_modules", ()))

    def identity(self) -> SourceIdentity:
        """Which model this is, without loading it."""
        return self.source.identity()

    def for_program(self, program: str) -> CompileRequest:
        """The request for one program of a generation entry (``prefill`` or ``decode``)."""
        options = self.options
        given = {"backend_options": options.backend_options, "profiles": options.profiles}
        chosen = program_options(program, options.backend, options.device, given)
        if chosen != {"backend_options": dict(options.backend_options), "profiles": tuple(options.profiles)}:
            options = dataclasses.replace(options, **chosen)
        return dataclasses.replace(
            self, options=options, generation=dataclasses.replace(self.generation, program=program)
        )

    def load_model(self) -> Any:
        """The source's model itself (eval mode, on the CPU): for generation, the causal LM."""
        where = f"models[{self.name}]"
        keep_torchao_out_of_transformers()  # a source may load transformers (hf:, factories)
        try:
            return self.source.load()
        except ZooConfigError as exc:  # sources name the field ("source: ..."); add the entry
            raise type(exc)(f"{where}.{exc}") from exc

    def load_case(self) -> LoadedCase:
        """The source's model with this request's input ranges, on this request's device (for a
        generation request, its program's wrapper with the ranges of the ``generation`` block)."""
        loaded = self.load_model()
        if self.generation is not None:
            from compiler.backends.capabilities import capabilities
            from compiler.generation.step import program_case

            lm = loaded.model.to(self.device)
            # traced in fp32, built at fp16/bf16: the decode attention is kiln's op where the engines
            # keep it (its Triton kernels on CUDA); elsewhere the ATen form is traced as before
            op = capabilities(self.options.backend).kiln_ops and self.options.precision in ("fp16", "bf16")
            module, kwargs, shapes = program_case(
                lm, self.generation.spec(lm), self.generation.program or "prefill", attention_op=op
            )
            return LoadedCase(module, (), kwargs, shapes)
        case = apply_overrides(loaded, self.inputs, f"models[{self.name}]")
        if self.device == "cpu":
            return case
        import torch

        move = lambda v: v.to(self.device) if isinstance(v, torch.Tensor) else v  # noqa: E731
        return LoadedCase(
            case.model.to(self.device),
            tuple(move(a) for a in case.args),
            {k: move(v) for k, v in case.kwargs.items()},
            case.dynamic_shapes,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for MLflow tags, cache keys and logs): never code to import."""
        return {
            "name": self.name,
            "source": self.source.uri,
            "options": self.options.to_dict(),
            "tolerances": self.tolerances.to_dict(),
            "inputs": {
                # A dropped input differs from a static one (``dims: []``): another graph.
                name: {"drop": True}
                if getattr(o, "drop", False)
                else [{"axis": d.axis, "name": d.name, "min": d.min, "max": d.max} for d in o.dims]
                for name, o in sorted(self.inputs.items())
            },
            "validation": _validation_dict(self.validation),
            "package_name": self.package_name,
            # unset: the same dict (and so the same cache keys) as before generation existed
            **({"generation": self.generation.to_dict()} if self.generation is not None else {}),
        }

    def cache_identity(self) -> dict[str, Any]:
        """What decides the compile's result: the request's data, the source's identity and the content
        of the recorded validation data (a file edited in place must validate again)."""
        from zoo.sources.common import sha256_file

        identity = {**self.to_dict(), "identity": self.identity().to_dict()}
        recorded = {"validation": self.validation.data, "calibration": self.options.calibration.data}
        if self.generation is not None:
            recorded["generation_prompts"] = self.generation.prompts
        for use, data in recorded.items():
            if data is not None:
                path = Path(data)
                identity[f"{use}_data_sha256"] = sha256_file(path) if path.is_file() else "missing"
        return identity


def _validation_dict(plan: ValidationPlan) -> dict[str, Any]:
    data = vars(plan).copy()
    if not plan.ignore_fields:  # unset: the same dict (and so the same keys) as before the field
        del data["ignore_fields"]
    else:
        data["ignore_fields"] = list(plan.ignore_fields)
    return data
