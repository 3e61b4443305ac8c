"""kiln's compile library: PyTorch models -> validated, packaged inference engines.

The stages, each taking the previous stage's value object (see docs/compiler-api.md):
export -> partition -> dedup -> build_engine -> assemble (refit) -> validate -> save/load.
This package never imports Prefect or MLflow.
"""

from compiler.backends import get_backend
from compiler.build import EngineArtifact, build_engine
from compiler.cache import EngineCache
from compiler.compare import PartitionComparison, compare_partitions
from compiler.dedup import DedupPlan, dedup
from compiler.export import export, input_specs, load_program, save_program
from compiler.manifest import Manifest, SourceRecord
from compiler.options import CompileOptions
from compiler.package import PackageInfo, load, read_manifest, refit_package, save
from compiler.partition import PartitionPlan, partition
from compiler.pipeline import compile
from compiler.quantize import QuantizationRecord, quantize
from compiler.repair import RepairRecord, RepairResult, ensure_accuracy, rebuild, repair
from compiler.report import CompileReport
from compiler.runtime import CompiledModule, assemble
from compiler.specs import InputSpec
from compiler.validate import Latency, Tolerances, ValidationReport, measure_latency, validate
from compiler.validation_data import ValidationData, validation_data

__all__ = [
    "CompileOptions",
    "CompileReport",
    "CompiledModule",
    "DedupPlan",
    "EngineArtifact",
    "EngineCache",
    "InputSpec",
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

from compiler.dynamo import KilnBackend, kiln_backend

__all__ += ["KilnBackend", "kiln_backend"]
