"""``kiln report``: one self-contained HTML page per package, checked in a real headless browser.

The browser is Debian's chromium driven by Playwright (dev extra); the tests skip, saying why, where
either is missing. The page loads from a file with no network (its Content-Security-Policy allows no
fetch at all), and what is checked is what a reader sees: the SVG's boxes and edges, the tables' rows.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import compiler
from compiler.errors import PackageCorruptError
from compiler.package.report_page import MAX_DRAWN, MAX_ROWS, render_package_report, render_report
from compiler.validation.report import ValidationReport
from flows.cli import app
from tests.compiler.package.untrusted_probe import _reseal_data

ROOT = Path(__file__).resolve().parents[3]
FORMAT1 = ROOT / "tests" / "fixtures" / "packages" / "mlp-format1-2026-11.kiln"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
BROWSER_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--no-first-run",
]


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (dev extra)")
    if CHROMIUM is None:
        pytest.skip("no chromium binary on PATH (apt-get install chromium; the README's test command does)")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=CHROMIUM, args=BROWSER_ARGS)
        yield launched
        launched.close()


def _open(browser, page_file: Path):
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    page.goto(page_file.as_uri())
    assert requests == [page_file.as_uri()]  # self-contained: nothing else is fetched
    return page


def _render_cli(package: Path, out: Path):
    return CliRunner().invoke(app, ["report", str(package), "--out", str(out)])


@pytest.fixture(scope="module")
def package(compiled_zoo, tmp_path_factory) -> Path:
    """The MLP with a custom op left to PyTorch between two engines."""
    return compiler.save(
        compiled_zoo["mlp_with_fallback"][1], tmp_path_factory.mktemp("report") / "mlp.kiln"
    ).path


def test_cli_report_draws_engines_and_fallback_and_fills_the_tables(browser, package, tmp_path):
    out = tmp_path / "mlp.html"
    result = CliRunner().invoke(app, ["report", str(package), "--out", str(out)])
    assert result.exit_code == 0, result.output
    manifest = compiler.read_manifest(package)
    page = _open(browser, out)
    graph = page.locator("svg#graph")
    assert graph.is_visible() and graph.bounding_box()["width"] > 300
    assert page.locator("svg#graph g.node.input").count() == 1
    assert page.locator("svg#graph g.node.engine").count() == 2
    assert page.locator("svg#graph g.node.torch").count() == 1  # the custom op between the engines
    assert page.locator("svg#graph g.node.output").count() == 1
    assert page.locator("svg#graph line.edge").count() == 4
    fingerprints = [p["fingerprint"] for p in manifest.report.partitions]
    engine_text = page.locator("svg#graph g.node.engine").all_text_contents()
    assert all(any(fp[:12] in text for text in engine_text) for fp in fingerprints)
    assert page.locator("table#partitions tbody tr").count() == 2
    assert page.locator("table#dedup tbody tr").count() == len(manifest.engines) == 2
    assert page.locator("table#input-specs tbody tr").count() == 1
    assert "kiln_zoo.soft_sign_clip.default" in page.inner_text("body")
    assert "factory:zoo.models:mlp_with_fallback" not in page.inner_text("#lineage")  # saved without one
    assert manifest.content_hash in page.inner_text("#lineage")
    shot = page.screenshot(full_page=True)
    assert len(shot) > 20_000  # a rendered page, not a blank one


EDGES = (
    """() => [...document.querySelectorAll('svg#graph line.edge')].map(e => [e.dataset.from, e.dataset.to])"""
)


def test_the_map_draws_the_dataflow_from_inputs_through_engines_and_fallback_to_outputs(
    browser, package, tmp_path
):
    """mlp_with_fallback: x -> engine_0 -> the custom op in PyTorch -> engine_1 -> the output, drawn from
    the split graph the package saved; the same for the package loaded from disk (a load runs from
    runtime_graph.json) and saved again."""
    loaded = compiler.load(package, allowed_modules=["zoo.models"])
    resaved = compiler.save(loaded, tmp_path / "resaved.kiln").path
    assert (resaved / "runtime_graph.json").is_file()
    expected = [
        ("x", "engine_0"),
        ("engine_0", "soft_sign_clip"),
        ("soft_sign_clip", "engine_1"),
        ("engine_1", "output_0"),
    ]
    for name, source in (("saved", package), ("resaved", resaved)):
        out = tmp_path / f"{name}.html"
        result = _render_cli(source, out)
        assert result.exit_code == 0, result.output
        page = _open(browser, out)
        assert sorted(map(tuple, page.evaluate(EDGES))) == sorted(expected), name
        order = [page.locator(f'svg#graph g.node[data-id="{box}"]') for box, _ in expected] + [
            page.locator('svg#graph g.node[data-id="output_0"]')
        ]
        kinds = [box.get_attribute("class") for box in order]
        assert kinds == ["node input", "node engine", "node torch", "node engine", "node output"], name
        assert "kiln_zoo::soft_sign_clip" in order[2].text_content()
        xs = [box.bounding_box()["x"] for box in order]
        assert xs == sorted(xs) and len(set(xs)) == len(xs), name  # drawn left to right in dataflow order
        assert page.locator("#graph-section .partial").count() == 0


def test_a_malformed_split_graph_is_refused_like_load(package, tmp_path):
    """A resealed runtime graph whose first engine takes a value made after it: no page, the file named."""
    bad = tmp_path / "bad.kiln"
    shutil.copytree(package, bad)
    graph = json.loads((bad / "runtime_graph.json").read_text())
    nodes = graph["graph"]["nodes"]
    engine = next(n for n in nodes if n["op"] == "call_module")
    engine["args"]["tuple"][0] = {"node": len(nodes) - 2}
    (bad / "runtime_graph.json").write_text(json.dumps(graph))
    _reseal_data(bad, json.loads((bad / "manifest.json").read_text()))
    out = tmp_path / "never.html"
    result = _render_cli(bad, out)
    assert result.exit_code == 2, result.output
    assert "runtime_graph.json" in result.output and "not an earlier node" in result.output
    assert not out.exists()
    with pytest.raises(PackageCorruptError, match=r"runtime_graph\.json"):
        compiler.load(bad, allowed_modules=["zoo.models"])


def test_format1_package_renders_what_it_has(browser, tmp_path):
    out = tmp_path / "old.html"
    out.write_text(render_package_report(FORMAT1, compiler.read_manifest(FORMAT1), FORMAT1.name))
    page = _open(browser, out)
    assert page.locator("svg#graph g.node.engine").count() == 2
    # No split graph saved: each engine with what feeds it, and the page says the rest is not recorded.
    assert page.locator("svg#graph g.node.output").count() == 0
    assert "not the whole dataflow" in page.inner_text("#graph-section .partial")
    assert page.locator("table#accuracy tbody tr").count() == 1  # format 1 recorded its validation
    lineage = page.inner_text("#lineage")
    assert "not recorded (format 1" in lineage and "1" in lineage


def test_build_failure_and_repair_decisions_are_shown(browser, package, tmp_path):
    manifest = compiler.read_manifest(package)
    failure = {
        "error": "EngineBuildError: no kernel for bf16 Gemm",
        "node": "linear_2",
        "fingerprint": manifest.report.partitions[1]["fingerprint"],
        "backend": "onnxruntime",
        "partitions": ["engine_1"],
        "fell_back_to": "torch",
    }
    step = _repair_step()
    repair = {"steps": [step], "lines": ["engine_0: fp16 -> fp32, its rel L2 5.0e-01 -> 1.0e-06"]}
    report = dataclasses.replace(manifest.report, build_failures=[failure], accuracy_repair=repair)
    out = tmp_path / "failed.html"
    out.write_text(render_report(dataclasses.replace(manifest, report=report), "failed"))
    page = _open(browser, out)
    assert page.locator("svg#graph g.node.failed").count() == 1
    assert "fell back" in page.locator("svg#graph g.node.failed").text_content()
    assert "no kernel for bf16 Gemm" in page.inner_text("table#partitions")
    assert page.locator("table#repair tbody tr").count() == 1
    assert "0.5 → 1e-06" in page.inner_text("table#partitions")


def test_a_plan_too_large_to_draw_is_summarized(browser, package, tmp_path):
    manifest = compiler.read_manifest(package)
    count = 5000
    parts = [dict(manifest.plan["partitions"][0], name=f"engine_{i}") for i in range(count)]
    reported = [dict(manifest.report.partitions[0], name=f"engine_{i}") for i in range(count)]
    huge = dataclasses.replace(
        manifest,
        plan={**manifest.plan, "partitions": parts},
        report=dataclasses.replace(manifest.report, partitions=reported),
    )
    out = tmp_path / "huge.html"
    out.write_text(render_report(huge, "huge"))
    page = _open(browser, out)
    assert page.locator("svg#graph").count() == 0
    assert f"more than {MAX_DRAWN}: not drawn" in page.inner_text(".too-large")
    assert page.locator("table#partitions tbody tr").count() == MAX_ROWS
    assert f"{count - MAX_ROWS} more rows not shown" in page.inner_text("body")


def test_a_damaged_package_is_refused_like_load(package, tmp_path):
    damaged = tmp_path / "damaged.kiln"
    shutil.copytree(package, damaged)
    weights = damaged / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    out = tmp_path / "never.html"
    result = CliRunner().invoke(app, ["report", str(damaged), "--out", str(out)])
    assert result.exit_code == 2
    assert "weights.safetensors" in result.output and not out.exists()
    with pytest.raises(compiler.errors.PackageCorruptError):
        compiler.load(damaged)


# ---------------------------------------------------------------- an untrusted package's text (N17, N19)

MARKUP = "<form action=https://evil.example><input name=x></form><img src=x onerror=alert(1)>"
# What a page may hold of its own: the tags and attribute names of every element, in document order.
DOM_SHAPE = """() => [...document.querySelectorAll('*')].map(
    e => [e.tagName.toLowerCase(), ...[...e.attributes].map(a => a.name).sort()].join(' '))"""
_FORMAT1_VALIDATION = json.loads((FORMAT1 / "manifest.json").read_text())["validation"]  # a template
INJECTED = "form, input, img, iframe, object, embed, a, script, [onerror], [action], [href], [src]"


def _tampered(package: Path, dest: Path, edit: Callable[[dict], Any]) -> Path:
    """A copy of ``package`` whose manifest ``edit`` changed, resealed as an attacker with write access
    and no signing key would (checksums and content hash recomputed)."""
    shutil.copytree(package, dest)
    data = json.loads((dest / "manifest.json").read_text())
    edit(data)
    _reseal_data(dest, data)
    return dest


WRONG_TYPES = [
    (("report", "engines_built"), MARKUP, "manifest.report.engines_built must be an integer"),
    (("report", "refits"), [1], "manifest.report.refits must be an integer"),
    (
        ("report", "stage_seconds"),
        {"build": "1.5"},
        "manifest.report.stage_seconds['build'] must be a number",
    ),
    (
        ("report", "partitions", 0, "name"),
        ["engine_0"],
        "manifest.report.partitions[0].name must be a string",
    ),
    (("validation", "samples"), MARKUP, "manifest.validation.samples must be an integer"),
    (("strip_weights",), "false", "manifest.strip_weights must be true or false"),
    (("kiln_version",), {"v": 1}, "manifest.kiln_version must be a string"),
]


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    WRONG_TYPES,
    ids=[".".join(map(str, case[0])) for case in WRONG_TYPES],
)
def test_a_field_of_the_wrong_type_is_refused_at_read_naming_it(package, tmp_path, field, value, expected):
    def valid(data: dict) -> None:
        data["validation"] = copy.deepcopy(_FORMAT1_VALIDATION)

    compiler.read_manifest(_tampered(package, tmp_path / "good.kiln", valid))  # the control: it reads

    def edit(data: dict) -> None:
        valid(data)
        parent = data
        for key in field[:-1]:
            parent = parent[key]
        parent[field[-1]] = value

    bad = _tampered(package, tmp_path / "bad.kiln", edit)
    with pytest.raises(PackageCorruptError, match=re.escape(expected)):
        compiler.read_manifest(bad)


def test_numbers_holding_markup_are_refused_by_report_and_recording(package, tmp_path):
    from registry.tracking import record_package

    def edit(data: dict) -> None:
        data["validation"] = {**copy.deepcopy(_FORMAT1_VALIDATION), "samples": MARKUP}
        for name in ("engines_built", "cache_hits", "refits"):
            data["report"][name] = MARKUP

    bad = _tampered(package, tmp_path / "bad.kiln", edit)
    out = tmp_path / "never.html"
    result = _render_cli(bad, out)
    assert result.exit_code == 2, result.output
    assert "PackageCorruptError" in result.output and "report.engines_built" in result.output
    assert not out.exists()
    # Recording it: the typed refusal, before MLflow is asked anything (N19: it was a raw ValueError).
    with pytest.raises(PackageCorruptError, match=r"report\.engines_built must be an integer") as raised:
        record_package(bad, "mlp", tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert not isinstance(raised.value, ValueError)
    assert not (tmp_path / "mlflow.db").exists()


def test_every_interpolation_is_escaped_even_past_the_typed_read(browser, package, tmp_path):
    """The page escapes what it is handed, whatever its type: a manifest made in memory (never read
    from disk) with markup where numbers go."""
    manifest = compiler.read_manifest(package)
    validation = dataclasses.replace(ValidationReport.from_dict(_FORMAT1_VALIDATION), samples=MARKUP)
    report = dataclasses.replace(manifest.report, engines_built=MARKUP, cache_hits=MARKUP, refits=MARKUP)
    hostile = dataclasses.replace(manifest, report=report, validation=validation)
    out = tmp_path / "hostile.html"
    out.write_text(render_report(hostile, MARKUP))
    page = _open(browser, out)
    assert page.locator(INJECTED).count() == 0
    assert page.inner_text("body").count(MARKUP) >= 5  # title, samples and the three counts, as text


def _markup_everywhere(data: Any, text: Callable[[str], str]) -> Any:
    """``data`` (a manifest) with every string a reader takes as free text replaced by ``text(s)``: values,
    and the keys of the maps among its fields. What must keep its form to pass the checks every
    read makes (paths and checksums, fingerprints, dtypes, op-module names, axis numbers, the kind of
    a partition input) stays; so do the fields' own names."""
    maps = {"fallback_ops", "stage_seconds", "ops", "unique", "weights", "partition_precision", "extras"}
    keep = {"files", "op_modules", "content_hash", "dtype", "file", "kind", "format_version"}

    def walk(value: Any, key: str | None) -> Any:
        if key in keep:
            return value
        if isinstance(value, str):
            return text(value)
        if isinstance(value, list):
            return [walk(v, key) for v in value]
        if isinstance(value, dict):
            if key == "engines":  # fingerprint -> record
                return {fp: walk(record, None) for fp, record in value.items()}
            if key == "dynamic_dims":  # axis -> name
                return {axis: walk(name, None) for axis, name in value.items()}
            if key in maps:
                return {text(k): walk(v, None) for k, v in value.items()}
            return {k: walk(v, k) for k, v in value.items()}
        return value

    return walk(data, None)


def _graph_markup(graph: dict, text: Callable[[str], str]) -> dict:
    """A runtime graph with its node names, call targets and weight keys replaced by ``text(s)``."""

    def nodes(module: dict) -> dict:
        return {
            "nodes": [
                {**n, **{k: text(n[k]) for k in ("name", "target") if isinstance(n.get(k), str)}}
                for n in module["nodes"]
            ],
            "submodules": {text(name): nodes(sub) for name, sub in module["submodules"].items()},
        }

    inputs = [None if key is None else text(key) for key in graph["inputs"]]
    return {**graph, "graph": nodes(graph["graph"]), "inputs": inputs}


def _staged_everywhere(package: Path, dest: Path, text: Callable[[str], str]) -> Path:
    """``package`` with a build failure, a repair, a validation and a source recorded, then every
    free-text string of its manifest and runtime graph replaced by ``text(s)``, resealed."""
    shutil.copytree(package, dest)
    data = json.loads((dest / "manifest.json").read_text())
    failure = {
        "error": "EngineBuildError: no kernel",
        "node": "linear_2",
        "partition": "engine_1",
        "fingerprint": data["report"]["partitions"][1]["fingerprint"],
        "backend": "onnxruntime",
        "fell_back_to": "torch",
        "partitions": ["engine_1"],
    }
    step = _repair_step()
    data["report"].update(
        build_failures=[failure], accuracy_repair={"steps": [step], "lines": ["engine_0: fp16 -> fp32"]}
    )
    data["plan"]["options"]["partition_precision"] = {"engine_0": "fp32"}
    data["validation"] = {**copy.deepcopy(_FORMAT1_VALIDATION), "skipped": ["sample 3: too long"]}
    data["validation"]["data_source"] = "val.npz sha256:" + "c" * 64
    data["source"] = {"uri": "factory:zoo.models:mlp", "kind": "factory", "version": "1", "identity": "d"}
    memo: dict[str, str] = {}

    def once(value: str) -> str:  # one string, one replacement: names still match across records
        return memo.setdefault(value, text(value) + f"#{len(memo)}")

    graph = dest / "runtime_graph.json"
    graph.write_text(json.dumps(_graph_markup(json.loads(graph.read_text()), once)))
    _reseal_data(dest, _markup_everywhere(data, once))
    return dest


def test_markup_in_every_string_of_an_untrusted_package_shows_as_text(browser, package, tmp_path):
    """Every string field of a resealed package holds markup; ``kiln report`` renders it, and the page's
    DOM is the one the same package with plain strings gives (no element or attribute of the package's
    making), with the markup shown as text."""
    pages = {}
    for name, text in (("plain", lambda s: "plain text"), ("hostile", lambda s: MARKUP)):
        staged = _staged_everywhere(package, tmp_path / f"{name}.kiln", text)
        out = tmp_path / f"{name}.html"
        result = _render_cli(staged, out)
        assert result.exit_code == 0, result.output
        pages[name] = _open(browser, out)
    plain, hostile = pages["plain"], pages["hostile"]
    assert hostile.locator(INJECTED).count() == 0
    assert hostile.evaluate(DOM_SHAPE) == plain.evaluate(DOM_SHAPE)
    assert hostile.locator("svg#graph g.node").count() >= 4  # the map was drawn, from marked-up names
    body = hostile.inner_text("body")
    assert body.count(MARKUP) >= 20
    for section in ("#overview", "#lineage", "table#partitions", "table#repair", "table#accuracy"):
        assert MARKUP in hostile.inner_text(section), section


def _repair_step() -> dict:
    """One accuracy-repair step as a report records it (engine_0 raised fp16 -> fp32)."""
    return {
        "round": 1,
        "partition": "engine_0",
        "precision_before": "fp16",
        "precision_after": "fp32",
        "fingerprint_before": "a" * 64,
        "fingerprint_after": "b" * 64,
        "rel_l2_before": 0.5,
        "rel_l2_after": 1e-6,
    }
