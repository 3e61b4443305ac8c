"""The model-source protocol: where a zoo entry's model comes from.

A source answers two questions, in this order:

* ``identity()``: an immutable description of exactly which model this is (a module's source hash and
  the call that builds it, a file's sha256, a registry version), computed WITHOUT loading the model, so
  an unchanged model costs a hash, not an export;
* ``load()``: the model itself (eval mode), example inputs and the dynamic shapes torch.export should use.

One module per kind of source (``factory``, ...) implements it; ``zoo.sources.source_for`` picks the kind
from the entry's ``source:`` string.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # identities are computed without torch (an unchanged zoo's re-run never needs it)
    import torch


@dataclass(frozen=True)
class SourceIdentity:
    """Which model a source names. Equal identity (with equal settings and libraries): equal compile."""

    kind: str  # "factory", "hf", "mlflow", "pt2", ...
    uri: str  # as the user wrote it, e.g. "factory:zoo.models:tiny_bert"
    version: str  # the resolved version or revision ("" where the kind has none)
    digest: str  # sha256 over everything that decides the model's graph and weights
    run_id: str | None = None  # the source's MLflow run, where there is one

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LoadedCase:
    """A loaded model with example inputs: what torch.export needs."""

    model: torch.nn.Module
    args: tuple
    kwargs: dict[str, Any]
    dynamic_shapes: Any


@runtime_checkable
class ModelSource(Protocol):
    """One kind of model source (see the module docstring)."""

    @property
    def uri(self) -> str: ...

    def identity(self) -> SourceIdentity: ...

    def load(self) -> LoadedCase: ...


def digest_of(*parts: Any) -> str:
    """sha256 of the canonical JSON of ``parts`` (str() for what JSON cannot say)."""
    text = json.dumps(list(parts), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@cache
def torch_version() -> str:
    """``torch.__version__``, the string packages record (the manifest's ``torch_version``, Inductor's
    engine headers and cache keys), read from torch's own ``torch/version.py`` so that an identity that
    names the torch version turning a model into a graph does not import torch for it.

    Not the installed metadata's version: PyPI's CUDA build of torch 2.13.0 says ``2.13.0`` there and
    ``2.13.0+cu130`` in ``torch.__version__`` (the CPU build says ``2.13.0+cpu`` in both, so identities
    made with it are unchanged)."""
    spec = importlib.util.find_spec("torch")  # finds torch's folder without importing it
    for folder in (spec.submodule_search_locations or []) if spec else []:
        try:
            tree = ast.parse((Path(folder) / "version.py").read_text())
        except (OSError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            if (
                isinstance(node, ast.Assign | ast.AnnAssign)
                and any(isinstance(t, ast.Name) and t.id == "__version__" for t in _targets(node))
                and isinstance(node.value, ast.Constant)
                and isinstance(node.value.value, str)
            ):
                return node.value.value
    import torch  # a torch without a plain version.py: ask it

    return str(torch.__version__)


def _targets(node: ast.Assign | ast.AnnAssign) -> list[ast.expr]:
    return node.targets if isinstance(node, ast.Assign) else [node.target]
