"""What a mixed-precision repair leaves: how much of the model stayed at the precision asked for, the
lines and the warning that say so, and the repair's decision kept in the engine cache.

``kept``: of the partitions compiled at int8, the share of weight elements stored as int8 and of
GEMM/convolution FLOPs run at int8 (at the first validation sample's shapes; ops that run in PyTorch
between engines are not counted), after repair, with the totals.

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


def kept_fractions(
    initial: CompiledModule, final: CompiledModule, dataset: ValidationData
) -> dict[str, Any] | None:
    """Weights and FLOPs kept at int8 (see the module docstring): ``{"precision", "weights", "flops",
    "weights_int8", "weights_total", "flops_int8", "flops_total"}``; None where a module's plan holds
    no quantized graph to count from (a module read back from a package or a workspace: its engines
    hold them), so the repair's record says nothing rather than fail the compile."""
    from compiler.errors import LoweringError

    try:
        return _kept_fractions(initial, final, dataset)
    except LoweringError:
        return None


def _kept_fractions(
    initial: CompiledModule, final: CompiledModule, dataset: ValidationData
) -> dict[str, Any]:
    from compiler.engine_build.lower import _quantized_graph
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
    for name in asked:
        if not feeds.get(name):
            continue
        feed = feeds[name][0]
        fp = initial.dedup.instance(name).fingerprint
        if (0, fp) not in seen:
            seen[(0, fp)] = account(_quantized_graph(initial.plan, initial.dedup, fp), feed)
        if final.plan.options.precision_of(name) in QUANTIZED_PRECISIONS:
            now = final.dedup.instance(name).fingerprint
            if (1, now) not in seen:
                seen[(1, now)] = account(_quantized_graph(final.plan, final.dedup, now), feed)
            total = total + seen[(1, now)]
        else:
            total = total + seen[(0, fp)].float_only()
    return {
        "precision": initial.plan.options.precision,
        "weights": _share(total.weights_int8, total.weights_total),
        "flops": _share(total.flops_int8, total.flops_total),
        **asdict(total),
    }


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
            f"sensitivity rel L2 {rel_l2:.1e}" if not math.isnan(rel_l2) else "sensitivity not measured"
        )
        lines.append(f"{name}/{layer['name']} {layer['op']}{weight}: int8 -> fp32, {sensitivity}")
    return lines


def precision_warning(repair: Mapping[str, Any] | None, asked: str) -> str | None:
    """A warning when repair left the model at another precision than ``asked``: layers or partitions
    raised (with the share of weights and FLOPs still at ``asked``); None when nothing was raised."""
    if not repair:
        return None
    layers = sum(len(s.get("raised", ())) for s in repair.get("searches", ()) if s.get("passed"))
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
    return f"asked for {asked}, got mixed precision to meet the tolerances: {'; '.join(parts)}{share}"


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
