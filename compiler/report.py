"""CompileReport: what a compile did, carried by the compiled module and its package (seed 002)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


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
    # The compile-time CUDA-graph capture check (compiler.cudagraphs.CaptureCheck.to_dict()); None where
    # none ran (CPU, cuda_graphs 'off', engines outside PyTorch's stream).
    cuda_graphs: dict | None = None
    # One per shape profile (CompileOptions.profiles), measured at compile: the profile, its input
    # shapes, its median latency and what served it ("dispatch").
    profiles: list[dict] | None = None
    # Set when partitions are int8: compiler.quantize.QuantizationRecord.to_dict() (calibration data,
    # sample digests, quantized partitions, float fallbacks with their reasons).
    quantization: dict | None = None

    def to_dict(self) -> dict:
        data = asdict(self)
        data["num_partitions"] = len(self.partitions)
        data["fallback_op_count"] = sum(self.fallback_ops.values())
        return data

    @classmethod
    def from_dict(cls, data: dict) -> CompileReport:
        fields = set(cls.__dataclass_fields__)
        if "target_device" in data and "engine_target" not in data:  # reports written before the rename
            data = {**data, "engine_target": data["target_device"]}
        for name, spec in cls.__dataclass_fields__.items():  # a package's report is read, never trusted
            kind = spec.default_factory
            if name in data and kind in (list, dict) and not isinstance(data[name], kind):
                raise TypeError(f"report field {name!r} must be a {kind.__name__}, got {data[name]!r:.60}")
        for name in ("accuracy_repair", "cuda_graphs"):
            if data.get(name) is not None and not isinstance(data[name], dict):
                raise TypeError(f"report field {name!r} must be a mapping or null, got {data[name]!r:.60}")
        if data.get("cuda_graphs") is not None:
            from compiler.cudagraph_policy import CaptureCheck

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
        if self.cuda_graphs and not self.cuda_graphs.get("capturable"):
            text += f"; CUDA graphs off: {self.cuda_graphs.get('reason')}"
        if self.quantization and self.quantization.get("fallbacks"):
            names = ", ".join(sorted(self.quantization["fallbacks"]))
            text += f"; quantization failed, kept in fp32: {names}"
        if fell_back:
            noun = "partition" if len(fell_back) == 1 else "partitions"
            text += f"; {len(fell_back)} {noun} fell back after build failures: {', '.join(fell_back)}"
        return text
