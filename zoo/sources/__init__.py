"""Model sources: one module per kind, picked by the kind of a ``source:`` string (docs/sources.md).

=====================  ===========================================  ====================
``source:``            what it names                                 module
=====================  ===========================================  ====================
``factory:mod:fn``     a trusted Python function building the model  ``zoo.sources.factory``
``hf:<folder|id>``     a Hugging Face folder or hub id (+ ``task``)  ``zoo.sources.hf``
``pt2:<file>``         a torch.export.save program                   ``zoo.sources.pt2``
``models:/NAME/VER``   a PyTorch model in the MLflow registry        ``zoo.sources.mlflow_registry``
``models:/NAME@ALIAS`` (the same, by alias)
=====================  ===========================================  ====================

:func:`source_for` turns a string (and the entry fields its kind reads) into a
:class:`~zoo.sources.base.ModelSource`; :func:`parse_source` only checks the string (the zoo schema
calls it, so a malformed source fails its entry before anything resolves).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import PurePosixPath
from typing import Any

from zoo.errors import ZooConfigError
from zoo.sources.base import LoadedCase, ModelSource, SourceIdentity
from zoo.sources.factory import FACTORY_RE, FactoryPolicy, FactorySource
from zoo.sources.hf_tasks import HF_TASKS, check_task
from zoo.sources.mlflow_registry import MlflowSource, parse_models_uri
from zoo.sources.pt2 import Pt2Source

__all__ = [
    "HF_TASKS",
    "SOURCE_KINDS",
    "LoadedCase",
    "ModelSource",
    "SourceIdentity",
    "default_name",
    "parse_source",
    "source_for",
]

# kind -> how its string starts
SOURCE_KINDS = {"factory": "factory:", "hf": "hf:", "pt2": "pt2:", "mlflow": "models:/"}


def source_kind(uri: str) -> tuple[str, str]:
    """(kind, the rest of the string); ValueError (no field prefix) when the string is malformed."""
    if not isinstance(uri, str) or not uri.strip():
        raise ValueError("must be a non-empty string like hf:./my-model or factory:zoo.models:tiny_bert")
    for kind, prefix in SOURCE_KINDS.items():
        if uri.startswith(prefix):
            rest = uri[len(prefix) :]
            if not rest.strip():
                raise ValueError(f"{uri!r} names no model after {prefix!r}")
            if kind == "factory" and not FACTORY_RE.match(rest):
                raise ValueError(
                    f"{uri!r}: a factory must look like 'factory:package.module:function', "
                    "e.g. factory:zoo.models:tiny_bert"
                )
            if kind == "mlflow":
                parse_models_uri(uri)  # ValueError: neither a version nor an alias
                return kind, uri
            return kind, rest
    raise ValueError(f"{uri!r} has no known kind; start it with one of {', '.join(SOURCE_KINDS.values())}")


def parse_source(uri: str) -> tuple[str, str]:
    """:func:`source_kind`, raising a ZooConfigError that names the ``source`` field."""
    try:
        return source_kind(uri)
    except ValueError as exc:
        raise ZooConfigError(f"source: {exc}") from None


def source_for(
    uri: str,
    *,
    task: str | None = None,
    revision: str | None = None,
    trust_remote_code: bool = False,
    attn_implementation: str | None = None,
    inputs: Mapping[str, Any] | None = None,
    factory_kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
    policy: FactoryPolicy | None = None,
    base_dir: str | None = None,
) -> ModelSource:
    """The source a ``source:`` string names. Nothing is resolved or loaded here.

    ``task``, ``revision``, ``trust_remote_code``, ``attn_implementation``: the hf: kind's fields.
    ``inputs``: the entry's ranges (sources place their example inputs inside them).
    ``factory_kwargs``, ``seed``, ``policy``: the factory: kind's. ``base_dir``: relative paths
    resolve against it (the zoo file's directory).
    """
    kind, rest = parse_source(uri)
    if kind != "hf" and (
        task is not None or revision is not None or trust_remote_code or attn_implementation
    ):
        raise ZooConfigError(
            f"task: task, revision, trust_remote_code and attn_implementation apply to hf: sources, not "
            f"{SOURCE_KINDS[kind]}"
        )
    if kind != "factory" and factory_kwargs:
        raise ZooConfigError(f"factory_kwargs: apply to factory: sources, not {SOURCE_KINDS[kind]}")
    if kind == "factory":
        policy = policy or FactoryPolicy(zoo_dir=base_dir)
        return FactorySource(rest, dict(factory_kwargs or {}), seed, policy)
    if kind == "hf":
        from zoo.sources.hf import HfSource  # here: its module imports torch for the models it wraps

        return HfSource(
            rest,
            check_task(task),
            revision,
            trust_remote_code,
            dict(inputs or {}),
            base_dir,
            attn_implementation=attn_implementation,
        )
    if kind == "pt2":
        return Pt2Source(rest, dict(inputs or {}), base_dir)
    if kind == "mlflow":
        return MlflowSource(uri, dict(inputs or {}))
    raise AssertionError(kind)  # source_kind knows no other kind


def default_name(uri: str) -> str:
    """A package name for a source given without one (``kiln compile SOURCE``): the model's own name,
    e.g. ``hf:./models/bert-base`` -> ``bert-base``, ``factory:zoo.models:tiny_bert`` -> ``tiny-bert``."""
    kind, rest = parse_source(uri)
    if kind == "factory":
        stem = rest.rsplit(":", 1)[-1]
    elif kind == "mlflow":
        stem = parse_models_uri(uri)[0]
    else:
        stem = PurePosixPath(rest.rstrip("/")).name or rest
        stem = stem.removesuffix(".pt2")
    name = re.sub(r"[^a-z0-9_.-]+", "-", stem.replace("_", "-").lower()).strip("-._")
    return name or kind
