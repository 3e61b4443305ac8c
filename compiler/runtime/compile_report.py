"""CompileReport: what a compile did, carried by the compiled module and its package.

A package's report is read, never trusted: :meth:`CompileReport.from_dict` checks every field, and
the records in it that readers index (partitions, build failures, repair, profiles, quantization),
against :data:`REPORT` before anything is built (:mod:`compiler.typed_json`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from compiler.typed_json import NUMBER_TEXT, ListOf, MapOf, Opt, Record, check

if TYPE_CHECKING:  # read by attribute only: the report's module stays free of torch
    from compiler.engine_build.engine import EngineArtifact
    from compiler.partitioning.dedup import DedupPlan
    from compiler.partitioning.partition import PartitionPlan

_NUMBER = (float, NUMBER_TEXT)  # compiler.repair writes a non-finite error as "inf" / "nan"

BUILD_FAILURE = Record(
    {
        "error": str,
        "node": Opt(str),
        "partition": Opt(str),
        "fingerprint": str,
        "backend": str,
        "fell_back_to": str,
        "fallback_error": str,
        "partitions": ListOf(str),
    }
)
QUANTIZATION = Record(  # compiler.quantization.quantize.QuantizationRecord.to_dict()
    {
        "mode": str,
        "method": Opt(str),
        "per_channel": bool,
        "data_source": Opt(str),
        "samples": int,
        "sample_digests": ListOf(str),
        "partitions": ListOf(str),
        "fallbacks": MapOf(str),
        "warnings": ListOf(str),
        "seconds": float,
    }
)
_STEP_FIELDS = {
    "round": int,
    "partition": str,
    "precision_before": str,
    "precision_after": str,
    "fingerprint_before": str,
    "fingerprint_after": str,
    "rel_l2_before": _NUMBER,
    "rel_l2_after": _NUMBER,
}
_ACCURACY = Record(
    {
        "max_rel_l2": Opt(_NUMBER),
        "min_cosine": Opt(_NUMBER),
        "min_top1_agreement": Opt(_NUMBER),
        "failures": ListOf(str),
    }
)
_LAYER = Record(  # compiler.quantization.layers.LayerSensitivity.to_dict()
    {"name": str, "op": str, "weight": str, "params": int, "flops": int, "rel_l2": _NUMBER},
    required=frozenset({"name", "op", "rel_l2"}),
)
_SEARCH = Record(  # compiler.accuracy.layers.LayerSearch.to_dict()
    {
        "partition": str,
        "raised": ListOf(_LAYER),
        "candidates": int,
        "measured": int,
        "verifications": int,
        "partition_rel_l2": _NUMBER,
        "passed": bool,
        "seconds": _NUMBER,
        "note": str,
    },
    required=frozenset({"partition", "raised", "passed"}),
)
_KEPT = Record(  # compiler.accuracy.mixed.kept_fractions()
    {
        "precision": str,
        "weights": Opt(float),
        "flops": Opt(float),
        "weights_int8": int,
        "weights_total": int,
        "flops_int8": int,
        "flops_total": int,
    }
)
REPAIR = Record(  # compiler.accuracy.repair.RepairRecord.to_dict()
    {
        "steps": ListOf(Record(_STEP_FIELDS, required=frozenset(_STEP_FIELDS))),
        "before": _ACCURACY,
        "after": _ACCURACY,
        "partition_precision": MapOf(str),
        "rounds": int,
        "engines_built": int,
        "engines_from_cache": int,
        "build_seconds": _NUMBER,
        "seconds": _NUMBER,
        "data_source": str,
        "note": str,
        "passed": bool,
        "lines": ListOf(str),
        "searches": ListOf(_SEARCH),
        "float_layers": MapOf(ListOf(str)),
        "kept": Opt(_KEPT),
        "budget_seconds": Opt(_NUMBER),
        "reused": bool,
    }
)
_PROFILE = Record(  # CompiledModule.measure_profiles() rows, with compiler.runtime.padding's verdict
    {
        "profile": MapOf((int, ListOf(int))),
        "kind": str,
        "shapes": ListOf(ListOf(int)),
        "latency_ms": float,
        "dispatch": str,
        "engines": MapOf(str),
        "padding": Opt(Record({"allowed": bool, "reason": Opt(str)})),
    }
)
_PARTITION = Record(
    {
        "name": str,
        "fingerprint": str,
        "backend": Opt(str),
        "nodes": int,
        "num_outputs": int,
        "ops": MapOf(int),
        "block": Opt(str),
    },
    required=frozenset({"name"}),
)
# What a compile was built for: the same fields in the compile report and the manifest.
ENGINE_FIELDS = {
    "backend": str,
    "backend_version": str,
    "engine_target": str,
    "target_device": str,  # format 1's name for engine_target
    "precision": str,
    "strip_weights": bool,
}
REPORT = Record(
    {
        **ENGINE_FIELDS,
        "partitions": ListOf(_PARTITION),
        "fallback_ops": MapOf(int),
        "unique_fingerprints": int,
        "engines_built": int,
        "cache_hits": int,
        "refits": int,
        "engine_bytes": int,
        "stage_seconds": MapOf(float),
        "build_failures": ListOf(BUILD_FAILURE),
        "accuracy_repair": Opt(REPAIR),
        "cuda_graphs": Opt(Record({})),  # then decoded by CaptureCheck.from_dict
        "profiles": Opt(ListOf(_PROFILE)),
        "quantization": Opt(QUANTIZATION),
        "num_partitions": int,
        "fallback_op_count": int,
    },
    required=frozenset({"backend", "backend_version", "precision", "strip_weights"}),
)


@dataclass
class CompileReport:
    backend: str
    backend_version: str
    engine_target: str  # what the engines are built for ("cpu", "cuda:sm_90"); not the device
    precision: str
    strip_weights: bool
    partitions: list[dict] = field(default_factory=list)
    fallback_ops: dict[str, int] = field(default_factory=dict)
    unique_fingerprints: int = 0
    engines_built: int = 0
    cache_hits: int = 0
    refits: int = 0
    engine_bytes: int = 0
    stage_seconds: dict[str, float] = field(default_factory=dict)
    # One per fingerprint whose build failed: error, node, fingerprint, the backend that failed, the
    # partitions it covers and what they fell back to ("torch" or "onnxruntime").
    build_failures: list[dict] = field(default_factory=list)
    # Set when compiler.repair raised partitions to meet the tolerances: RepairRecord.to_dict() (every
    # decision with the partition's error before and after, the model's accuracy before and after).
    accuracy_repair: dict | None = None
    # The compile-time CUDA-graph capture check (compiler.runtime.cudagraphs.CaptureCheck.to_dict());
    # None where none ran (CPU, cuda_graphs 'off', engines outside PyTorch's stream).
    cuda_graphs: dict | None = None
    # One per shape profile (CompileOptions.profiles), measured at compile: the profile, its input
    # shapes, its median latency and what served it ("dispatch").
    profiles: list[dict] | None = None
    # Set when partitions are int8: compiler.quantization.quantize.QuantizationRecord.to_dict()
    # (calibration data, sample digests, quantized partitions, float fallbacks with their reasons).
    quantization: dict | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["num_partitions"] = len(self.partitions)
        data["fallback_op_count"] = sum(self.fallback_ops.values())
        return data

    @classmethod
    def from_dict(cls, data: dict, where: str = "report") -> CompileReport:
        """The report ``to_dict`` wrote. A field of the wrong type (a string where a count goes, say)
        is a PackageCorruptError naming ``where`` and the field."""
        check(data, REPORT, where)
        fields = set(cls.__dataclass_fields__)
        if "target_device" in data and "engine_target" not in data:  # reports written before the rename
            data = {**data, "engine_target": data["target_device"]}
        check(data, Record({}, required=frozenset({"engine_target"})), where)
        if data.get("cuda_graphs") is not None:
            from compiler.runtime.cudagraph_policy import CaptureCheck

            CaptureCheck.from_dict(data["cuda_graphs"])  # KeyError, TypeError, ValueError: malformed
        return cls(**{k: v for k, v in data.items() if k in fields})

    def summary(self) -> str:
        fallback = ", ".join(f"{op} x{n}" for op, n in sorted(self.fallback_ops.items())) or "none"
        text = (
            f"{len(self.partitions)} engine partitions, {self.unique_fingerprints} unique, "
            f"{self.engines_built} built, {self.cache_hits} cache hits, {self.refits} refits; "
            f"fallback to PyTorch: {fallback}"
        )
        fell_back = [
            f"{name} -> {failure.get('fell_back_to')}"
            + (f" (node {failure['node']!r})" if failure.get("node") else "")
            for failure in self.build_failures
            for name in failure.get("partitions", [])
        ]
        if self.accuracy_repair and self.accuracy_repair.get("steps"):
            raised = ", ".join(
                f"{step['partition']} {step['precision_before']} -> {step['precision_after']}"
                for step in self.accuracy_repair["steps"]
            )
            text += f"; accuracy repair: {raised}"
        layers = [
            f"{search['partition']}/{layer['name']}"
            for search in (self.accuracy_repair or {}).get("searches", ())
            if search.get("passed")
            for layer in search.get("raised", ())
        ]
        if layers:
            text += f"; accuracy repair kept {len(layers)} layers in fp32: {', '.join(layers)}"
        if self.cuda_graphs and not self.cuda_graphs.get("capturable"):
            text += f"; CUDA graphs off: {self.cuda_graphs.get('reason')}"
        if self.quantization and self.quantization.get("fallbacks"):
            names = ", ".join(sorted(self.quantization["fallbacks"]))
            text += f"; quantization failed, kept in fp32: {names}"
        if fell_back:
            noun = "partition" if len(fell_back) == 1 else "partitions"
            text += f"; {len(fell_back)} {noun} fell back after build failures: {', '.join(fell_back)}"
        return text


def report_of(
    plan: PartitionPlan,
    dedup: DedupPlan,
    engines: Mapping[str, EngineArtifact],
    backend: str,
    backend_version: str,
    engine_target: str,
    refits: int,
) -> CompileReport:
    """The report of a new compile, from its plans and engines (``compiler.runtime.module.assemble``)."""
    partitions = [
        {**p.to_dict(), "fingerprint": dedup.instance(p.name).fingerprint, "nodes": len(p.nodes)}
        for p in plan.partitions
    ]
    for row in partitions:
        row.pop("inputs", None)
        row["backend"] = engines[row["fingerprint"]].backend
    built = [a for a in engines.values() if a.is_engine]
    failures = [
        {**a.build_failure, "partitions": [i.partition for i in dedup.instances_of(fp)]}
        for fp, a in engines.items()
        if a.build_failure is not None
    ]
    return CompileReport(
        backend=backend,
        backend_version=backend_version,
        engine_target=engine_target,
        precision=plan.options.precision,
        strip_weights=plan.options.strip_weights,
        partitions=partitions,
        fallback_ops=dict(plan.fallback_ops),
        unique_fingerprints=len(dedup.unique),
        engines_built=sum(1 for a in built if not a.cache_hit),
        cache_hits=sum(1 for a in built if a.cache_hit),
        refits=refits,
        engine_bytes=sum(a.bytes for a in built),
        build_failures=failures,
        quantization=plan.quantization,
        stage_seconds={
            "partition": round(plan.seconds, 4),
            **({"quantize": plan.quantization["seconds"]} if plan.quantization else {}),
            "dedup": round(dedup.seconds, 4),
            "lower": round(sum(a.lower_seconds for a in engines.values()), 4),
            "build": round(sum(a.seconds - a.lower_seconds for a in engines.values()), 4),
        },
    )
