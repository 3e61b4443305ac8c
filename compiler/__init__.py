"""kiln's compile library: PyTorch models -> validated, packaged inference engines.

The stages, each taking the previous stage's value object (see docs/compiler-api.md), one package each:
export (program/) -> partition (partitioning/) -> quantize (quantization/, int8/fp8 partitions only)
-> dedup (partitioning/) -> build_engine (build/, through cache/ and backends/) -> assemble (runtime/,
refit) -> validate (validation/; compare_partitions and repair: accuracy/) -> save/load (package/).
This package never imports Prefect or MLflow.

Importing ``compiler`` costs almost nothing: each public name is imported from its stage module on first
use (PEP 562 module ``__getattr__``), so ``compiler.load`` never pays for torch.compile's front end and
a CLI that only reads a manifest never pays for torch. ``torch.compile(backend="kiln")`` finds the
backend through the ``torch_dynamo_backends`` entry point (pyproject.toml), not through this import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "get_backend": "compiler.backends",
    "EngineArtifact": "compiler.engine_build.engine",
    "build_engine": "compiler.engine_build.engine",
    "EngineCache": "compiler.cache.local",
    "PartitionComparison": "compiler.accuracy.compare",
    "compare_partitions": "compiler.accuracy.compare",
    "DedupPlan": "compiler.partitioning.dedup",
    "dedup": "compiler.partitioning.dedup",
    "KilnBackend": "compiler.dynamo",
    "kiln_backend": "compiler.dynamo",
    "export": "compiler.program.export",
    "input_specs": "compiler.program.export",
    "load_program": "compiler.program.export",
    "save_program": "compiler.program.export",
    "Manifest": "compiler.package.manifest",
    "SourceRecord": "compiler.package.manifest",
    "CompileOptions": "compiler.options",
    "PackageInfo": "compiler.package.save_load",
    "load": "compiler.generation.package",  # any package; a generation package with its decode program
    "read_manifest": "compiler.package.check",
    "refit_package": "compiler.package.save_load",
    "save": "compiler.package.save_load",
    "PartitionPlan": "compiler.partitioning.partition",
    "QuantizationRecord": "compiler.quantization.quantize",
    "quantize": "compiler.quantization.quantize",
    "partition": "compiler.partitioning.partition",
    "compile": "compiler.pipeline",
    "RepairRecord": "compiler.accuracy.repair",
    "RepairResult": "compiler.accuracy.repair",
    "ensure_accuracy": "compiler.accuracy.repair",
    "rebuild": "compiler.accuracy.repair",
    "repair": "compiler.accuracy.repair",
    "CompileReport": "compiler.runtime.compile_report",
    "CompiledModule": "compiler.runtime.module",
    "assemble": "compiler.runtime.module",
    "InputSpec": "compiler.inputs.specs",
    "Latency": "compiler.validation.report",
    "Tolerances": "compiler.validation.report",
    "ValidationReport": "compiler.validation.report",
    "measure_latency": "compiler.validation.validate",
    "validate": "compiler.validation.validate",
    "ValidationData": "compiler.inputs.data",
    "validation_data": "compiler.inputs.data",
}

__all__ = [
    "CompileOptions",
    "CompileReport",
    "CompiledModule",
    "DedupPlan",
    "EngineArtifact",
    "EngineCache",
    "InputSpec",
    "KilnBackend",
    "Latency",
    "Manifest",
    "PackageInfo",
    "PartitionComparison",
    "PartitionPlan",
    "QuantizationRecord",
    "RepairRecord",
    "RepairResult",
    "SourceRecord",
    "Tolerances",
    "ValidationData",
    "ValidationReport",
    "assemble",
    "build_engine",
    "compare_partitions",
    "compile",
    "dedup",
    "ensure_accuracy",
    "export",
    "get_backend",
    "input_specs",
    "kiln_backend",
    "load",
    "load_program",
    "measure_latency",
    "partition",
    "quantize",
    "read_manifest",
    "rebuild",
    "refit_package",
    "repair",
    "save",
    "save_program",
    "validate",
    "validation_data",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'compiler' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # once imported, a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from compiler.accuracy.compare import PartitionComparison, compare_partitions
    from compiler.accuracy.repair import RepairRecord, RepairResult, ensure_accuracy, rebuild, repair
    from compiler.backends import get_backend
    from compiler.cache.local import EngineCache
    from compiler.dynamo import KilnBackend, kiln_backend
    from compiler.engine_build.engine import EngineArtifact, build_engine
    from compiler.generation.package import load
    from compiler.inputs.data import ValidationData, validation_data
    from compiler.inputs.specs import InputSpec
    from compiler.options import CompileOptions
    from compiler.package.check import read_manifest
    from compiler.package.manifest import Manifest, SourceRecord
    from compiler.package.save_load import PackageInfo, refit_package, save
    from compiler.partitioning.dedup import DedupPlan, dedup
    from compiler.partitioning.partition import PartitionPlan, partition
    from compiler.pipeline import compile
    from compiler.program.export import export, input_specs, load_program, save_program
    from compiler.quantization.quantize import QuantizationRecord, quantize
    from compiler.runtime.compile_report import CompileReport
    from compiler.runtime.module import CompiledModule, assemble
    from compiler.validation.report import Latency, Tolerances, ValidationReport
    from compiler.validation.validate import measure_latency, validate
