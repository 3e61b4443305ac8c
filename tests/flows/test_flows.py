"""The Prefect pipeline end to end, against a real ``prefect server`` on 127.0.0.1.

A zoo of three models (one broken) through the ``kiln`` CLI: two packages, one failure with its
message, exit code 1; an immediate re-run builds nothing; bad entries fail before any build; the
Dask task runner on a LocalCluster; a deployment from deploy/prefect.yaml run by a real worker.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml

from tests.fixtures import preloaded

ROOT = Path(__file__).resolve().parents[2]
FAST_VALIDATION = {"samples": 2, "warmup": 1, "runs": 3}


def _write_zoo(path: Path, models: list[dict], **settings: object) -> Path:
    base = {
        "workspace": str(path.parent / "workspace"),
        "engine_cache": str(path.parent / "engine-cache"),
        "tracking": False,
        "validation": FAST_VALIDATION,
    }
    path.write_text(yaml.safe_dump({"settings": {**base, **settings}, "models": models}))
    return path


def _kiln(*args: str, timeout: float = 400) -> subprocess.CompletedProcess:
    return preloaded.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _assert_quiet(stderr: str) -> None:
    """Quiet by default (issue 21): no third-party warning or stack trace without -v; the failed model
    is named on one line of kiln's own."""
    noisy = [line for line in stderr.splitlines() if "Warning" in line or "Traceback" in line]
    assert not noisy, noisy


MLP = {"name": "mlp", "factory": "zoo.models:mlp_with_fallback"}
REPEATED = {"name": "repeated", "factory": "zoo.models:repeated_fallback", "factory_kwargs": {"depth": 3}}
BROKEN = {"name": "broken", "factory": "zoo.models:no_such_model"}


@pytest.fixture(scope="module")
def zoo3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_zoo(tmp_path_factory.mktemp("zoo3") / "zoo.yaml", [MLP, REPEATED, BROKEN])


@pytest.fixture(scope="module")
def first_run(prefect_api, zoo3: Path) -> tuple[subprocess.CompletedProcess, dict]:
    out = zoo3.parent / "out"
    proc = _kiln("zoo", str(zoo3), "--out", str(out), "--json")
    assert proc.stdout, proc.stderr[-4000:]
    return proc, json.loads(proc.stdout)


def test_zoo_with_a_broken_model_gives_two_packages_one_failure_and_exit_1(first_run) -> None:
    import compiler
    from zoo.models import mlp_with_fallback

    proc, summary = first_run
    assert proc.returncode == 1, proc.stderr[-4000:]
    _assert_quiet(proc.stderr)
    rows = {m["name"]: m for m in summary["models"]}
    assert summary["ok"] == 2 and summary["failed"] == 1
    assert rows["broken"]["status"] == "failed"
    assert "models[broken].factory" in rows["broken"]["error"]
    assert "has no 'no_such_model'" in rows["broken"]["error"]
    assert "broken failed" in proc.stderr  # the human summary names it too
    for name in ("mlp", "repeated"):
        row = rows[name]
        assert row["status"] == "ok", row
        assert Path(row["package"]).name == f"{name}.kiln"
        assert row["engines_built"] == row["unique_engines"] > 0
        assert row["max_rel_l2"] < 1e-4
    # repeated_fallback: structurally equal blocks share engines (more partitions than engines).
    assert rows["repeated"]["partitions"] > rows["repeated"]["unique_engines"]
    # A package is usable on its own: load it and compare with the eager model.
    case = mlp_with_fallback()
    loaded = compiler.load(rows["mlp"]["package"])
    x = torch.randn(7, 64)
    torch.testing.assert_close(loaded(x), case.model(x), rtol=1e-4, atol=1e-5)
    manifest = compiler.read_manifest(rows["mlp"]["package"])
    assert manifest.validation.max_rel_l2 == pytest.approx(rows["mlp"]["max_rel_l2"])
    assert json.loads((Path(summary["out_dir"]) / "summary.json").read_text()) == summary


def test_an_immediate_second_run_builds_nothing(prefect_api, first_run, zoo3: Path) -> None:
    out = zoo3.parent / "out"
    proc = _kiln("zoo", str(zoo3), "--out", str(out), "--json")
    assert proc.returncode == 1, proc.stderr[-4000:]  # the broken model is still broken
    summary = json.loads(proc.stdout)
    assert summary["engines_built"] == 0
    _assert_quiet(proc.stderr)
    for row in summary["models"]:
        if row["status"] == "ok":
            assert row["engines_reused"] == row["unique_engines"] > 0
    # The table artifact on the server says the same. (Plain HTTP: Prefect 3.8.8's Artifact.get sends
    # offset=null, which its own server rejects.)
    response = httpx.post(
        f"{prefect_api.api_url}/artifacts/filter",
        json={"artifacts": {"key": {"any_": ["zoo-summary"]}}, "sort": "CREATED_DESC", "limit": 1},
        timeout=30,
    )
    response.raise_for_status()
    data = response.json()[0]["data"]
    table = json.loads(data) if isinstance(data, str) else data
    ok_rows = [r for r in table if r["status"] == "ok"]
    assert {r["model"] for r in ok_rows} == {"mlp", "repeated"}
    assert all(r["built"] == 0 and r["reused"] > 0 for r in ok_rows)
    failed = [r for r in table if r["status"] == "failed"]
    assert [r["model"] for r in failed] == ["broken"] and "no_such_model" in failed[0]["package_or_error"]


def test_engine_builds_carry_a_device_tag_with_a_concurrency_limit(first_run) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName
    from prefect.client.schemas.sorting import TaskRunSort

    with get_client(sync_client=True) as client:
        limit = client.read_global_concurrency_limit_by_name("engine-build:cpu")
        runs = client.read_task_runs(
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(like_="build-engine-")),
            sort=TaskRunSort.EXPECTED_START_TIME_DESC,  # 3.8.8's server rejects the client's default None
            limit=50,
        )
    assert limit.limit == 2  # a leased global limit: a killed build frees its slot
    assert runs and all({"engine-build", "engine-build:cpu"} <= set(r.tags) for r in runs)


def test_kiln_compile_one_model_from_the_zoo(first_run, zoo3: Path) -> None:
    out = zoo3.parent / "out-one"
    proc = _kiln("compile", "mlp", "--zoo", str(zoo3), "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    summary = json.loads(proc.stdout)
    assert summary["models"][0]["package"] == str(out.resolve() / "mlp.kiln")
    assert summary["engines_built"] == 0  # the zoo run built these engines already
    assert (out / "mlp.kiln" / "manifest.json").exists()


def test_a_damaged_staged_package_heals_on_the_next_run(first_run, zoo3: Path) -> None:
    staged = sorted((zoo3.parent / "workspace" / "staged").glob("*.kiln"))
    assert staged
    for package in staged:
        weights = package / "weights.safetensors"
        weights.write_bytes(weights.read_bytes()[:-7])  # truncated: its checksum no longer matches
    out = zoo3.parent / "out-healed"
    proc = _kiln("compile", "mlp", "--zoo", str(zoo3), "--out", str(out), "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout)["engines_built"] == 0  # only the damaged stage ran again
    import compiler

    compiler.read_manifest(out / "mlp.kiln")  # verifies every checksum


def test_a_corrupt_engine_cache_entry_is_named_in_the_summary(first_run, zoo3: Path, tmp_path: Path) -> None:
    for entry in (zoo3.parent / "engine-cache").glob("*.bin"):
        entry.write_bytes(b"not an engine")
    out = tmp_path / "out"
    # A fresh workspace, so the builds consult the engine cache; no -v: the summary alone must say it.
    proc = _kiln("compile", "mlp", "--zoo", str(zoo3), "--out", str(out), "--workspace", str(tmp_path / "ws"))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "warning:" in proc.stderr and "is corrupt" in proc.stderr, proc.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert any("is corrupt" in w for w in summary["warnings"])
    assert summary["engines_built"] == summary["models"][0]["unique_engines"] > 0  # rebuilt, not used


def test_an_entry_is_validated_on_its_recorded_data(first_run, zoo3: Path, tmp_path: Path) -> None:
    import numpy as np

    import compiler

    data = tmp_path / "recorded.npz"
    np.savez(data, x=np.random.default_rng(0).standard_normal((4, 3, 64)).astype("float32"))
    zoo = _write_zoo(
        tmp_path / "zoo.yaml",
        [{**MLP, "validation": {"data": "recorded.npz"}}],  # relative to the zoo file
        workspace=str(zoo3.parent / "workspace"),
        engine_cache=str(zoo3.parent / "engine-cache"),
    )
    proc = _kiln("zoo", str(zoo), "--out", str(tmp_path / "out"), "--json")
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = compiler.read_manifest(tmp_path / "out" / "mlp.kiln").validation
    assert str(data) in report.data_source and report.samples == 4


def test_bad_entries_fail_before_any_engine_is_built(prefect_api, tmp_path: Path) -> None:
    from flows.recompile_zoo import run_zoo

    models = [
        {"name": "bad-backend", "factory": "zoo.models:mlp_with_fallback", "backend": "onnxrt"},
        {
            "name": "bad-range",
            "factory": "zoo.models:mlp_with_fallback",
            "inputs": {"x": {"dims": [{"axis": 0, "name": "batch", "min": 8, "max": 2}]}},
        },
        {"name": "bad-factory", "factory": "zoo.nope:mlp"},
        {"name": "bad-device", "factory": "zoo.models:mlp_with_fallback", "targets": ["cuda:7"]},
        {"name": "bad-input", "factory": "zoo.models:mlp_with_fallback", "inputs": {"y": {"dims": []}}},
    ]
    zoo = _write_zoo(tmp_path / "zoo.yaml", models)
    summary, error = run_zoo(str(zoo), str(tmp_path / "out"))
    assert error is not None and "5 of 5 models failed" in str(error)
    errors = {m["name"]: m["error"] for m in summary["models"]}
    assert "backend" in errors["bad-backend"] and "onnxruntime" in errors["bad-backend"]
    assert "inputs.x.dims" in errors["bad-range"] and "min <= max" in errors["bad-range"]
    assert "cannot import module 'zoo.nope'" in errors["bad-factory"]
    if not torch.cuda.is_available():
        assert "devices: 'cuda:7'" in errors["bad-device"]
    assert "inputs.y: the model has no input 'y'" in errors["bad-input"]
    assert summary["engines_built"] == 0
    engine_cache = tmp_path / "engine-cache"
    assert not engine_cache.exists() or not any(engine_cache.rglob("*.bin"))


def test_dask_task_runner_builds_on_a_local_cluster(prefect_api, tmp_path: Path) -> None:
    from flows.recompile_zoo import run_zoo

    zoo = _write_zoo(
        tmp_path / "zoo.yaml",
        [REPEATED],
        task_runner="dask",
        dask={"n_workers": 2, "threads_per_worker": 1, "processes": False},
    )
    summary, error = run_zoo(str(zoo), str(tmp_path / "out"))
    assert error is None, error
    row = summary["models"][0]
    assert row["status"] == "ok" and row["engines_built"] == row["unique_engines"] > 1
    assert row["build_workers"] and all(w.startswith("dask:") for w in row["build_workers"])


def test_a_deployment_from_prefect_yaml_runs_on_a_worker(
    prefect_api,
    first_run,
    zoo3: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from prefect import get_client
    from prefect.deployments import run_deployment

    from flows.deployments import register

    monkeypatch.setenv("KILN_REPO", str(ROOT))  # prefect.yaml's pull step: where workers find the code
    ids = register(ROOT / "deploy" / "prefect.yaml", ["zoo-nightly-cpu"])
    assert list(ids) == ["recompile-zoo/zoo-nightly-cpu"]
    with get_client(sync_client=True) as client:
        pool = client.read_work_pool("kiln-cpu")  # made by register() since it was missing
        deployment = client.read_deployment_by_name("recompile-zoo/zoo-nightly-cpu")
    assert pool.type == "process"
    assert deployment.work_pool_name == "kiln-cpu"
    assert [s.schedule.cron for s in deployment.schedules] == ["0 3 * * *"]
    assert deployment.pull_steps[0]["prefect.deployments.steps.set_working_directory"]["directory"] == str(
        ROOT
    )

    out = zoo3.parent / "deployed-out"
    mlp_zoo = _write_zoo(zoo3.parent / "mlp-only.yaml", [MLP])  # same workspace: engines are cached
    flow_run = run_deployment(
        "recompile-zoo/zoo-nightly-cpu",
        parameters={"zoo_path": str(mlp_zoo), "out_dir": str(out)},
        timeout=0,
    )
    worker = subprocess.run(
        [sys.executable, "-m", "prefect", "worker", "start", "--pool", "kiln-cpu", "--run-once"],
        cwd=zoo3.parent,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=400,
    )
    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(flow_run.id).state
        while not state.is_final() and time.monotonic() < deadline:
            time.sleep(1)
            state = client.read_flow_run(flow_run.id).state
    assert state.is_completed(), f"{state}\n{worker.stdout[-3000:]}\n{worker.stderr[-3000:]}"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["ok"] == 1 and summary["models"][0]["package"] == str(out / "mlp.kiln")
    assert (out / "mlp.kiln" / "manifest.json").exists()
