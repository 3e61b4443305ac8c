"""Writing a package: what :func:`compiler.package.save_load.save` puts in it, apart from the manifest.

The program saved hollow (its weights live once, in weights.safetensors), engines stripped of the
weights the package holds (:func:`packaged_engine`), the float weights only int8 engines read (left
out by ``save(int8_weights_only=True)``), those only fp16/bf16 engines read (stored at that precision
by ``save(engine_precision_weights=True)``), the validation report as its typed record, and the swap of a
finished package into place (an old package replaced atomically, anything else refused).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from compiler.backends.base import QUANTIZED_PRECISIONS
from compiler.backends.capabilities import capabilities, is_backend
from compiler.engine_build.engine import EngineArtifact
from compiler.engine_build.weights import engine_precision_keys
from compiler.errors import PackageError
from compiler.package.manifest import MANIFEST_FILE
from compiler.partitioning.partition import (
    weight_placeholders,
)
from compiler.runtime.module import CompiledModule
from compiler.validation.report import ValidationReport


def int8_only_weights(compiled: CompiledModule) -> set[str]:
    """Program weights that only int8 engines read (every user of the weight is an int8 engine
    partition): what ``save(int8_weights_only=True)`` leaves out."""
    plan = compiled.plan
    int8 = {
        p.name
        for p in plan.partitions
        if plan.options.precision_of(p.name) in QUANTIZED_PRECISIONS
        and compiled.engines[compiled.dedup.instance(p.name).fingerprint].is_engine
    }
    keys = weight_placeholders(plan.program)
    return {
        keys[node.name]
        for node in plan.graph_module.graph.nodes
        if node.op == "placeholder"
        and node.name in keys
        and node.users
        and all(user.op == "call_module" and user.target in int8 for user in node.users)
    }


def weights_at_engine_precision(
    compiled: CompiledModule, asked: bool | Mapping[str, torch.dtype]
) -> dict[str, torch.dtype]:
    """The weights a save stores at their engines' precision (key -> dtype): ``asked`` where it is a
    mapping, those that only fp16/bf16 engines read where it is true, and, whatever it is, those a
    package read back stored so and that still are (a re-save, a refit keep the package's form)."""
    if isinstance(asked, Mapping):
        return dict(asked)
    plan = compiled.plan
    if not asked and not plan.reduced_weights:
        return {}
    engines = {
        p.name
        for p in plan.partitions
        if compiled.engines[compiled.dedup.instance(p.name).fingerprint].is_engine
    }
    found = engine_precision_keys(plan, compiled.dedup.instances, engines)
    return found if asked else {k: d for k, d in found.items() if plan.reduced_weights.get(k) == d}


def packaged_engine(artifact: EngineArtifact) -> EngineArtifact:
    """The engine as a package stores it: weight-stripped where its backend's package load passes every
    engine its weights from the package (capabilities' ``package_strip``: ONNX Runtime, Inductor), so
    the weights live once, in weights.safetensors, whatever ``strip_weights`` built; else as built
    (TensorRT). The engine cache and the compiled module keep what was built."""
    if artifact.stripped or not artifact.is_engine or not is_backend(artifact.backend):
        return artifact
    stripped = capabilities(artifact.backend).strip_for_package(artifact.engine)
    return artifact if stripped is None else dataclasses.replace(artifact, engine=stripped, stripped=True)


def hollow_program(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """The program with every weight replaced by a one-element tensor expanded to its shape.

    The graph and shapes survive torch.export.save; the values live once, in weights.safetensors.
    Parameters never require grad here (a package is for inference), so a freshly compiled program
    and the same program loaded from a package save to equal bytes.
    """

    def hollow(t: torch.Tensor) -> torch.Tensor:
        empty = torch.zeros((), dtype=t.dtype).expand(t.shape)
        return torch.nn.Parameter(empty, requires_grad=False) if isinstance(t, torch.nn.Parameter) else empty

    new = copy.copy(program)
    new._state_dict = {k: hollow(v) for k, v in program.state_dict.items()}
    new._constants = {
        k: hollow(v) if isinstance(v, torch.Tensor) else v for k, v in program.constants.items()
    }
    return new


def swap_into_place(tmp: Path, path: Path) -> None:
    if not path.exists():
        os.replace(tmp, path)
        return
    if not (path / MANIFEST_FILE).exists() and any(path.iterdir()):
        raise PackageError(f"{path} exists and is not a kiln package; refusing to replace it")
    old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
    os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def copy_into_place(package: Path, path: Path) -> None:
    """A package already written (``package``) copied to ``path`` byte for byte, signature included, and
    swapped in whole: what saving the same module there again would write, without serializing, hashing
    and signing it again (a program's round trip through torch.export, the weights file's bytes)."""
    staging = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        # Under its final name: a signature names the package it signs (the folder's name).
        shutil.copytree(package, staging / path.name, symlinks=True)
        swap_into_place(staging / path.name, path)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def as_validation_report(value: ValidationReport | Mapping[str, Any] | None) -> ValidationReport | None:
    if value is None or isinstance(value, ValidationReport):
        return value
    if isinstance(value, Mapping):
        return ValidationReport.from_dict(value)
    raise TypeError(f"validation must be a ValidationReport or its to_dict(), got {type(value).__name__}")
