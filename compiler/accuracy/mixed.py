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

    asked = [
        p.name
        for p in initial.plan.partitions
        if initial.plan.options.precision_of(p.name) in QUANTIZED_PRECISIONS
    ]
    feeds = _captured(initial.plan, dataset.samples[:1], asked) if asked and dataset.samples else {}
    total = GraphAccount()
    seen: dict[tuple[int, str], GraphAccount] = {}

    def counted(side: int, module: CompiledModule, fp: str, feed: Mapping[str, Any]) -> GraphAccount | None:
        if (side, fp) not in seen:
            graph = counted_graph(module, fp)
            if graph is None:
                return None
            seen[(side, fp)] = account(graph, feed)
        return seen[(side, fp)]

    for name in asked:
        if not feeds.get(name):
            continue
        feed = feeds[name][0]
        if final.plan.options.precision_of(name) in QUANTIZED_PRECISIONS:
            part = counted(1, final, final.dedup.instance(name).fingerprint, feed)
        else:  # raised whole: its int8 graph's totals, nothing of them at int8
            part = counted(0, initial, initial.dedup.instance(name).fingerprint, feed)
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
    lines = []
    for layer in search.get("raised", ()):
        weight = f" ({layer['weight']})" if layer.get("weight") else ""
        rel_l2 = float(layer["rel_l2"])
        sensitivity = (
            f"{'alone ' if layer.get('alone') else ''}it added rel L2 {rel_l2:.1e}"
            if not math.isnan(rel_l2)
            else "sensitivity not measured"
        )
        level = search.get("precision", "int8")
        lines.append(f"{name}/{layer['name']} {layer['op']}{weight}: {level} -> fp32, {sensitivity}")
    return lines


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
