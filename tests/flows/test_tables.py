"""The CLI's tables at 80 columns: names whole or cut with an ellipsis, never folded mid-word; no blank
cells (issue 21)."""

from __future__ import annotations

from rich.console import Console

from flows.render import _summary_table
from registry.summary import versions_table

NAMES = ["kiln.mlp-fallback.cpu", "kiln.bert.cpu", "kiln.a-model-name-far-too-long-for-any-column.cuda-sm-90"]


def _render(table) -> list[str]:
    console = Console(width=80, record=True, color_system=None)
    console.print(table)
    return console.export_text().splitlines()


def _first_column(lines: list[str], second_header: str) -> list[str]:
    """The first column's cell text on every body line (below the header's rule), by position."""
    header = next(i for i, line in enumerate(lines) if f" {second_header} " in line)
    rule = next(i for i in range(header + 1, len(lines)) if set(lines[i].strip()) <= set("━┡╇┩─"))
    end = lines[header].index(f" {second_header} ")
    body = []
    for line in lines[rule + 1 :]:
        if not line.strip() or line.startswith("└"):  # the table's end; a caption may follow
            break
        body.append(line[:end].strip(" │┃"))
    return body


def _assert_names_whole_or_ellipsized(lines: list[str], second_header: str, names: list[str]) -> None:
    assert all(len(line) <= 80 for line in lines)
    cells = [c for c in _first_column(lines, second_header) if c]
    assert len(cells) == len(names), f"a name took more than one line: {cells}"
    for cell, name in zip(cells, names, strict=True):
        assert cell == name or (cell.endswith("…") and name.startswith(cell[:-1])), (cell, name)


def test_versions_table_keeps_names_whole_and_says_what_empty_means():
    rows = [
        {
            "name": name,
            "version": "12",
            "aliases": ["champion", "previous"] if i == 1 else [],
            "backend": "onnxruntime",
            "precision": "fp32",
            "dims": "batch 1..8, seq 4..64" if i == 1 else "",
            "rejected": i == 2,
        }
        for i, name in enumerate(NAMES)
    ]
    lines = _render(versions_table(rows))
    _assert_names_whole_or_ellipsized(lines, "┃", NAMES)
    text = "\n".join(lines)
    assert "kiln.mlp-fallback.cpu" in text and "no alias" in text and "unknown" in text and "rejected" in text
    assert "onnxruntime" in text  # the engine column is never cut below its widest word


def test_summary_table_keeps_model_names_whole_and_explains_unmeasured_cells():
    models = [
        {
            "name": name.removeprefix("kiln."),
            "device": "cpu",
            "status": "ok" if i else "failed",
            "partitions": 2,
            "engines_built": 1,
            "engines_reused": 0,
            "max_rel_l2": None if i == 0 else 1e-6,
            "latency_ratio": None if i == 0 else 0.8,
            "seconds": 1.5,
        }
        for i, name in enumerate(NAMES)
    ]
    lines = _render(_summary_table({"ok": 2, "failed": 1, "seconds": 3.0, "models": models}))
    _assert_names_whole_or_ellipsized(lines, "device", [m["name"] for m in models])
    assert any("-: not measured" in line for line in lines)


def test_the_precision_cell_marks_layers_kept_in_fp32_and_the_caption_says_so():
    from compiler.accuracy.mixed import ended_precision, precision_warning

    repair = {
        "searches": [
            {"partition": "engine_0", "passed": True, "raised": [{"name": f"n{i}"} for i in range(56)]}
        ],
        "steps": [],
        "kept": {"precision": "int8", "weights": 0.998, "flops": 1.0},
    }
    ended = ended_precision("int8 x1", repair)
    assert ended == "int8 x1 (56 layers fp32, 99.8% of weights int8)"
    assert "56 layers raised to fp32" in precision_warning(repair, "int8", ended)
    raised_whole = {"searches": [], "steps": [{"partition": "engine_0", "precision_after": "fp32"}]}
    assert precision_warning(raised_whole, "int8", "fp32 x1").startswith("asked for int8, got fp32")
    assert ended_precision("int8 x1", None) == "int8 x1"  # nothing raised: as it was
    common = {"device": "cpu", "status": "ok", "partitions": 1, "engines_built": 1, "engines_reused": 0}
    common |= {"max_rel_l2": 0.07, "latency_ratio": 0.5, "seconds": 1.0}
    models = [
        {**common, "name": "bert", "precision": ended},
        {**common, "name": "mlp", "precision": "int8 x4; fp32: engine_2"},
    ]
    lines = _render(_summary_table({"ok": 2, "failed": 0, "seconds": 2.0, "models": models}))
    assert all(len(line) <= 80 for line in lines)
    bert = next(line for line in lines if line.strip().startswith("bert"))
    mlp = next(line for line in lines if line.strip().startswith("mlp"))
    assert " int8* " in bert and " int8+1 " in mlp, lines
    assert any("*: some layers kept in fp32" in line for line in lines), lines
