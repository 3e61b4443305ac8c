"""The report's partition map: the model's whole dataflow as inline SVG (``kiln report``).

Model inputs, then the engines and the PyTorch nodes between them in the order the model runs them,
then the model's outputs, with an edge wherever a value flows: input -> engine_0 -> a fallback op ->
engine_1 -> output. It is drawn from the split graph the package saved (``runtime_graph.json``, what a
load runs, see :mod:`compiler.partitioning.runtime_graph`), read here as plain data by
:func:`read_split_graph`:
the file is checked against its manifest checksum first, nothing is imported or built, and only the
top level is used (each engine's call, each PyTorch node, the values passed between them). The
indexing that unpacks an engine's results (``operator.getitem``) is drawn as the engine's own edge;
weights are not drawn.

A package without a runtime graph (format 1, or a graph the runtime form does not hold) has only its
partition plan: the map then shows each engine with the inputs and PyTorch nodes feeding it, and says
that the rest of the dataflow is not recorded. A map too large to draw (``MAX_DRAWN`` boxes) is
summarized in words; layout is linear in the graph's size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiler import json_reader
from compiler.errors import PackageCorruptError, PackageJsonError
from compiler.package.manifest import RUNTIME_GRAPH, Manifest
from compiler.package.report_html import Markup, h, join
from compiler.typed_json import ListOf, OneOf, Opt, Record

MAX_DRAWN = 160  # boxes; beyond, the graph is summarized (an SVG that large reads as noise anyway)
TORCH = "torch"
GETITEM = "operator.getitem"  # runtime_ops' name for indexing a tuple of results

COLORS = {
    "engine": "#d8f0dc",
    "torch": "#eeeeee",
    "failed": "#fde2c8",
    "input": "#dde8f8",
    "output": "#f3e3f7",
}


@dataclass
class Box:
    """One drawn node: a model input or output, an engine partition or a PyTorch node."""

    id: str
    kind: str  # "input" | "engine" | "torch" | "failed" (fell back after its build failed) | "output"
    lines: list[str]
    inputs: list[str] = field(default_factory=list)  # ids of the boxes feeding it
    layer: int = 0
    row: int = 0


@dataclass(frozen=True)
class FlowNode:
    """A node of the split graph's top level, as data."""

    name: str
    op: str  # "placeholder" | "call_function" | "call_module"
    target: str  # the op, or the partition a call_module runs ("" for a placeholder)
    weight: bool  # a placeholder fed a weight (not drawn)
    sources: tuple[int, ...]  # the earlier nodes whose values it takes, each once, in order


@dataclass(frozen=True)
class SplitGraph:
    """The dataflow of a package's split graph: its nodes, and which node makes each user output."""

    nodes: tuple[FlowNode, ...]
    outputs: tuple[int | None, ...]  # None: an output that is a constant


_NODE = Record(
    {
        "op": OneOf(("placeholder", "call_function", "call_module", "output")),
        "name": str,
        "target": str,
    },
    required=frozenset({"op", "name"}),
)
_GRAPH = Record(
    {
        "graph": Record({"nodes": ListOf(_NODE)}, required=frozenset({"nodes"})),
        "inputs": ListOf(Opt(str)),
        "user_outputs": ListOf(int),
    },
    required=frozenset({"graph", "inputs", "user_outputs"}),
)


def read_split_graph(path: str | Path, manifest: Manifest) -> SplitGraph | None:
    """The dataflow of the package at ``path`` (its manifest already read), or None where it saved no
    runtime graph. The file must match its checksum; malformed data is a PackageCorruptError."""
    from compiler.package.check import read_verified

    if RUNTIME_GRAPH not in manifest.files:
        return None
    return parse_split_graph(read_verified(Path(path), RUNTIME_GRAPH, manifest), f"{path}: {RUNTIME_GRAPH}")


_MISSING = object()


def parse_split_graph(data: bytes, where: str) -> SplitGraph:
    """:func:`compiler.partitioning.runtime_graph.encode`'s bytes as a :class:`SplitGraph` (no torch)."""
    raw = json_reader.loads(data, where, schema=_GRAPH, error=PackageJsonError)
    entries = raw["graph"]["nodes"]
    inputs = iter(raw["inputs"])
    nodes: list[FlowNode] = []
    output = None
    for index, entry in enumerate(entries):
        op, name = entry["op"], entry["name"]
        sources = _references(entry.get("args"), entry.get("kwargs"), index, f"{where}: node {index}")
        if op == "output":
            if index != len(entries) - 1:
                raise PackageCorruptError(f"{where}: the output node is not the last node")
            output = entry.get("args")
            break
        if op != "placeholder" and not isinstance(entry.get("target"), str):
            raise PackageCorruptError(f"{where}: node {index} ({op}) names no target")
        weight = False
        if op == "placeholder":  # fed the next input of the call signature: a weight key, or null
            key = next(inputs, _MISSING)
            if key is _MISSING:
                raise PackageCorruptError(f"{where}: more placeholders than the signature's inputs")
            weight = key is not None
        nodes.append(FlowNode(name, op, entry.get("target", ""), weight, sources))
    if output is None or next(inputs, _MISSING) is not _MISSING:
        raise PackageCorruptError(f"{where}: no output node, or fewer placeholders than inputs")
    values = _output_values(output, len(nodes), where)
    if any(not 0 <= i < len(values) for i in raw["user_outputs"]):
        raise PackageCorruptError(f"{where}: user_outputs index past the graph's {len(values)} outputs")
    return SplitGraph(tuple(nodes), tuple(values[i] for i in raw["user_outputs"]))


def _references(args: Any, kwargs: Any, index: int, where: str) -> tuple[int, ...]:
    """The node indices an entry's arguments name (``{"node": i}``), each once, in order; each must be
    an earlier node. Walked with a stack: nesting depth is the file's."""
    found: dict[int, None] = {}
    stack = [kwargs, args]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            ref = value.get("node") if len(value) == 1 else None
            if ref is not None:
                if isinstance(ref, bool) or not isinstance(ref, int) or not 0 <= ref < index:
                    raise PackageCorruptError(f"{where} names node {ref!r:.40}, not an earlier node")
                found.setdefault(ref)
                continue
            stack.extend(reversed(list(value.values())))
        elif isinstance(value, list):
            stack.extend(reversed(value))
    return tuple(found)


def _output_values(args: Any, count: int, where: str) -> list[int | None]:
    """The node making each of the graph's outputs: ``args`` is ``(values,)``, values a tuple or list."""
    inner = args.get("tuple") if isinstance(args, dict) else None
    value = inner[0] if isinstance(inner, list) and len(inner) == 1 else None
    items = next(iter(value.values()), None) if isinstance(value, dict) and len(value) == 1 else None
    if not isinstance(items, list):
        raise PackageCorruptError(f"{where}: the output node returns no tuple of values")
    values: list[int | None] = []
    for item in items:
        ref = item.get("node") if isinstance(item, dict) and len(item) == 1 else None
        if ref is not None and (isinstance(ref, bool) or not isinstance(ref, int) or not 0 <= ref < count):
            raise PackageCorruptError(f"{where}: an output names node {ref!r:.40}, not a node of the graph")
        values.append(ref)
    return values


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


def map_boxes(manifest: Manifest, split: SplitGraph | None) -> list[Box]:
    """The boxes of the map, laid out in layers (longest path): the whole dataflow from ``split``, or
    without one what the partition plan records."""
    boxes = _flow_boxes(manifest, split) if split is not None else _plan_boxes(manifest)
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
    """A model input's name and its spec: the spec of that name, else the one at its position."""
    spec = next((s for s in manifest.input_specs if s.name == name), None)
    if spec is None and position < len(manifest.input_specs):
        spec = manifest.input_specs[position]
    return [name, f"{spec.dtype} {_shape_range(spec)}"] if spec is not None else [name, "model input"]


def _flow_boxes(manifest: Manifest, split: SplitGraph) -> dict[str, Box]:
    engines = _Engines(manifest)
    boxes: dict[str, Box] = {}
    drawn: dict[int, str] = {}  # node index -> the box that shows its value
    users = 0
    for index, node in enumerate(split.nodes):
        if node.op == "placeholder" and node.weight:
            continue
        if node.op == "call_function" and node.target == GETITEM and node.sources:
            if node.sources[0] in drawn:  # a result of an engine (or op): that box's own edge
                drawn[index] = drawn[node.sources[0]]
            continue
        box_id = _unique(node.name, boxes)
        if node.op == "placeholder":
            box = Box(box_id, "input", _input_lines(manifest, node.name, users))
            users += 1
        elif node.op == "call_module":
            box = engines.box(node.target, box_id)
        else:
            box = Box(box_id, "torch", [node.name, node.target, "PyTorch"])
        box.inputs = list(dict.fromkeys(drawn[s] for s in node.sources if s in drawn))
        boxes[box_id], drawn[index] = box, box_id
    for position, source in enumerate(split.outputs):
        box_id = _unique(f"output_{position}", boxes)
        feeders = [drawn[source]] if source in drawn else []
        boxes[box_id] = Box(box_id, "output", [f"output {position}", "model output"], feeders)
    return boxes


def _plan_boxes(manifest: Manifest) -> dict[str, Box]:
    """Inputs, partitions and the PyTorch nodes feeding them (the plan records no more)."""
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


def _unique(name: str, taken: dict[str, Box]) -> str:
    box_id, n = name, 1
    while box_id in taken:
        box_id, n = f"{name}_{n}", n + 1
    return box_id


def _layout(boxes: dict[str, Box]) -> None:
    """Layer = longest path from a source (inputs come first in dict order; a cycle cannot occur in a
    graph, but a malformed plan is cut rather than looped on); row = order within the layer."""
    done: dict[str, int] = {}
    for box_id in boxes:
        stack = [(box_id, 0)]
        while stack:  # iterative DFS: a deep graph must not hit the recursion limit
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
                        '<line class="edge" data-from="{src}" data-to="{dst}" x1="{x1}" y1="{y1}" '
                        'x2="{x2}" y2="{y2}" stroke="#555" marker-end="url(#arrow)"/>',
                        src=source,
                        dst=box.id,
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


def map_section(manifest: Manifest, split: SplitGraph | None) -> Markup:
    """The "Partitioned graph" section: a sentence of counts, the map (or why not) and its legend."""
    boxes = map_boxes(manifest, split)
    count = {kind: sum(b.kind == kind for b in boxes) for kind in COLORS}
    where = "between and around them" if split is not None else "feeding them"
    summary = (
        f"{count['engine']} engine partitions, {count['failed']} fell back after a failed build, "
        f"{count['torch']} PyTorch nodes {where}, {count['input']} inputs"
        + (f", {count['output']} outputs" if split is not None else "")
    )
    note = (
        h("")
        if split is not None
        else h(
            '<p class="partial">This package saved no split graph ({file}): the map shows each engine '
            "with what feeds it, not the whole dataflow to the outputs.</p>",
            file=RUNTIME_GRAPH,
        )
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
        '<section id="graph-section"><h2>Partitioned graph</h2><p>{summary}</p>{note}{drawing}</section>',
        summary=summary,
        note=note,
        drawing=drawing,
    )


def _legend() -> Markup:
    items = [
        ("input", "model input"),
        ("engine", "engine"),
        ("failed", "fell back after a failed build"),
        ("torch", "PyTorch"),
        ("output", "model output"),
    ]
    spans = [h('<span style="background:{color}">{text}</span>', color=COLORS[k], text=t) for k, t in items]
    return h('<p class="legend">{spans}</p>', spans=join(spans, " "))


def _shape_range(spec: Any) -> str:
    if spec.min_shape == spec.max_shape:
        return dims(spec.max_shape)
    return f"{dims(spec.min_shape)}..{dims(spec.max_shape)}"


def dims(shape: Sequence[int]) -> str:
    return "x".join(str(d) for d in shape) or "scalar"
