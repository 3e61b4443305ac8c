"""Dedup: partitions with one fingerprint share one engine build; each instance keeps its weights.

Weights get canonical names by position among the partition's weight inputs (``w0, w1, ...``), not by
module path, so every instance of a structure maps the same canonical names to its own tensors and a
shared engine is refitted per instance.
"""

from __future__ import annotations

import hashlib
import io
import time
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field

from compiler.backends.base import QUANTIZED_PRECISIONS
from compiler.partitioning.fingerprint import fingerprint
from compiler.partitioning.partition import QUANTIZED_PREFIX, Partition, PartitionPlan


@dataclass(frozen=True)
class EngineInstance:
    """One partition using an engine: canonical weight name -> the program's weight key."""

    partition: str
    fingerprint: str
    weights: Mapping[str, str]

    def to_dict(self) -> dict:
        return {"partition": self.partition, "fingerprint": self.fingerprint, "weights": dict(self.weights)}


@dataclass
class DedupPlan:
    """Unique structures (fingerprint -> representative partition) and every instance."""

    unique: dict[str, str]
    instances: tuple[EngineInstance, ...]
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def fingerprints(self) -> list[str]:
        return list(self.unique)

    def instances_of(self, fp: str) -> list[EngineInstance]:
        return [i for i in self.instances if i.fingerprint == fp]

    def instance(self, partition: str) -> EngineInstance:
        return next(i for i in self.instances if i.partition == partition)

    def to_dict(self) -> dict:
        return {"unique": dict(self.unique), "instances": [i.to_dict() for i in self.instances]}

    @classmethod
    def from_dict(cls, data: Mapping) -> DedupPlan:
        instances = tuple(EngineInstance(**i) for i in data["instances"])
        return cls(dict(data["unique"]), instances)


def canonical_weights(partition: Partition) -> dict[str, str]:
    return {f"w{i}": key for i, key in enumerate(partition.weight_keys)}


def instance_weights(plan: PartitionPlan, partition: Partition) -> dict[str, str]:
    """Canonical name -> weight key. Once ``compiler.quantize`` has run (its record is on the plan), a
    quantized partition's weights are exactly the tensors it made for it: none where its program holds
    them (Inductor's frozen int8). Otherwise, and before quantizing, its program weights."""
    if plan.quantization is not None and plan.options.precision_of(partition.name) in QUANTIZED_PRECISIONS:
        prefix = f"{QUANTIZED_PREFIX}{partition.name}/"
        names = sorted(
            (k[len(prefix) :] for k in plan.quantized if k.startswith(prefix)), key=lambda n: int(n[1:])
        )
        return {name: f"{prefix}{name}" for name in names}
    return canonical_weights(partition)


def partition_fingerprint(plan: PartitionPlan, partition: Partition) -> str:
    kinds = tuple(i.kind for i in partition.inputs)
    settings = plan.options.build_settings(partition.name).to_dict()
    graph = plan.quantized_graphs.get(partition.name)
    if graph is not None and (settings.get("quantization") or {}).get("scales") == "graph":
        # Its scales are compiled into its engine (TensorRT): the graph that holds them is its structure.
        settings["quantized_graph"] = graph_digest(graph)
    return fingerprint(plan.submodule(partition.name).graph, kinds, plan.symbols, settings)


def graph_digest(graph: bytes) -> str:
    """sha256 of a quantized graph: ONNX bytes as they are; a saved program (a zip: Inductor's int8) by
    its records, less the random id torch.export.save writes into each, so the same program has the
    same digest in every process (and its engine is found in the engine cache)."""
    raw = hashlib.sha256(graph).hexdigest()
    if not graph.startswith(b"PK"):
        return raw
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(io.BytesIO(graph)) as archive:
            members = sorted(archive.infolist(), key=lambda info: info.filename)
            # A plan read from a package is outside bytes: a zip that inflates far past its size is
            # hashed as it is (a cache miss at worst), never inflated.
            if sum(info.file_size for info in members) > 16 * len(graph) + (1 << 20):
                return raw
            for info in members:
                if info.filename.endswith(".data/serialization_id"):
                    continue
                digest.update(info.filename.encode())
                member = hashlib.sha256()
                with archive.open(info) as stream:
                    while chunk := stream.read(1 << 20):
                        member.update(chunk)
                digest.update(member.digest())
    except (zipfile.BadZipFile, OSError, ValueError):  # not a saved program after all: its bytes
        return raw
    return digest.hexdigest()


def dedup(plan: PartitionPlan, *, share: bool = True) -> DedupPlan:
    """Group partitions by fingerprint. ``share=False`` gives every partition its own engine (the
    baseline that the dedup benchmark measures against)."""
    start = time.perf_counter()
    unique: dict[str, str] = {}
    instances = []
    for part in plan.partitions:
        fp = partition_fingerprint(plan, part)
        if not share:
            fp = hashlib.sha256(f"{fp}:{part.name}".encode()).hexdigest()
        unique.setdefault(fp, part.name)
        instances.append(EngineInstance(part.name, fp, instance_weights(plan, part)))
    return DedupPlan(unique, tuple(instances), time.perf_counter() - start)
