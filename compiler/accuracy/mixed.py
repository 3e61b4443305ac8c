"""What a mixed-precision repair leaves: how much of the model stayed at the precision asked for, the
lines and the warning that say so, and the repair's decision kept in the engine cache.

``kept``: of the partitions compiled at int8, the share of weight elements stored as int8 and of
GEMM/convolution FLOPs run at int8 (at the first validation sample's shapes; ops that run in PyTorch
between engines are not counted), after repair, with the totals. It is counted from the graphs the
engines were built from: the plan's quantized graphs where it holds them (a compile in this process),
else the engines' own bytes where they are ONNX (ONNX Runtime engines: a module read back from a
workspace or a package, as every ``kiln zoo`` compile is). Engines of other formats (TensorRT plans,
Inductor programs) with no quantized graph in the plan leave the count out.

The decision (the repaired ``partition_precision`` and ``float_layers`` with its record) is an engine
cache entry keyed by what decides it: the compile's engines, options and weights, the tolerances and
the validation samples. A re-run of the same compile reads it, rebuilds from the cache (nothing built)
and only checks the model's accuracy again.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from compiler import json_reader
from compiler.backends.base import QUANTIZED_PRECISIONS, to_numpy
from compiler.cache.local import EngineCache
from compiler.inputs.data import ValidationData, sample_digest
from compiler.runtime.module import CompiledModule
from compiler.validation.report import Tolerances
from compiler.version import kiln_version

DECISION_BACKEND = "kiln-accuracy-repair"  # the cache key's backend field: no engine is ever keyed so


def kept_shares(initial: CompiledModule, final: CompiledModule, dataset: ValidationData) -> dict | None:
    """The share of weights and FLOPs left at the precision asked: int8/fp8 (:func:`kept_fractions`),
    fp16/bf16 (:func:`compiler.accuracy.ops.float_kept`); None for another."""
    from compiler.accuracy.ops import REDUCED_FLOATS, float_kept

    asked = initial.plan.options.precision
    if initial.plan.options.quantized:
        return kept_fractions(initial, final, dataset)
    if asked in REDUCED_FLOATS:
        return float_kept(initial, final, dataset, asked)
    return None


def kept_fractions(
    initial: CompiledModule, final: CompiledModule, dataset: ValidationData
) -> dict[str, Any] | None:
    """Weights and FLOPs kept at int8 (see the module docstring): ``{"precision", "weights", "flops",
    "weights_int8", "weights_total", "flops_int8", "flops_total"}``; None where a partition's graph
    cannot be had (neither a quantized graph in the plan nor an ONNX engine), so the repair's record
    says nothing rather than fail the compile."""
    from compiler.quantization.layers import GraphAccount, account
    from compiler.quantization.quantize import _captured
    from compiler.quantization.torch_layers import is_torch_graph

    asked = [
        p.name
        for p in initial.plan.partitions
        if initial.plan.options.precision_of(p.name) in QUANTIZED_PRECISIONS
    ]
    feeds = _captured(initial.plan, dataset.samples[:1], asked) if asked and dataset.samples else {}
    total = GraphAccount()
    seen: dict[tuple[int, str], GraphAccount] = {}

    def counted(side: int, module: CompiledModule, name: str, feed: Mapping[str, Any]) -> GraphAccount | None:
        fp = module.dedup.instance(name).fingerprint
        if (side, fp) not in seen:
            level = module.plan.options.precision_of(name)
            if is_torch_graph(module.plan.options.partition_quantization(name, level)):
                found = counted_torch(module, name, feed)
            else:
                graph = counted_graph(module, fp)
                found = None if graph is None else account(graph, feed, quantized_values(module, name))
            if found is None:
                return None
            seen[(side, fp)] = found
        return seen[(side, fp)]

    for name in asked:
        if not feeds.get(name):
            continue
        feed = feeds[name][0]
        if final.plan.options.precision_of(name) in QUANTIZED_PRECISIONS:
            part = counted(1, final, name, feed)
        else:  # raised whole: its int8 graph's totals, nothing of them at int8
            part = counted(0, initial, name, feed)
            part = part and part.float_only()
        if part is None:
            return None
        total = total + part
    return {
        "precision": initial.plan.options.precision,
        "weights": _share(total.weights_int8, total.weights_total),
        "flops": _share(total.flops_int8, total.flops_total),
        **asdict(total),
    }


def counted_torch(module: CompiledModule, name: str, feed: Mapping[str, Any]) -> Any:
    """What an Inductor int8/fp8 partition (quantized in its torch graph) holds at low precision, counted
    from its graph and the layers kept in float (:func:`compiler.quantization.torch_layers.torch_account`);
    None when its graph cannot be had."""
    import numpy as np
    import torch

    from compiler.quantization.torch_layers import torch_account

    activations = [torch.from_numpy(np.asarray(feed[f"x{k}"])) for k in range(len(feed))]
    try:
        return torch_account(module.plan, name, activations, module.plan.options.float_layers.get(name, ()))
    except Exception:  # a plan without its graphs or weights: the record says nothing rather than fail
        return None


def quantized_values(module: CompiledModule, name: str) -> dict[str, Any]:
    """Partition ``name``'s int32/int64 quantized tensors (shapes and indices: a shape can depend on
    them, never on a weight) under its graph's canonical names (``w0``..), as numpy; none where the
    plan holds none (read back)."""
    import torch

    from compiler.partitioning.dedup import instance_weights

    partition = next(p for p in module.plan.partitions if p.name == name)
    found = module.plan.quantized
    return {
        c: to_numpy(found[k])
        for c, k in instance_weights(module.plan, partition).items()
        if k in found and found[k].dtype in (torch.int32, torch.int64)
    }


def counted_graph(module: CompiledModule, fp: str) -> bytes | None:
    """The ONNX graph of int8 engine ``fp`` as built: the plan's quantized graph when it holds one, else
    the engine itself when it is an ONNX model (ONNX Runtime); None for any other engine format."""
    from compiler.engine_build.lower import _quantized_graph
    from compiler.errors import LoweringError

    try:
        return _quantized_graph(module.plan, module.dedup, fp)
    except LoweringError:  # a plan read back from a workspace or a package: its engines hold the graphs
        pass
    artifact = module.engines.get(fp)
    if artifact is None or artifact.backend != "onnxruntime" or not artifact.engine:
        return None
    return artifact.engine


def kept_line(kept: Mapping[str, Any]) -> str:
    return (
        f"kept at {kept['precision']}: {_percent(kept.get('weights'))} of weights, "
        f"{_percent(kept.get('flops'))} of GEMM/convolution FLOPs"
    )


def search_lines(search: Mapping[str, Any]) -> list[str]:
    """One line per layer a search kept in float, with its sensitivity (a report's and a log's line)."""
    name = search["partition"]
    if not search.get("passed"):
        return [f"{name}: no set of its layers in float met the tolerances ({search.get('note') or 'none'})"]
    level = search.get("precision", "int8")
    lines = []
    for layer in search.get("raised", ()):
        weight = f" ({layer['weight']})" if layer.get("weight") else ""
        measured = sensitivity(layer, level)
        lines.append(f"{name}/{layer['name']} {layer['op']}{weight}: {level} -> fp32, {measured}")
    return lines


def sensitivity(layer: Mapping[str, Any], level: str) -> str:
    """What a raised layer's measurement says: the error it added (alone: quantized with every other
    layer in float; else on top of the others), that it made the output non-finite, or why there is none."""
    value = layer.get("rel_l2")
    alone = bool(layer.get("alone"))
    if value is None:
        return "not measured: the search's deadline (repair_seconds) came first"
    rel_l2 = float(value)
    if math.isnan(rel_l2):  # a record written before non-finite errors were recorded as inf
        return "its sensitivity was not recorded"
    if math.isinf(rel_l2):
        if alone:
            return f"at {level} alone it made the partition's output non-finite"
        return f"the partition's output is non-finite unless it leaves {level}"
    return f"{'alone ' if alone else ''}it added rel L2 {rel_l2:.1e}"


def layers_raised(repair: Mapping[str, Any] | None) -> int:
    """How many layers repair's passing searches kept in float."""
    searches = (repair or {}).get("searches", ())
    return sum(len(s.get("raised", ())) for s in searches if s.get("passed"))


def ended_precision(summary: str, repair: Mapping[str, Any] | None) -> str:
    """The precision a model ended at: its partitions' summary (``int8 x11; fp32: engine_2``, from
    :func:`compiler.accuracy.compare.precision_summary`) with the layers repair kept in float inside
    them: ``int8 x1 (56 layers fp32, 99.8% of weights int8)``."""
    layers = layers_raised(repair)
    if not layers or not summary:
        return summary
    common, sep, rest = summary.partition(";")
    kept = (repair or {}).get("kept") or {}
    share = kept.get("weights")
    inside = f"{layers} layer{'s' if layers != 1 else ''} fp32"
    if isinstance(share, int | float):
        inside += f", {_percent(share)} of weights {kept.get('precision', 'int8')}"
    return f"{common} ({inside}){sep}{rest}"


def precision_warning(repair: Mapping[str, Any] | None, asked: str, ended: str | None = None) -> str | None:
    """A warning when repair left the model at another precision than ``asked``: layers or partitions
    raised (with the share of weights and FLOPs still at ``asked``); None when nothing was raised.
    ``ended``: the partitions' precision summary, which names a model left wholly at another precision
    (``fp32 x1`` for an int8 compile) as that, not as mixed."""
    if not repair:
        return None
    layers = layers_raised(repair)
    partitions = [f"{s['partition']} -> {s['precision_after']}" for s in repair.get("steps", ())]
    if not layers and not partitions:
        return None
    parts = []
    if layers:
        parts.append(f"{layers} layer{'s' if layers != 1 else ''} raised to fp32")
    if partitions:
        parts.append(f"partitions raised: {', '.join(partitions)}")
    kept = repair.get("kept")
    share = f"; {kept_line(kept)}" if kept else ""
    level = (ended or "").split(";")[0].split(" (")[0].split(" x")[0].strip()
    if ";" not in (ended or "") and level and level != asked:  # every partition at one other level
        got = f"got {level} (every partition raised) to meet the tolerances"
    else:
        got = "got mixed precision to meet the tolerances"
    return f"asked for {asked}, {got}: {'; '.join(parts)}{share}"


def decision_key(compiled: CompiledModule, gate: Tolerances, dataset: ValidationData) -> str | None:
    """The engine-cache key of a repair decision for this compile (None when it cannot be keyed)."""
    options = compiled.plan.options
    digest = hashlib.sha256()
    try:
        for key, tensor in sorted({**compiled.plan.weights(), **compiled.plan.quantized}.items()):
            digest.update(key.encode())
            digest.update(to_numpy(tensor).tobytes())
    except Exception:  # weights left out (an int8-only package): nothing to key by
        return None
    fields = {
        "engines": sorted(compiled.dedup.unique),
        "options": {k: v for k, v in options.to_dict().items() if k != "repair_seconds"},
        "weights": digest.hexdigest(),
        "tolerances": asdict(gate),
        "samples": [sample_digest(s) for s in dataset.samples],
    }
    identity = hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()
    return EngineCache.key(
        fingerprint=identity,
        backend=DECISION_BACKEND,
        library_version=kiln_version(),
        engine_target=options.device,
        settings={"kind": "accuracy repair decision"},
    )


def recalled_decision(cache: EngineCache, key: str) -> dict | None:
    data = cache.get(key)
    if data is None:
        return None
    try:  # a cache record is trusted input read as untrusted data: bounded
        found = json_reader.loads(data, f"accuracy repair decision {key[:16]}")
    except ValueError:
        return None
    return found if isinstance(found, dict) else None


def remember_decision(cache: EngineCache, key: str, record: Mapping[str, Any]) -> None:
    cache.put(key, json.dumps(record, sort_keys=True).encode(), {"kind": "accuracy repair decision"})


def _share(part: int, whole: int) -> float | None:
    return round(part / whole, 4) if whole else None


def _percent(value: Any) -> str:
    return f"{100 * value:.1f}%" if isinstance(value, int | float) else "n/a"
