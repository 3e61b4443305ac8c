"""What a compile decided, as one self-contained HTML page per package (``kiln report``).

Everything comes from the verified manifest, read as data (no program is loaded, nothing is imported
or unpickled), and the package's split graph where it saved one: the model's dataflow drawn as inline
SVG (:mod:`compiler.package.report_map`: inputs, engines and PyTorch nodes in order, outputs; each engine with
its fingerprint, backend, precision and why it fell back), per-partition accuracy where a repair
measured it, the dedup map, the repair decisions, input specs and engine profiles, validation, where
the compile's time went, and lineage. No script, no stylesheet or font from elsewhere: the page opens
offline, from a file or an MLflow artifact.

A package is untrusted: every value is typed when its manifest is read (:mod:`compiler.package.manifest`),
and every value the page shows is escaped, whatever its type, because the page is built only with
:func:`compiler.package.report_html.h`. Long tables stop at ``MAX_ROWS`` and a map too large to draw is
summarized: rendering is linear in the plan's size and never hangs on a huge model.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from compiler.package.manifest import SIGNATURE, Manifest
from compiler.package.report_html import Markup, h, join
from compiler.package.report_map import (
    MAX_DRAWN,
    SplitGraph,
    dims,
    fell_back,
    map_section,
    partition_precision,
    read_split_graph,
)

MAX_ROWS = 400  # rows per table

__all__ = ["MAX_DRAWN", "MAX_ROWS", "program_sections", "render_package_report", "render_report"]


def render_report(
    manifest: Manifest,
    title: str,
    split: SplitGraph | None = None,
    *,
    signed: bool | None = None,
    body: Sequence[Markup] | None = None,
) -> str:
    """The whole page for one package (``title``: what it is called, e.g. its folder or version).
    ``split``: the package's split graph (:func:`compiler.package.report_map.read_split_graph`), which the map
    draws the whole dataflow from; without it the map shows what the partition plan records.
    ``signed``: whether the package holds a model-signing signature (``model.sig``; None: unknown).
    ``body``: the sections between the overview and the lineage (default: :func:`program_sections`)."""
    sections = [
        _overview(manifest, title),
        *(program_sections(manifest, split) if body is None else body),
        _lineage_section(manifest, signed),
    ]
    return str(h(_PAGE, title=f"kiln report: {title}", body=join(sections, "\n")))


def program_sections(manifest: Manifest, split: SplitGraph | None) -> list[Markup]:
    """One program's sections: map, partitions, dedup, repair, specs and profiles, validation, time."""
    return [
        map_section(manifest, split),
        _partitions_section(manifest),
        _dedup_section(manifest),
        _repair_section(manifest),
        _specs_section(manifest),
        _validation_section(manifest),
        _time_section(manifest),
    ]


def render_package_report(path: str | Path, manifest: Manifest, title: str) -> str:
    """:func:`render_report` for the package at ``path`` (its ``manifest`` already read and verified),
    with the split graph it saved. (A generation package's page, with both its programs and how to
    call it, is :func:`compiler.generation.report.render_package_report`'s, which takes any package.)"""
    signed = (Path(path) / SIGNATURE).is_file()
    return render_report(manifest, title, read_split_graph(path, manifest), signed=signed)


# ---------------------------------------------------------------- tables


def _partitions_section(manifest: Manifest) -> Markup:
    reasons = fell_back(manifest)
    repaired = {s.get("partition"): s for s in _repair_steps(manifest)}
    rows = []
    for part in manifest.report.partitions:
        name = str(part.get("name"))
        step = repaired.get(name)
        accuracy = (
            f"rel L2 {_num(step.get('rel_l2_before'))} → {_num(step.get('rel_l2_after'))}" if step else ""
        )
        ops = ", ".join(f"{op} x{n}" for op, n in sorted((part.get("ops") or {}).items()))
        rows.append(
            [
                name,
                str(part.get("backend") or manifest.backend),
                partition_precision(manifest, name),
                str(part.get("fingerprint", ""))[:16],
                str(part.get("nodes", "")),
                ops,
                accuracy or "not measured per partition",
                reasons.get(name, "no: runs as an engine"),
            ]
        )
    table = _table(
        "partitions",
        ["partition", "backend", "precision", "fingerprint", "nodes", "ops", "accuracy", "fell back"],
        rows,
    )
    fallback = ", ".join(f"{op} x{n}" for op, n in sorted(manifest.report.fallback_ops.items())) or "none"
    return h(
        "<section><h2>Partitions</h2><p>Ops left to PyTorch by the partitioner: {fallback}. "
        "Per-partition accuracy is recorded where an accuracy repair measured it; per-partition latency "
        "is measured by <code>kiln debug compare PACKAGE</code>.</p>{table}</section>",
        fallback=fallback,
        table=table,
    )


def _dedup_section(manifest: Manifest) -> Markup:
    shared: dict[str, list[str]] = {}
    for instance in manifest.dedup.get("instances") or []:
        shared.setdefault(str(instance.get("fingerprint")), []).append(str(instance.get("partition")))
    rows = []
    for fingerprint, record in manifest.engines.items():
        rows.append(
            [
                fingerprint[:16],
                record.backend,
                record.file or "none (runs in PyTorch)",
                _bytes(record.bytes),
                "yes" if record.stripped else "no",
                ", ".join(shared.get(fingerprint, [])) or "none",
            ]
        )
    table = _table("dedup", ["fingerprint", "backend", "engine file", "size", "stripped", "instances"], rows)
    return h(
        "<section><h2>Dedup map</h2><p>Structurally identical partitions share one engine build: "
        "{engines} engines for {partitions} partitions.</p>{table}</section>",
        engines=len(manifest.engines),
        partitions=len(manifest.report.partitions),
        table=table,
    )


def _repair_steps(manifest: Manifest) -> list[dict[str, Any]]:
    return list((manifest.report.accuracy_repair or {}).get("steps") or [])


def _repair_section(manifest: Manifest) -> Markup:
    record = manifest.report.accuracy_repair
    if not record:
        return h(
            '<section><h2>Accuracy repair</h2><p class="empty">No repair: the compile met its tolerances '
            "(or predates repair records).</p></section>"
        )
    rows = [
        [
            str(s.get("round")),
            str(s.get("partition")),
            f"{s.get('precision_before')} → {s.get('precision_after')}",
            f"{_num(s.get('rel_l2_before'))} → {_num(s.get('rel_l2_after'))}",
            f"{str(s.get('fingerprint_before'))[:12]} → {str(s.get('fingerprint_after'))[:12]}",
        ]
        for s in _repair_steps(manifest)
    ]
    lines = join(h("<li>{line}</li>", line=line) for line in record.get("lines") or [])
    table = _table("repair", ["round", "partition", "precision", "its rel L2", "fingerprint"], rows)
    layers = [
        [
            str(search.get("partition")),
            str(layer.get("name")),
            str(layer.get("op")),
            str(layer.get("weight") or ""),
            _num(layer.get("rel_l2")),
            str(layer.get("params", "")),
            str(layer.get("flops", "")),
        ]
        for search in record.get("searches") or ()
        if search.get("passed")
        for layer in search.get("raised") or ()
    ]
    if layers:
        header = ["partition", "layer", "op", "parameter", "rel L2 it added", "weights", "FLOPs"]
        table = join([_table("raised-layers", header, layers), table])
    return h("<section><h2>Accuracy repair</h2><ul>{lines}</ul>{table}</section>", lines=lines, table=table)


def _specs_section(manifest: Manifest) -> Markup:
    rows = [
        [
            s.name,
            s.dtype,
            dims(s.min_shape),
            dims(s.opt_shape),
            dims(s.max_shape),
            ", ".join(f"{axis}: {name}" for axis, name in sorted(s.dynamic_dims.items())) or "static",
        ]
        for s in manifest.input_specs
    ]
    specs = _table("input-specs", ["input", "dtype", "min", "opt", "max", "dynamic dims"], rows)
    profiles = [
        [
            fingerprint[:16],
            spec.name,
            spec.dtype,
            dims(spec.min_shape),
            dims(spec.opt_shape),
            dims(spec.max_shape),
        ]
        for fingerprint, record in manifest.engines.items()
        for spec in record.io.inputs
    ]
    engines = _table("profiles", ["engine", "input", "dtype", "min", "opt", "max"], profiles)
    return h(
        "<section><h2>Input specs and engine profiles</h2>{specs}<h3>Engine profiles</h3>{engines}</section>",
        specs=specs,
        engines=engines,
    )


def _validation_section(manifest: Manifest) -> Markup:
    report = manifest.validation
    if report is None:
        return h('<section><h2>Validation</h2><p class="empty">Not recorded in this package.</p></section>')
    rows = [
        [o.output, _num(o.rel_l2), _num(o.max_abs), _num(o.cosine), _num(getattr(o, "top1_agreement", None))]
        for o in report.outputs
    ]
    outputs = _table("accuracy", ["output", "rel L2", "max abs", "cosine", "top-1 agreement"], rows)
    latency = _table(
        "latency",
        ["", "median ms", "p95 ms", "runs"],
        [
            [label, _num(lat.median_ms), _num(lat.p95_ms), str(lat.runs)]
            for label, lat in (("eager PyTorch", report.eager), ("compiled", report.compiled))
        ],
    )
    skipped = join(h("<li>{s}</li>", s=s) for s in report.skipped) or h("<li>none</li>")
    shapes = "; ".join(" ".join(dims(s) for s in sample) for sample in report.shapes[:20])
    return h(
        "<section><h2>Validation</h2><p>Data: {data}, {samples} samples at precision {precision}; latency "
        "ratio {ratio} (compiled / eager). Shapes: {shapes}.</p>{outputs}{latency}"
        "<p>Skipped samples:</p><ul>{skipped}</ul></section>",
        data=report.data_source,
        samples=report.samples,
        precision=report.precision,
        ratio=_num(_ratio(report)),
        shapes=shapes or "none recorded",
        outputs=outputs,
        latency=latency,
        skipped=skipped,
    )


def _time_section(manifest: Manifest) -> Markup:
    stages = manifest.report.stage_seconds or {}
    seconds = {stage: _float(s) for stage, s in stages.items()}
    total = sum(s for s in seconds.values() if s is not None) or 1.0
    rows = [
        [stage, _num(stages[stage], ".3f"), "" if s is None else f"{100 * s / total:.0f}%"]
        for stage, s in seconds.items()
    ]
    table = _table("stage-times", ["stage", "seconds", "share"], rows)
    r = manifest.report
    return h(
        "<section><h2>Where the time went</h2><p>{built} engines built, {hits} from the engine cache, "
        "{refits} refits.</p>{table}</section>",
        built=r.engines_built,
        hits=r.cache_hits,
        refits=r.refits,
        table=table,
    )


def _overview(manifest: Manifest, title: str) -> Markup:
    validation = manifest.validation
    facts = [
        ("backend", f"{manifest.backend} {manifest.backend_version}"),
        ("engine target", manifest.engine_target),
        ("precision", manifest.precision),
        ("engines weight-stripped", _stripped(manifest)),
        ("partitions", str(len(manifest.report.partitions))),
        ("unique engines", str(len(manifest.engines))),
        ("max rel L2", _num(validation.max_rel_l2) if validation else "not recorded"),
        ("latency ratio", _num(_ratio(validation)) if validation else "not recorded"),
    ]
    return h(
        '<h1>{title}</h1><table class="facts" id="overview">{items}</table>', title=title, items=_facts(facts)
    )


def _stripped(manifest: Manifest) -> str:
    """Whether the package's engines hold their weights, and how they were built where a package stores
    them otherwise (ONNX Runtime and Inductor engines are stored stripped whatever strip_weights built)."""
    filed = [r for r in manifest.engines.values() if r.file is not None]
    stripped = sum(r.stripped for r in filed)
    text = f"{stripped} of {len(filed)}"
    if stripped in (0, len(filed)):
        text = "yes" if stripped else "no"
    if stripped and not manifest.strip_weights:
        text += " (built with their weights, strip_weights false: the package holds each weight once)"
    return text


def _signed(signed: bool | None, manifest: Manifest) -> str:
    if signed:
        return f"yes: {SIGNATURE} (model-signing; verified at load where a key or roots are configured)"
    if manifest.signature:
        return "only kiln's retired HMAC field (not verified; re-sign with model-signing)"
    return "no" if signed is False else "not known (the page was made without the package folder)"


def _lineage_section(manifest: Manifest, signed: bool | None = None) -> Markup:
    source = manifest.source
    facts = [
        ("source", source.uri if source else "not recorded (format 1, or compiled from a model object)"),
        ("source kind", source.kind if source and source.kind else "not recorded"),
        ("source version", source.version if source and source.version else "not recorded"),
        ("source identity", source.identity if source and source.identity else "not recorded"),
        ("source run", source.run_id if source and source.run_id else "none"),
        ("package format", str(manifest.format_version)),
        ("kiln", manifest.kiln_version),
        ("torch", manifest.torch_version),
        ("content hash", manifest.content_hash or "none"),
        ("signed", _signed(signed, manifest)),
        ("op modules", ", ".join(manifest.op_modules) or "none"),
    ]
    files = _table(
        "files",
        ["file", "size", "sha256"],
        [[p, _bytes(f.bytes), f.sha256[:16]] for p, f in manifest.files.items()],
    )
    return h(
        '<section><h2>Lineage</h2><table class="facts" id="lineage">{items}</table>{files}</section>',
        items=_facts(facts),
        files=files,
    )


# ---------------------------------------------------------------- helpers


def _facts(facts: Iterable[tuple[str, str]]) -> Markup:
    return join(h("<tr><th>{k}</th><td>{v}</td></tr>", k=k, v=v) for k, v in facts)


def _table(table_id: str, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Markup:
    rows = list(rows)
    head = join(h("<th>{c}</th>", c=c) for c in header)
    body = join(
        h("<tr>{cells}</tr>", cells=join(h("<td>{c}</td>", c=c) for c in row)) for row in rows[:MAX_ROWS]
    )
    if not rows:
        body = h('<tr><td colspan="{n}" class="empty">none</td></tr>', n=len(header))
    more = h('<p class="more">… {n} more rows not shown.</p>', n=len(rows) - MAX_ROWS)
    return h(
        '<table id="{id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}',
        id=table_id,
        head=head,
        body=body,
        more=more if len(rows) > MAX_ROWS else h(""),
    )


def _float(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _num(value: Any, spec: str = ".3g") -> str:
    """A number as text; anything else (a value handed over in memory, never read) as its text."""
    if value is None:
        return "not recorded"
    number = _float(value)
    return str(value) if number is None else format(number, spec)


def _ratio(report: Any) -> Any:
    try:
        return report.latency_ratio
    except (TypeError, ZeroDivisionError):  # latencies handed over in memory as something else
        return "not computable"


def _bytes(n: Any) -> str:
    if isinstance(n, bool) or not isinstance(n, int):
        return str(n)
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy"
 content="default-src 'none'; style-src 'unsafe-inline'; img-src data:">
<title>{title}</title>
<style>
body {{ font-family: sans-serif; margin: 1.5em; color: #222; }}
table {{ border-collapse: collapse; margin: 0.5em 0 1em; font-size: 13px; }}
th, td {{ border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }}
th {{ background: #f4f4f4; }}
.facts th {{ width: 11em; }}
.empty {{ color: #777; font-style: italic; }}
.partial {{ color: #775; }}
.scroll {{ overflow: auto; border: 1px solid #ddd; }}
.legend span {{ border: 1px solid #444; padding: 1px 6px; margin-right: 6px; font-size: 12px; }}
section {{ margin-top: 1.5em; }}
</style></head>
<body>
{body}
</body></html>
"""
