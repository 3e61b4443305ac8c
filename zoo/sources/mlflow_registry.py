"""``models:/NAME/VERSION`` and ``models:/NAME@ALIAS`` sources: a PyTorch model in the MLflow registry.

The registry is MLflow's own (``MLFLOW_TRACKING_URI`` / ``MLFLOW_REGISTRY_URI``). mlflow is imported
only when such a source resolves, so ``zoo`` imports without it.

Identity without loading: the resolved version (an alias is resolved once per source object and the
version it named is what is loaded, so what was keyed is what compiles), its run id and source as
MLflow reports them, and the model's MLmodel file (flavors, signature, model uuid), fetched alone.
The MLmodel is checked there too: the ``pytorch`` flavor, and a tensor signature (or, without one,
the entry's ``inputs:``).

Loading: MLflow 3 stores PyTorch models as ``torch.export`` programs (``serialization_format="pt2"``,
its default): those load through ``compiler.load_program``, which never unpickles. A model stored as a
pickle (``serialization_format="pickle"``) executes code from the registry when it loads: kiln loads
one only where MLflow itself allows it (``MLFLOW_ALLOW_PICKLE_DESERIALIZATION=true``), and only ever
a source the zoo file names (docs/sources.md).

Inputs from the signature's tensor specs: ``-1`` dims are dynamic, with the ranges the entry's
``inputs:`` give; without them axis 0 is ``batch`` 1..8 and any other ``-1`` dim is refused, naming the
``inputs:`` to add. The example is the logged input example where there is one (resized on dynamic
axes to fit the ranges), else drawn from the specs (floats normal, integers 0..1).
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import json
import os
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiler.errors import KilnError, OpModuleNotAllowedError, UnsafeProgramError
from zoo.errors import SourceUnavailableError, UntrustedCodeError, ZooConfigError
from zoo.sources.base import LoadedCase, SourceIdentity, digest_of, torch_version
from zoo.sources.common import example_size, fit_example_shape, override_dims
from zoo.sources.staging import staging_dir

if TYPE_CHECKING:  # torch where a signature is read or a model loads, not on import
    import torch
    from torch.export import Dim

MODELS_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>[1-9]\d*)|@(?P<alias>[A-Za-z0-9_-]+))$")
DEFAULT_BATCH = (1, 8)  # the range of a -1 axis 0 that the entry's inputs: do not give
PICKLE_ENV = "MLFLOW_ALLOW_PICKLE_DESERIALIZATION"


def parse_models_uri(uri: str) -> tuple[str, str | None, str | None]:
    """(name, version, alias) of ``models:/NAME/VERSION`` or ``models:/NAME@ALIAS``; ValueError else."""
    match = MODELS_URI.match(uri)
    if not match:
        raise ValueError(
            f"{uri!r} must be models:/NAME/VERSION (a version number) or models:/NAME@ALIAS; "
            "stages and 'latest' move without a record, use an alias"
        )
    return match["name"], match["version"], match["alias"]


@dataclass(frozen=True)
class TensorInput:
    """One input of the signature: its name (None when the signature names none), dtype, shape."""

    name: str | None
    dtype: torch.dtype
    shape: tuple[int, ...]  # -1: dynamic


@dataclass(frozen=True)
class MlflowSource:
    """A registered PyTorch model (see the module docstring)."""

    models_uri: str  # models:/NAME/VERSION or models:/NAME@ALIAS
    inputs: Mapping[str, Any] = field(default_factory=dict)
    # The version this source resolved first: load() loads it even if the alias moved since.
    pinned: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def uri(self) -> str:
        return self.models_uri

    @property
    def name(self) -> str:
        return parse_models_uri(self.models_uri)[0]

    # ------------------------------------------------------------------ identity

    def identity(self) -> SourceIdentity:
        version = self.resolve()
        mlmodel = self._mlmodel(version["version"])
        self.tensor_inputs(mlmodel)  # flavor, signature, ranges: refused before anything loads
        digest = digest_of(
            "mlflow",
            self.name,
            version,
            hashlib.sha256(json.dumps(mlmodel.to_dict(), sort_keys=True, default=str).encode()).hexdigest(),
            torch_version(),
        )
        return SourceIdentity("mlflow", self.uri, version["version"], digest, version["run_id"])

    def resolve(self) -> dict[str, Any]:
        """The model version this source names (resolved once, then pinned): version, run id, source."""
        if self.pinned:
            return dict(self.pinned)
        import mlflow

        name, number, alias = parse_models_uri(self.models_uri)
        client = mlflow.MlflowClient()
        with _registry_errors(self.uri, alias):
            found = (
                client.get_model_version(name, number)
                if number
                else client.get_model_version_by_alias(name, alias)
            )
        self.pinned.update(
            version=str(found.version),
            run_id=found.run_id or None,
            source=found.source or "",
            created=int(found.creation_timestamp or 0),
        )
        return dict(self.pinned)

    def _mlmodel(self, version: str) -> Any:
        from mlflow.models import Model

        with _registry_errors(self.uri, None):
            return Model.load(f"models:/{self.name}/{version}")

    def tensor_inputs(self, mlmodel: Any) -> list[TensorInput]:
        """The signature's tensor inputs, after the checks that need no model (see the module docstring)."""
        import torch

        flavors = sorted(mlmodel.flavors)
        if "pytorch" not in flavors:
            raise ZooConfigError(
                f"source: {self.uri} is not a PyTorch model (its flavors: {', '.join(flavors)}); kiln "
                "compiles models logged with mlflow.pytorch.log_model"
            )
        signature = mlmodel.signature
        if signature is None or signature.inputs is None:
            if self.inputs:
                return []  # shapes and dtypes come from the input example when it loads
            raise ZooConfigError(
                f"source: {self.uri} has no signature and the entry gives no inputs:; log the model with "
                "a signature (mlflow.models.infer_signature(example, output)), or give its inputs: ranges "
                "(with a logged input example)"
            )
        if not signature.inputs.is_tensor_spec():
            raise ZooConfigError(
                f"source: {self.uri}'s signature is column-based; kiln needs tensor specs (log it with "
                "numpy or tensor examples)"
            )
        found = []
        for i, spec in enumerate(signature.inputs.inputs):
            dtype = torch.from_numpy(_np_zeros(spec.type)).dtype
            found.append(TensorInput(spec.name, dtype, tuple(int(d) for d in spec.shape)))
            unranged = [a for a, d in enumerate(spec.shape) if d == -1 and a > 0]
            label = spec.name or f"#{i}"
            if unranged and not self.inputs:  # with inputs:, load() checks them by forward's names
                raise ZooConfigError(
                    f"inputs: {self.uri}'s signature leaves input {label} axis {unranged[0]} dynamic (-1) "
                    f"with no range; give its dims, e.g. inputs: {{{spec.name or 'NAME'}: {{dims: "
                    f"[{{axis: 0, name: batch, min: 1, max: 8}}, {{axis: {unranged[0]}, name: seq, min: 1, "
                    "max: 128}]}}"
                )
        return found

    # ------------------------------------------------------------------ load

    def load(self) -> LoadedCase:
        import mlflow
        from mlflow.models import Model

        version = self.resolve()["version"]
        # A download killed midway is swept by the next one (zoo.sources.staging).
        with staging_dir("source") as tmp:
            with _registry_errors(self.uri, None):
                uri = f"models:/{self.name}/{version}"
                local = mlflow.artifacts.download_artifacts(artifact_uri=uri, dst_path=str(tmp))
            mlmodel = Model.load(local)
            specs = self.tensor_inputs(mlmodel)
            model = self._model(Path(local), mlmodel)
            example = mlmodel.load_input_example(local) if mlmodel.saved_input_example_info else None
        return self._case(model, specs, example)

    def _model(self, local: Path, mlmodel: Any) -> torch.nn.Module:
        import torch

        data = local / mlmodel.flavors["pytorch"].get("model_data", "data")
        program_file = data / "model.pt2" if data.is_dir() else None
        if program_file is not None and program_file.is_file():
            import compiler

            try:
                return compiler.load_program(program_file).module()
            except (UnsafeProgramError, OpModuleNotAllowedError) as exc:
                raise UntrustedCodeError(f"source: {self.uri}: {exc}") from exc
            except KilnError as exc:
                raise ZooConfigError(f"source: {self.uri}: its program does not load: {exc}") from exc
        if os.environ.get(PICKLE_ENV, "").lower() not in ("1", "true"):
            raise UntrustedCodeError(
                f"source: {self.uri} is stored as a pickle (serialization_format='pickle'): loading it runs "
                "code from the registry. Log it again with serialization_format='pt2' (kiln loads that "
                f"without unpickling), or set {PICKLE_ENV}=true if you trust everyone who can write to "
                "this registry (docs/sources.md)"
            )
        import mlflow.pytorch

        try:
            model = mlflow.pytorch.load_model(str(local))
        except Exception as exc:  # an unpickle raises whatever the pickled code raises
            raise ZooConfigError(f"source: {self.uri}: mlflow.pytorch.load_model failed: {exc}") from exc
        if not isinstance(model, torch.nn.Module):
            raise ZooConfigError(f"source: {self.uri} loads as {type(model).__name__}, not a torch.nn.Module")
        return model.eval()  # (a program's module has no train mode to leave)

    def _case(self, model: torch.nn.Module, specs: list[TensorInput], example: Any) -> LoadedCase:
        from torch.export import Dim

        params = [
            p.name
            for p in inspect.signature(model.forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        ]
        examples = _example_list(example, specs)
        if not specs:  # no signature: the example decides shapes and dtypes; inputs: the ranges
            if examples is None:
                raise ZooConfigError(
                    f"source: {self.uri} has no signature and no input example; log it with a signature"
                )
            specs = [TensorInput(None, t.dtype, tuple(t.shape)) for t in examples]
        by_name = all(s.name in params for s in specs)
        names = [s.name for s in specs] if by_name else params[: len(specs)]
        if len(names) != len(specs):
            raise ZooConfigError(
                f"source: {self.uri}: the signature has {len(specs)} inputs but forward takes {params}"
            )
        dims: dict[str, Dim] = {}
        values, shapes = [], {}
        for i, (spec, name) in enumerate(zip(specs, names, strict=True)):
            override = override_dims(self.inputs, name)
            per_axis: dict[int, Dim] = {}
            if override is not None:
                for d in override:
                    per_axis[d.axis] = dims.setdefault(d.name, Dim(d.name, min=d.min, max=d.max))
            else:
                for axis, size in enumerate(spec.shape):
                    if size != -1:
                        continue
                    if axis > 0:
                        raise ZooConfigError(
                            f"inputs: {self.uri}'s input {name!r} axis {axis} is dynamic (-1) with no range; "
                            f"give it in inputs: {name}: dims"
                        )
                    per_axis[0] = dims.setdefault(
                        "batch", Dim("batch", min=DEFAULT_BATCH[0], max=DEFAULT_BATCH[1])
                    )
            given = examples[i] if examples is not None else None
            values.append(_fit(spec, given, per_axis, override))
            shapes[name] = per_axis or None
        if by_name:
            return LoadedCase(model, (), dict(zip(names, values, strict=True)), shapes)
        return LoadedCase(model, tuple(values), {}, shapes)


def _np_zeros(dtype: Any) -> Any:
    import numpy as np

    return np.zeros((), dtype=dtype)


def _example_list(example: Any, specs: list[TensorInput]) -> list[torch.Tensor] | None:
    """The logged input example as one tensor per input (None: none logged, or not tensors)."""
    import numpy as np
    import torch

    if example is None:
        return None
    if isinstance(example, dict):
        if not specs or not all(s.name in example for s in specs):
            return None
        items = [example[s.name] for s in specs]
    elif isinstance(example, list | tuple):
        items = list(example)
    else:
        items = [example]
    if not all(isinstance(v, np.ndarray | torch.Tensor) for v in items):
        return None
    return [torch.as_tensor(np.asarray(v)) if isinstance(v, np.ndarray) else v for v in items]


def _fit(
    spec: TensorInput, given: torch.Tensor | None, dims: Mapping[int, Dim], override: Any
) -> torch.Tensor:
    """The example for one input: the logged one (resized on dynamic axes to sizes inside their ranges,
    at least 2), else drawn from the spec."""
    import torch

    base = list(given.shape) if given is not None and given.dim() == len(spec.shape) else None
    shape = []
    for axis, size in enumerate(spec.shape):
        start = base[axis] if base is not None else (size if size != -1 else 2)
        dim = dims.get(axis)
        shape.append(example_size(start, dim.min, dim.max) if dim is not None else start)
    shape = fit_example_shape(shape, override)
    if base is not None and given is not None:
        value = given.to(spec.dtype)
        for axis, size in enumerate(shape):
            if value.shape[axis] != size:
                value = value.index_select(axis, torch.arange(size) % value.shape[axis])
        return value
    generator = torch.Generator().manual_seed(0)
    if spec.dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(spec.dtype)
    value = torch.randint(0, 2, shape, generator=generator)
    return value.bool() if spec.dtype == torch.bool else value.to(spec.dtype)


@contextlib.contextmanager
def _registry_errors(uri: str, alias: str | None) -> Iterator[None]:
    """MLflow's errors as kiln's: a missing name, version or alias is the zoo file's to fix; anything
    else (the server down, a timeout) is a SourceUnavailableError, which a retry may cure."""
    from mlflow.exceptions import MlflowException

    try:
        yield
    except MlflowException as exc:
        code = getattr(exc, "error_code", "")
        if code == "RESOURCE_DOES_NOT_EXIST" or (code == "INVALID_PARAMETER_VALUE" and alias):
            raise ZooConfigError(
                f"source: {uri} does not exist in the registry at {_registry_uri()}: {exc.message}"
            ) from None
        raise SourceUnavailableError(
            f"source: {uri}: the MLflow registry at {_registry_uri()} failed: {exc.message}"
        ) from None
    except OSError as exc:  # requests' connection errors are OSErrors
        raise SourceUnavailableError(
            f"source: {uri}: the MLflow registry at {_registry_uri()} cannot be reached: {exc}"
        ) from None


def _registry_uri() -> str:
    import mlflow

    return mlflow.get_registry_uri()
