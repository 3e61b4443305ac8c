"""kiln's compile library: PyTorch models -> validated, packaged inference engines.

The stages, each taking the previous stage's value object (see docs/compiler-api.md):
export -> partition -> dedup -> build_engine -> assemble (refit) -> validate -> save/load.
This package never imports Prefect or MLflow.

Importing ``compiler`` costs almost nothing: each public name is imported from its stage module on first
use (PEP 562 module ``__getattr__``), so ``compiler.load`` never pays for torch.compile's front end and
a CLI that only reads a manifest never pays for torch. ``torch.compile(backend="kiln")`` finds the
backend through the ``torch_dynamo_backends`` entry point (pyproject.toml), not through this import.
"""

from __future__ import annotations

import copyreg
import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

# public name -> the module that defines it
_EXPORTS: dict[str, str] = {
    "get_backend": "compiler.backends",
    "EngineArtifact": "compiler.build",
    "build_engine": "compiler.build",
    "EngineCache": "compiler.cache",
    "PartitionComparison": "compiler.compare",
    "compare_partitions": "compiler.compare",
    "DedupPlan": "compiler.dedup",
    "dedup": "compiler.dedup",
    "KilnBackend": "compiler.dynamo",
    "kiln_backend": "compiler.dynamo",
    "export": "compiler.export",
    "input_specs": "compiler.export",
    "load_program": "compiler.export",
    "save_program": "compiler.export",
    "Manifest": "compiler.manifest",
    "SourceRecord": "compiler.manifest",
    "CompileOptions": "compiler.options",
    "PackageInfo": "compiler.package",
    "load": "compiler.package",
    "read_manifest": "compiler.package_check",
    "refit_package": "compiler.package",
    "save": "compiler.package",
    "PartitionPlan": "compiler.partition",
    "QuantizationRecord": "compiler.quantize",
    "quantize": "compiler.quantize",
    "partition": "compiler.partition",
    "compile": "compiler.pipeline",
    "RepairRecord": "compiler.repair",
    "RepairResult": "compiler.repair",
    "ensure_accuracy": "compiler.repair",
    "rebuild": "compiler.repair",
    "repair": "compiler.repair",
    "CompileReport": "compiler.report",
    "CompiledModule": "compiler.runtime",
    "assemble": "compiler.runtime",
    "InputSpec": "compiler.specs",
    "Latency": "compiler.validation_report",
    "Tolerances": "compiler.validation_report",
    "ValidationReport": "compiler.validation_report",
    "measure_latency": "compiler.validate",
    "validate": "compiler.validate",
    "ValidationData": "compiler.validation_data",
    "validation_data": "compiler.validation_data",
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


class _Package(types.ModuleType):
    """``compiler.export`` (and ``partition``, ``dedup``, ``validate``, ``repair``, ``validation_data``)
    stays the function: importing the same-named submodule binds the module on its package, which would
    otherwise replace the function."""

    def __setattr__(self, name: str, value: Any) -> None:
        if (
            isinstance(value, types.ModuleType)
            and name in _EXPORTS
            and value.__name__ == f"{__name__}.{name}"
        ):
            value = getattr(value, name)
        super().__setattr__(name, value)


def _reduce_package(module: types.ModuleType) -> tuple[Any, tuple[str]]:
    # Pickled by name like any module (cloudpickle and Dask ship functions whose globals hold it).
    return importlib.import_module, (module.__name__,)


copyreg.pickle(_Package, _reduce_package)
sys.modules[__name__].__class__ = _Package


if TYPE_CHECKING:  # what type checkers and IDEs see: the same names, imported eagerly
    from compiler.backends import get_backend
    from compiler.build import EngineArtifact, build_engine
    from compiler.cache import EngineCache
    from compiler.compare import PartitionComparison, compare_partitions
    from compiler.dedup import DedupPlan, dedup
    from compiler.dynamo import KilnBackend, kiln_backend
    from compiler.export import export, input_specs, load_program, save_program
    from compiler.manifest import Manifest, SourceRecord
    from compiler.options import CompileOptions
    from compiler.package import PackageInfo, load, refit_package, save
    from compiler.package_check import read_manifest
    from compiler.partition import PartitionPlan, partition
    from compiler.pipeline import compile
    from compiler.quantize import QuantizationRecord, quantize
    from compiler.repair import RepairRecord, RepairResult, ensure_accuracy, rebuild, repair
    from compiler.report import CompileReport
    from compiler.runtime import CompiledModule, assemble
    from compiler.specs import InputSpec
    from compiler.validate import measure_latency, validate
    from compiler.validation_data import ValidationData, validation_data
    from compiler.validation_report import Latency, Tolerances, ValidationReport
