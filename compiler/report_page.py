"""What a compile decided, as one self-contained HTML page per package (``kiln report``).

Everything comes from the verified manifest, read as data (no program is loaded, nothing is imported
or unpickled): the partitioned graph drawn as inline SVG (engines vs PyTorch fallback, each box with
its fingerprint, backend, precision and why it fell back), per-partition accuracy where a repair
measured it, the dedup map, the repair decisions, input specs and engine profiles, validation, where
the compile's time went, and lineage. No script, no stylesheet or font from elsewhere: the page opens
offline, from a file or an MLflow artifact.

The graph is built from the partition plan: model inputs, partitions and the PyTorch nodes feeding
them, with an edge wherever a partition's activation input is produced by another box. A plan too
large to draw (``MAX_DRAWN`` boxes) is summarized in words, and long tables stop at ``MAX_ROWS``:
rendering is linear in the plan's size and never hangs on a huge model.
"""

from __future__ import annotations

import html
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from compiler.manifest import Manifest

MAX_DRAWN = 160  # boxes; beyond, the graph is summarized (an SVG that large reads as noise anyway)
MAX_ROWS = 400  # rows per table
TORCH = "torch"

_COLORS = {"engine": "#d8f0dc", "torch": "#eeeeee", "failed": "#fde2c8", "input": "#dde8f8"}


@dataclass
class Box:
    """One drawn node: a model input, an engine partition or a PyTorch node."""

    id: str
    kind: str  # "input" | "engine" | "torch" | "failed" (a partition that fell back after its build failed)
    lines: list[str]
    inputs: list[str] = field(default_factory=list)  # ids of the boxes feeding it
    layer: int = 0
    row: int = 0


def render_report(manifest: Manifest, title: str) -> str:
    """The whole page for one package (``title``: what it is called, e.g. its folder or version)."""
    boxes = graph_boxes(manifest)
    sections = [
        _overview(manifest, title),
        _graph_section(boxes),
        _partitions_section(manifest),
        _dedup_section(manifest),
        _repair_section(manifest),
        _specs_section(manifest),
        _validation_section(manifest),
        _time_section(manifest),
        _lineage_section(manifest),
    ]
    return _PAGE.format(title=_e(f"kiln report: {title}"), body="\n".join(sections))


# ---------------------------------------------------------------- the graph


def partition_precision(manifest: Manifest, name: str) -> str:
    """The precision a partition was built at: the compile's, or its per-partition exception."""
    options = manifest.plan.get("options") or {}
    return str((options.get("partition_precision") or {}).get(name, manifest.precision))


def fell_back(manifest: Manifest) -> dict[str, str]:
    """partition -> why it runs in PyTorch (or on another backend) although it was planned as an engine."""
    reasons: dict[str, str] = {}
    for failure in manifest.report.build_failures or []:
        to = failure.get("fell_back_to", TORCH)
        error = str(failure.get("error", "build failed")).strip().splitlines()[0][:160]
        node = f" at node {failure['node']}" if failure.get("node") else ""
        for name in failure.get("partitions", []):
            reasons[name] = f"{failure.get('backend', 'build')} failed{node}: {error}; runs on {to}"
    for name, level in ((manifest.plan.get("options") or {}).get("partition_precision") or {}).items():
        if level == TORCH:
            reasons.setdefault(name, "kept in PyTorch by accuracy repair or the options")
    return reasons


def graph_boxes(manifest: Manifest) -> list[Box]:
    """Inputs, partitions and the PyTorch nodes feeding them, laid out in layers (longest path)."""
    report_parts = {p.get("name"): p for p in manifest.report.partitions}
    reasons = fell_back(manifest)
    boxes: dict[str, Box] = {}
    for spec in manifest.input_specs:
        boxes[spec.name] = Box(spec.name, "input", [spec.name, f"{spec.dtype} {_shape_range(spec)}"])
    producer: dict[str, str] = {}  # fx node name -> partition
    partitions = list(manifest.plan.get("partitions") or [])
    for part in partitions:
        for node in part.get("nodes") or []:
            producer[str(node)] = part["name"]
    for part in partitions:
        name = part["name"]
        info = report_parts.get(name, {})
        fingerprint = str(info.get("fingerprint", ""))
        backend = str(info.get("backend") or manifest.backend)
        kind = "failed" if name in reasons else "engine"
        lines = [name, f"{backend} · {partition_precision(manifest, name)}", f"fp {fingerprint[:12]}"]
        if name in reasons:
            lines.append("fell back: " + reasons[name][:60])
        box = Box(name, kind, lines)
        for item in part.get("inputs") or []:
            if item.get("kind") != "activation":
                continue
            node = str(item.get("node"))
            source = producer.get(node)
            if source is None and node not in boxes:
                boxes[node] = Box(node, "torch", [node, "PyTorch"])
            box.inputs.append(source or node)
        boxes[name] = box
    _layout(boxes)
    return list(boxes.values())


def _layout(boxes: dict[str, Box]) -> None:
    """Layer = longest path from a source (inputs come first in dict order; a cycle cannot occur in a
    plan, but a malformed one is cut rather than looped on); row = order within the layer."""
    done: dict[str, int] = {}
    for box_id in boxes:
        stack = [(box_id, 0)]
        while stack:  # iterative DFS: a deep plan must not hit the recursion limit
            current, state = stack.pop()
            if current in done:
                continue
            box = boxes[current]
            feeders = [i for i in box.inputs if i in boxes and i != current]
            if state == 0:
                stack.append((current, 1))
                stack.extend((i, 0) for i in feeders if i not in done)
            else:
                done[current] = 1 + max((done.get(i, 0) for i in feeders), default=-1)
    rows: dict[int, int] = {}
    for box_id, box in boxes.items():
        box.layer = done.get(box_id, 0)
        box.row = rows.get(box.layer, 0)
        rows[box.layer] = box.row + 1


def graph_svg(boxes: Sequence[Box]) -> str:
    width, height, gap_x, gap_y = 210, 74, 50, 18
    by_id = {b.id: b for b in boxes}
    cols = 1 + max((b.layer for b in boxes), default=0)
    rows = 1 + max((b.row for b in boxes), default=0)
    total_w, total_h = cols * (width + gap_x) + gap_x, rows * (height + gap_y) + gap_y

    def corner(box: Box) -> tuple[int, int]:
        return gap_x + box.layer * (width + gap_x), gap_y + box.row * (height + gap_y)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" id="graph" width="{total_w}" height="{total_h}" '
        f'viewBox="0 0 {total_w} {total_h}" role="img" aria-label="partitioned graph">',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
        'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>',
    ]
    for box in boxes:
        x, y = corner(box)
        for source in box.inputs:
            if source in by_id:
                sx, sy = corner(by_id[source])
                parts.append(
                    f'<line class="edge" x1="{sx + width}" y1="{sy + height // 2}" x2="{x}" '
                    f'y2="{y + height // 2}" stroke="#555" marker-end="url(#arrow)"/>'
                )
    for box in boxes:
        x, y = corner(box)
        parts.append(
            f'<g class="node {box.kind}" data-id="{_e(box.id)}"><title>{_e(" | ".join(box.lines))}</title>'
            f'<rect x="{x}" y="{y}" width="{width}" height="{height}" rx="6" fill="{_COLORS[box.kind]}" '
            'stroke="#444"/>'
        )
        for i, line in enumerate(box.lines[:4]):
            weight = ' font-weight="bold"' if i == 0 else ""
            text = line if len(line) <= 30 else line[:29] + "…"
            parts.append(f'<text x="{x + 8}" y="{y + 17 + 16 * i}" font-size="12"{weight}>{_e(text)}</text>')
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


def _graph_section(boxes: list[Box]) -> str:
    engines = sum(b.kind == "engine" for b in boxes)
    failed = sum(b.kind == "failed" for b in boxes)
    torch_nodes = sum(b.kind == "torch" for b in boxes)
    summary = (
        f"{engines} engine partitions, {failed} fell back after a failed build, {torch_nodes} PyTorch "
        f"nodes feeding them, {sum(b.kind == 'input' for b in boxes)} inputs"
    )
    if len(boxes) > MAX_DRAWN:
        drawing = (
            f'<p class="too-large">The graph has {len(boxes)} boxes, more than {MAX_DRAWN}: not drawn. '
            "The partition table below lists every partition.</p>"
        )
    else:
        drawing = f'<div class="scroll">{graph_svg(boxes)}</div>' + _legend()
    return f'<section id="graph-section"><h2>Partitioned graph</h2><p>{_e(summary)}</p>{drawing}</section>'


def _legend() -> str:
    items = [("engine", "engine"), ("failed", "fell back after a failed build"), ("torch", "PyTorch")]
    items.append(("input", "model input"))
    return (
        '<p class="legend">'
        + " ".join(f'<span style="background:{_COLORS[k]}">{_e(text)}</span>' for k, text in items)
        + "</p>"
    )


# ---------------------------------------------------------------- tables


def _partitions_section(manifest: Manifest) -> str:
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
    return (
        f"<section><h2>Partitions</h2><p>Ops left to PyTorch by the partitioner: {_e(fallback)}. "
        "Per-partition accuracy is recorded where an accuracy repair measured it; per-partition latency "
        f"is measured by <code>kiln debug compare PACKAGE</code>.</p>{table}</section>"
    )


def _dedup_section(manifest: Manifest) -> str:
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
    return (
        "<section><h2>Dedup map</h2><p>Structurally identical partitions share one engine build: "
        f"{len(manifest.engines)} engines for {len(manifest.report.partitions)} partitions.</p>{table}"
        "</section>"
    )


def _repair_steps(manifest: Manifest) -> list[dict[str, Any]]:
    return list((manifest.report.accuracy_repair or {}).get("steps") or [])


def _repair_section(manifest: Manifest) -> str:
    record = manifest.report.accuracy_repair
    if not record:
        return (
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
    lines = "".join(f"<li>{_e(line)}</li>" for line in record.get("lines") or [])
    table = _table("repair", ["round", "partition", "precision", "its rel L2", "fingerprint"], rows)
    return f"<section><h2>Accuracy repair</h2><ul>{lines}</ul>{table}</section>"


def _specs_section(manifest: Manifest) -> str:
    rows = [
        [
            s.name,
            s.dtype,
            _dims(s.min_shape),
            _dims(s.opt_shape),
            _dims(s.max_shape),
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
            _dims(spec.min_shape),
            _dims(spec.opt_shape),
            _dims(spec.max_shape),
        ]
        for fingerprint, record in manifest.engines.items()
        for spec in record.io.inputs
    ]
    engines = _table("profiles", ["engine", "input", "dtype", "min", "opt", "max"], profiles)
    return (
        f"<section><h2>Input specs and engine profiles</h2>{specs}<h3>Engine profiles</h3>{engines}</section>"
    )


def _validation_section(manifest: Manifest) -> str:
    report = manifest.validation
    if report is None:
        return '<section><h2>Validation</h2><p class="empty">Not recorded in this package.</p></section>'
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
    skipped = "".join(f"<li>{_e(s)}</li>" for s in report.skipped) or "<li>none</li>"
    shapes = "; ".join(" ".join(_dims(s) for s in sample) for sample in report.shapes[:20])
    return (
        f"<section><h2>Validation</h2><p>Data: {_e(report.data_source)}, {report.samples} samples at "
        f"precision {_e(report.precision)}; latency ratio {_num(report.latency_ratio)} "
        f"(compiled / eager). Shapes: {_e(shapes) or 'none recorded'}.</p>{outputs}{latency}"
        f"<p>Skipped samples:</p><ul>{skipped}</ul></section>"
    )


def _time_section(manifest: Manifest) -> str:
    stages = manifest.report.stage_seconds or {}
    total = sum(stages.values()) or 1.0
    rows = [[stage, f"{s:.3f}", f"{100 * s / total:.0f}%"] for stage, s in stages.items()]
    table = _table("stage-times", ["stage", "seconds", "share"], rows)
    r = manifest.report
    return (
        f"<section><h2>Where the time went</h2><p>{r.engines_built} engines built, {r.cache_hits} from the "
        f"engine cache, {r.refits} refits.</p>{table}</section>"
    )


def _overview(manifest: Manifest, title: str) -> str:
    validation = manifest.validation
    facts = [
        ("backend", f"{manifest.backend} {manifest.backend_version}"),
        ("engine target", manifest.engine_target),
        ("precision", manifest.precision),
        ("weights stripped", "yes" if manifest.strip_weights else "no"),
        ("partitions", str(len(manifest.report.partitions))),
        ("unique engines", str(len(manifest.engines))),
        ("max rel L2", _num(validation.max_rel_l2) if validation else "not recorded"),
        ("latency ratio", _num(validation.latency_ratio) if validation else "not recorded"),
    ]
    items = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts)
    return f'<h1>{_e(title)}</h1><table class="facts" id="overview">{items}</table>'


def _lineage_section(manifest: Manifest) -> str:
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
        ("signed", "yes" if manifest.signature else "no"),
        ("op modules", ", ".join(manifest.op_modules) or "none"),
    ]
    items = "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in facts)
    files = _table(
        "files",
        ["file", "size", "sha256"],
        [[p, _bytes(f.bytes), f.sha256[:16]] for p, f in manifest.files.items()],
    )
    return f'<section><h2>Lineage</h2><table class="facts" id="lineage">{items}</table>{files}</section>'


# ---------------------------------------------------------------- helpers


def _table(table_id: str, header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    rows = list(rows)
    shown = rows[:MAX_ROWS]
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in shown)
    if not rows:
        body = f'<tr><td colspan="{len(header)}" class="empty">none</td></tr>'
    more = (
        f'<p class="more">… {len(rows) - MAX_ROWS} more rows not shown.</p>' if len(rows) > MAX_ROWS else ""
    )
    return f'<table id="{table_id}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{more}'


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _num(value: Any) -> str:
    if value is None:
        return "not recorded"
    try:
        return f"{float(value):.3g}"
    except (TypeError, ValueError):
        return str(value)


def _bytes(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n >= 1024 else f"{n} B"


def _dims(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) or "scalar"


def _shape_range(spec: Any) -> str:
    if spec.min_shape == spec.max_shape:
        return _dims(spec.max_shape)
    return f"{_dims(spec.min_shape)}..{_dims(spec.max_shape)}"


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
.scroll {{ overflow: auto; border: 1px solid #ddd; }}
.legend span {{ border: 1px solid #444; padding: 1px 6px; margin-right: 6px; font-size: 12px; }}
section {{ margin-top: 1.5em; }}
</style></head>
<body>
{body}
</body></html>
"""
