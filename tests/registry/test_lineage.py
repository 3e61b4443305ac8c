"""Lineage in the registry (issue 12.3) and validation data as a run input (issue 13.2).

Against a real `mlflow server` (tests/fixtures/mlflow_server.py) holding a real source model
``fraud-src`` (versions 1..3, alias ``production`` -> 3, each from a real run). One small classifier
is compiled once and saved with different sources (each a different content hash, so a different
version of ``kiln.fraud.cpu``):

* ``other``: ``hf:`` source (random validation): never matches an MLflow source;
* ``stale``: ``models:/fraud-src@production`` when the alias named version 2;
* ``pinned``: ``models:/fraud-src/3`` (and an accuracy repair record);
* ``prod``: ``models:/fraud-src@production`` at version 3, validated on recorded data.

The tests run in file order and share the registry state; a test that moves the alias restores it.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.export import Dim

import compiler
from compiler.accuracy.repair import ModelAccuracy, RepairRecord, RepairStep
from registry.errors import NoMatchingVersionError
from registry.models import registered_model_name
from tests.fixtures import preloaded

SOURCE_MODEL = "fraud-src"
PROD = f"models:/{SOURCE_MODEL}@production"
NAME = registered_model_name("fraud", "cpu")


def _classifier() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)).eval()


@pytest.fixture(scope="module")
def source_model(mlflow_server) -> dict:
    """A real registered source model: versions 1..3 of fraud-src, alias production -> 3."""
    import mlflow

    client = mlflow.MlflowClient(mlflow_server.uri)
    experiment = client.create_experiment("lineage-source-training")
    client.create_registered_model(SOURCE_MODEL)
    runs = {}
    for number in ("1", "2", "3"):
        run = client.create_run(experiment, tags={"mlflow.runName": f"train-{number}"})
        client.set_terminated(run.info.run_id)
        version = client.create_model_version(
            SOURCE_MODEL, f"runs:/{run.info.run_id}/model", run_id=run.info.run_id
        )
        assert version.version == number
        runs[number] = run.info.run_id
    client.set_registered_model_alias(SOURCE_MODEL, "production", "3")
    return {"runs": runs, "client": client}


def _mlflow_source(uri: str, version: str, runs: dict) -> compiler.SourceRecord:
    return compiler.SourceRecord(
        uri=uri, kind="mlflow", version=version, identity=f"id-{version}", run_id=runs[version]
    )


def _repair_record() -> dict:
    """What compiler.repair records after raising one partition (the types it writes, as data)."""
    step = RepairStep(1, "engine_1", "fp16", "fp32", "a" * 16, "b" * 16, 3.1e-2, 2.0e-7)
    before = ModelAccuracy(3.0e-2, 0.99, 0.91, ("accuracy: max relative L2 3.0e-02 > tolerance 2.0e-02",))
    after = ModelAccuracy(2.0e-7, 1.0, 1.0, ())
    record = RepairRecord(
        steps=(step,),
        before=before,
        after=after,
        partition_precision={"engine_0": "fp16", "engine_1": "fp32"},
        rounds=1,
        engines_built=1,
        engines_from_cache=0,
        build_seconds=0.5,
        seconds=1.25,
        data_source="random",
    )
    return record.to_dict()


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory, source_model) -> dict:
    out = tmp_path_factory.mktemp("lineage-packages")
    model = _classifier()
    program = compiler.export(
        model, (torch.randn(4, 16),), dynamic_shapes=({0: Dim("batch", min=1, max=32)},)
    )
    compiled = compiler.compile(program)
    generator = np.random.default_rng(0)
    data = out / "fraud_val.npz"
    name = compiled.input_specs[0].name
    # Group b4 fits the compiled batch range (1..32); group b40 does not and is skipped, not clipped.
    np.savez(
        data,
        **{
            f"b4/{name}": generator.standard_normal((3, 4, 16)).astype(np.float32),
            f"b40/{name}": generator.standard_normal((2, 40, 16)).astype(np.float32),
        },
    )
    random_report = compiler.validate(model, compiled, samples=2, warmup=1, runs=3)
    data_report = compiler.validate(model, compiled, data=data, warmup=1, runs=3)
    runs = source_model["runs"]
    paths = {}
    paths["other"] = compiler.save(
        compiled,
        out / "other.kiln",
        validation=random_report,
        source=compiler.SourceRecord(
            uri="hf:/models/fraud-bert", kind="hf", version="rev1", identity="hf-id"
        ),
    ).path
    paths["stale"] = compiler.save(
        compiled, out / "stale.kiln", validation=random_report, source=_mlflow_source(PROD, "2", runs)
    ).path
    compiled.report.accuracy_repair = _repair_record()
    try:
        paths["pinned"] = compiler.save(
            compiled,
            out / "pinned.kiln",
            validation=random_report,
            source=_mlflow_source(f"models:/{SOURCE_MODEL}/3", "3", runs),
        ).path
    finally:
        compiled.report.accuracy_repair = None
    paths["prod"] = compiler.save(
        compiled, out / "prod.kiln", validation=data_report, source=_mlflow_source(PROD, "3", runs)
    ).path
    return {"paths": paths, "data": data, "model": model}


@pytest.fixture(scope="module")
def recorded(mlflow_server, packages) -> dict:
    """Each package recorded in turn: other v1, stale v2, pinned v3, prod v4."""
    from registry.tracking import record_package

    results = {key: record_package(path, "fraud") for key, path in packages["paths"].items()}
    assert [results[k].version for k in ("other", "stale", "pinned", "prod")] == ["1", "2", "3", "4"]
    return results


def test_version_and_run_carry_the_source_and_link_to_it(mlflow_server, source_model, recorded, tmp_path):
    client = source_model["client"]
    source_run = source_model["runs"]["3"]
    prod = recorded["prod"]
    version = client.get_model_version(NAME, prod.version)
    run_tags = client.get_run(prod.run_id).data.tags
    expected = {
        "kiln.source.uri": PROD,
        "kiln.source.kind": "mlflow",
        "kiln.source.version": "3",
        "kiln.source.identity": "id-3",
        "kiln.source.run_id": source_run,
    }
    for tags in (version.tags, run_tags):
        assert {k: tags.get(k) for k in expected} == expected
        assert not any(k.startswith("source_") for k in tags)  # one name per fact
    # The MLflow UI renders the description as markdown: a link to the source version and its run.
    description = version.description
    assert f"](#/models/{SOURCE_MODEL}/versions/3)" in description
    assert f"[`{source_run}`](#/runs/{source_run})" in description and PROD in description
    assert run_tags["mlflow.note.content"] == description
    assert client.get_run(source_run).info.run_id == source_run  # the link names a real run
    # The compile report (kiln report's page) is a run artifact, linked from the description.
    experiment = client.get_run(prod.run_id).info.experiment_id
    assert f"](#/experiments/{experiment}/runs/{prod.run_id}/artifactPath/report.html)" in description
    page = Path(client.download_artifacts(prod.run_id, "report.html", str(tmp_path))).read_text()
    assert page.startswith("<!DOCTYPE html>") and prod.content_hash in page and PROD in page
    other = client.get_model_version(NAME, recorded["other"].version)
    assert other.tags["kiln.source.kind"] == "hf" and "kiln.source.run_id" not in other.tags
    assert "#/models/" not in other.description and "`hf:/models/fraud-bert`" in other.description


def test_recorded_validation_data_is_a_run_input_with_its_digest(mlflow_server, packages, recorded):
    import mlflow

    client = mlflow.MlflowClient(mlflow_server.uri)
    sha256 = hashlib.sha256(packages["data"].read_bytes()).hexdigest()
    run = client.get_run(recorded["prod"].run_id)
    inputs = run.inputs.dataset_inputs
    assert len(inputs) == 1
    dataset = inputs[0].dataset
    assert dataset.name == "fraud_val.npz" and dataset.digest == sha256[:36]
    assert dataset.source_type == "local"
    assert json.loads(dataset.source) == {"uri": str(packages["data"])}
    schema = json.loads(dataset.schema)["mlflow_tensorspec"]
    assert json.loads(schema["features"])[0]["tensor-spec"]["shape"] == [-1, 16]
    assert json.loads(dataset.profile) == {"sha256": sha256, "samples": 3, "skipped": 1}
    tags = {t.key: t.value for t in inputs[0].tags}
    assert tags == {"mlflow.data.context": "validation", "kiln.sha256": sha256}
    assert run.data.tags["kiln.validation.data"] == f"{packages['data']} sha256:{sha256}"
    metrics = run.data.metrics
    assert metrics["validation_samples"] == 3 and metrics["validation_skipped"] == 1
    assert metrics["top1_agreement.output_0"] == 1.0 and metrics["min_top1_agreement"] == 1.0
    assert "max_abs" in metrics and "rel_l2.output_0" in metrics
    # A resumed run logs its inputs again: still one input (the server keys it by name and digest).
    from registry.payload import dataset_input_for

    client.log_inputs(
        run.info.run_id, datasets=[dataset_input_for(compiler.read_manifest(packages["paths"]["prod"]))]
    )
    assert len(client.get_run(run.info.run_id).inputs.dataset_inputs) == 1
    # Random inputs are no data set: no run input.
    assert client.get_run(recorded["other"].run_id).inputs.dataset_inputs == []
    assert client.get_run(recorded["other"].run_id).data.tags["kiln.validation.data"] == "random"


def test_repair_decisions_are_an_artifact_a_tag_and_metrics(mlflow_server, recorded, tmp_path):
    import mlflow

    client = mlflow.MlflowClient(mlflow_server.uri)
    pinned = recorded["pinned"]
    summary = "engine_1: fp16 -> fp32, its rel L2 3.1e-02 -> 2.0e-07"
    assert client.get_model_version(NAME, pinned.version).tags["kiln.accuracy_repair"].startswith(summary)
    run = client.get_run(pinned.run_id)
    assert run.data.tags["kiln.accuracy_repair"].startswith(summary)
    assert "model top-1 agreement 0.91 -> 1.00" in run.data.tags["kiln.accuracy_repair"]
    local = mlflow.artifacts.download_artifacts(
        run_id=pinned.run_id, artifact_path="accuracy_repair.json", dst_path=str(tmp_path)
    )
    record = json.loads(Path(local).read_text())
    assert record["steps"][0]["partition"] == "engine_1" and record["passed"] is True
    metrics = run.data.metrics
    assert metrics["repair.steps"] == 1 and metrics["repair.engines_built"] == 1
    assert metrics["repair.before.max_rel_l2"] == pytest.approx(3.0e-2)
    assert "kiln.accuracy_repair" not in client.get_run(recorded["prod"].run_id).data.tags


def test_lookup_by_alias_serves_what_the_alias_names_now(mlflow_server, source_model, recorded):
    from registry.lookup import lookup

    found = lookup("fraud", source=PROD)
    assert found.version == recorded["prod"].version
    assert found.source_match["how"] == "uri" and found.source_match["alias_version"] == "3"
    assert tuple(found.module(torch.randn(2, 16)).shape) == (2, 10)
    reasons = {r["version"]: r["reason"] for r in found.skipped}
    assert "its source is 'hf:/models/fraud-bert'" in reasons[recorded["other"].version]
    assert "when it pointed at version 2; it points at version 3 now" in reasons[recorded["stale"].version]
    # Compiled from version 3 under another URI: matched through the alias, and it says so.
    pinned = lookup("fraud", source=PROD, version=recorded["pinned"].version, load=False)
    assert pinned.source_match["how"] == "alias"
    assert pinned.source_match["recorded_uri"] == f"models:/{SOURCE_MODEL}/3"
    # A version request matches packages compiled from that version under an alias too.
    by_number = lookup("fraud", source=f"models:/{SOURCE_MODEL}/3", load=False)
    assert (by_number.version, by_number.source_match["how"]) == (recorded["prod"].version, "version")

    client = source_model["client"]
    client.set_registered_model_alias(SOURCE_MODEL, "production", "2")
    try:
        moved = lookup("fraud", source=PROD, load=False)
        assert moved.version == recorded["stale"].version and moved.source_match["alias_version"] == "2"
        reasons = {r["version"]: r["reason"] for r in moved.skipped}
        assert "it points at version 2 now" in reasons[recorded["prod"].version]
    finally:
        client.set_registered_model_alias(SOURCE_MODEL, "production", "3")

    with pytest.raises(NoMatchingVersionError) as err:
        lookup("fraud", source="hf:/models/another")
    assert len(err.value.candidates) == 4 and "source=hf:/models/another" in str(err.value)
    # An alias that does not resolve now: the URI as recorded is all that can match.
    with pytest.raises(NoMatchingVersionError, match="its source is"):
        lookup("fraud", source=f"models:/{SOURCE_MODEL}@nowhere")


def test_lookup_cli_selects_by_source(mlflow_server, recorded):
    from typer.testing import CliRunner

    from flows.cli.registry import build_app

    runner = CliRunner()
    found = runner.invoke(build_app(), ["lookup", "fraud", "--source", PROD, "--json"])
    assert found.exit_code == 0, found.output
    summary = json.loads(found.output)
    assert summary["version"] == recorded["prod"].version
    assert summary["source_match"]["how"] == "uri" and summary["source"]["version"] == "3"
    text = runner.invoke(build_app(), ["lookup", "fraud", "--source", PROD, "--shape", "4,16"])
    assert text.exit_code == 0, text.output
    assert f"source: {PROD} -> version 3 now; matched: uri" in text.output
    miss = runner.invoke(build_app(), ["lookup", "fraud", "--source", PROD, "--shape", "64,16"])
    assert miss.exit_code == 1 and "outside its range" in miss.output
    # neither shape nor source: the champion (else newest), as after `kiln zoo` (issue 40)
    plain = runner.invoke(build_app(), ["lookup", "fraud"])
    assert plain.exit_code == 0 and "verified and loaded" in plain.output


def test_a_fresh_process_looks_the_version_up_by_source_and_runs_it(
    mlflow_server,
    packages,
    recorded,
    tmp_path,
):
    x = torch.randn(5, 16)
    np.save(tmp_path / "x.npy", x.numpy())
    with torch.no_grad():
        expected = packages["model"](x).numpy()
    script = textwrap.dedent(
        f"""
        import numpy as np, torch
        from registry.lookup import lookup
        found = lookup("fraud", source={PROD!r})
        print("FOUND", found.version, found.source_match["how"])
        np.save("out.npy", found.module(torch.from_numpy(np.load("x.npy"))).numpy())
        """
    )
    proc = preloaded.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=dict(os.environ),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"FOUND {recorded['prod'].version} uri" in proc.stdout
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), expected, rtol=1e-4, atol=1e-5)


def test_recorded_data_names_a_path_never_a_mapping() -> None:
    from compiler.validation.report import Latency, ValidationReport
    from registry.payload import recorded_data

    def report(source: str) -> ValidationReport:
        return ValidationReport([], [], Latency(1, 1, 1), Latency(1, 1, 1), data_source=source)

    sha = "ab" * 32
    assert recorded_data(report(f"/data/my val.npz sha256:{sha}")) == {
        "path": "/data/my val.npz",
        "sha256": sha,
        "name": "my val.npz",
        "column": "",
    }
    assert recorded_data(report(f"/data/reviews[text] sha256:{sha}")) == {
        "path": "/data/reviews",
        "sha256": sha,
        "name": "reviews[text]",
        "column": "text",
    }
    assert recorded_data(report(f"<mapping> sha256:{sha}")) is None
    assert recorded_data(report("random")) is None
    assert recorded_data(None) is None
