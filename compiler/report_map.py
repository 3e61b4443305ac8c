"""The report's partition map as inline SVG (``kiln report``), built from the partition plan.

Model inputs, partitions and the PyTorch nodes feeding them, laid out in layers (longest path), with
an edge wherever a partition's activation input is produced by another box. A plan too large to draw
(``MAX_DRAWN`` boxes) is summarized in words; layout is linear in the plan's size. Every value is
escaped (:func:`compiler.report_html.h`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from compiler.manifest import Manifest
from compiler.report_html import Markup, h, join

MAX_DRAWN = 160  # boxes; beyond, the graph is summarized (an SVG that large reads as noise anyway)
TORCH = "torch"

COLORS = {
    "engine": "#d8f0dc",
    "torch": "#eeeeee",
    "failed": "#fde2c8",
    "input": "#dde8f8",
}


@dataclass
class Box:
    """One drawn node: a model input, an engine partition or a PyTorch node."""

    id: str
    kind: str  # "input" | "engine" | "torch" | "failed" (a partition that fell back after its build failed)
    lines: list[str]
    inputs: list[str] = field(default_factory=list)  # ids of the boxes feeding it
    layer: int = 0
    row: int = 0


# ---------------------------------------------------------------- boxes


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


def map_boxes(manifest: Manifest) -> list[Box]:
    """The boxes of the map, laid out in layers (longest path)."""
    boxes = _plan_boxes(manifest)
    _layout(boxes)
    return list(boxes.values())


class _Engines:
    """Builds engine boxes: why each partition fell back, and its row of the compile report."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.reasons = fell_back(manifest)
        self.rows = {p.get("name"): p for p in manifest.report.partitions}

    def box(self, name: str, box_id: str) -> Box:
        manifest, reasons = self.manifest, self.reasons
        info = self.rows.get(name, {})
        fingerprint = str(info.get("fingerprint", ""))
        backend = str(info.get("backend") or manifest.backend)
        lines = [name, f"{backend} · {partition_precision(manifest, name)}", f"fp {fingerprint[:12]}"]
        if name in reasons:
            lines.append("fell back: " + reasons[name][:60])
        return Box(box_id, "failed" if name in reasons else "engine", lines)


def _input_lines(manifest: Manifest, name: str, position: int) -> list[str]:
    specs = {s.name: s for s in manifest.input_specs}
    spec = specs.get(name) or (
        manifest.input_specs[position] if position < len(manifest.input_specs) else None
    )
    return [name, f"{spec.dtype} {_shape_range(spec)}"] if spec is not None else [name, "model input"]


def _plan_boxes(manifest: Manifest) -> dict[str, Box]:
    """Inputs, partitions and the PyTorch nodes feeding them."""
    engines = _Engines(manifest)
    boxes: dict[str, Box] = {}
    for position, spec in enumerate(manifest.input_specs):
        boxes[spec.name] = Box(spec.name, "input", _input_lines(manifest, spec.name, position))
    producer: dict[str, str] = {}  # fx node name -> partition
    partitions = list(manifest.plan.get("partitions") or [])
    for part in partitions:
        for node in part.get("nodes") or []:
            producer[str(node)] = part["name"]
    for part in partitions:
        name = part["name"]
        box = engines.box(name, name)
        for item in part.get("inputs") or []:
            if item.get("kind") != "activation":
                continue
            node = str(item.get("node"))
            source = producer.get(node)
            if source is None and node not in boxes:
                boxes[node] = Box(node, "torch", [node, "PyTorch"])
            box.inputs.append(source or node)
        boxes[name] = box
    return boxes


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


# ---------------------------------------------------------------- drawing


def graph_svg(boxes: Sequence[Box]) -> Markup:
    width, height, gap_x, gap_y = 210, 74, 50, 18
    by_id = {b.id: b for b in boxes}
    cols = 1 + max((b.layer for b in boxes), default=0)
    rows = 1 + max((b.row for b in boxes), default=0)
    total_w, total_h = cols * (width + gap_x) + gap_x, rows * (height + gap_y) + gap_y

    def corner(box: Box) -> tuple[int, int]:
        return gap_x + box.layer * (width + gap_x), gap_y + box.row * (height + gap_y)

    parts = [
        h(
            '<svg xmlns="http://www.w3.org/2000/svg" id="graph" width="{w}" height="{h}" '
            'viewBox="0 0 {w} {h}" role="img" aria-label="partitioned graph">',
            w=total_w,
            h=total_h,
        ),
        h(
            '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="7" '
            'markerHeight="7" orient="auto"><path d="M0,0 L10,5 L0,10 z" fill="#555"/></marker></defs>'
        ),
    ]
    for box in boxes:
        x, y = corner(box)
        for source in box.inputs:
            if source in by_id:
                sx, sy = corner(by_id[source])
                parts.append(
                    h(
                        '<line class="edge" x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="#555" '
                        'marker-end="url(#arrow)"/>',
                        x1=sx + width,
                        y1=sy + height // 2,
                        x2=x,
                        y2=y + height // 2,
                    )
                )
    for box in boxes:
        x, y = corner(box)
        parts.append(
            h(
                '<g class="node {kind}" data-id="{id}"><title>{title}</title><rect x="{x}" y="{y}" '
                'width="{w}" height="{h}" rx="6" fill="{fill}" stroke="#444"/>',
                kind=box.kind,
                id=box.id,
                title=" | ".join(box.lines),
                x=x,
                y=y,
                w=width,
                h=height,
                fill=COLORS[box.kind],
            )
        )
        for i, line in enumerate(box.lines[:4]):
            text = line if len(line) <= 30 else line[:29] + "…"
            bold = ' font-weight="bold"' if i == 0 else ""
            parts.append(
                h(
                    '<text x="{x}" y="{y}" font-size="12"' + bold + ">{text}</text>",
                    x=x + 8,
                    y=y + 17 + 16 * i,
                    text=text,
                )
            )
        parts.append(h("</g>"))
    parts.append(h("</svg>"))
    return join(parts)


def map_section(manifest: Manifest) -> Markup:
    """The "Partitioned graph" section: a sentence of counts, the map (or why not) and its legend."""
    boxes = map_boxes(manifest)
    count = {kind: sum(b.kind == kind for b in boxes) for kind in COLORS}
    summary = (
        f"{count['engine']} engine partitions, {count['failed']} fell back after a failed build, "
        f"{count['torch']} PyTorch nodes feeding them, {count['input']} inputs"
    )
    if len(boxes) > MAX_DRAWN:
        drawing = h(
            '<p class="too-large">The graph has {n} boxes, more than {max}: not drawn. '
            "The partition table below lists every partition.</p>",
            n=len(boxes),
            max=MAX_DRAWN,
        )
    else:
        drawing = h('<div class="scroll">{svg}</div>{legend}', svg=graph_svg(boxes), legend=_legend())
    return h(
        '<section id="graph-section"><h2>Partitioned graph</h2><p>{summary}</p>{drawing}</section>',
        summary=summary,
        drawing=drawing,
    )


def _legend() -> Markup:
    items = [
        ("engine", "engine"),
        ("failed", "fell back after a failed build"),
        ("torch", "PyTorch"),
        ("input", "model input"),
    ]
    spans = [h('<span style="background:{color}">{text}</span>', color=COLORS[k], text=t) for k, t in items]
    return h('<p class="legend">{spans}</p>', spans=join(spans, " "))


def _shape_range(spec: Any) -> str:
    if spec.min_shape == spec.max_shape:
        return dims(spec.max_shape)
    return f"{dims(spec.min_shape)}..{dims(spec.max_shape)}"


def dims(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) or "scalar"
