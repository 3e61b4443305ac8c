"""MLflow tracking, registry, look-ups and releases against a real `mlflow server` on 127.0.0.1.

One module-scoped server; packages are compiled once from ``zoo.models.mlp_with_fallback``:
``A`` (batch 1..32), ``B`` (batch 16..64, same weights), ``D`` (A with deliberately degraded weights,
put in by refit). The tests run in file order and build on each other's registry state.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.export import Dim

import compiler
from registry.errors import (
    ArtifactMissingError,
    ArtifactVerificationError,
    NoMatchingVersionError,
    ReleaseError,
)
from registry.models import (
    CHAMPION,
    PREVIOUS,
    TAG_CONTENT_HASH,
    TAG_REJECTED,
    all_versions,
    get_aliases,
    register_version,
    registered_model_name,
    versions_with_hash,
)
from tests.fixtures import preloaded
from zoo.models import mlp_with_fallback

ROOT = Path(__file__).resolve().parents[2]
NAME = registered_model_name("mlp", "cpu")


def _request(name: str = "mlp"):
    """The compile request a zoo entry for the test MLP makes (what the zoo flow records)."""
    from zoo.config import ZooEntry

    return ZooEntry(name=name, factory="zoo.models:mlp_with_fallback").requests()[0]


def _zoo_file(tmp_path: Path) -> str:
    """The zoo file a release builds the original model from (trusted input, never a registry tag)."""
    import yaml

    path = tmp_path / "zoo.yaml"
    path.write_text(yaml.safe_dump({"models": [{"name": "mlp", "factory": "zoo.models:mlp_with_fallback"}]}))
    return str(path)


def _compile(out: Path, name: str, lo: int, hi: int, example: int) -> compiler.PackageInfo:
    case = mlp_with_fallback()
    program = compiler.export(
        case.model, (torch.randn(example, 64),), dynamic_shapes=({0: Dim("batch", min=lo, max=hi)},)
    )
    compiled = compiler.compile(program)
    report = compiler.validate(case.model, compiled, samples=2, warmup=1, runs=5)
    return compiler.save(compiled, out / f"{name}.kiln", validation=report)


@pytest.fixture(scope="module")
def packages(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("packages")
    a = _compile(out, "a", 1, 32, 4)
    b = _compile(out, "b", 16, 64, 24)
    degraded = out / "d.kiln"
    shutil.copytree(a.path, degraded)
    generator = torch.Generator().manual_seed(1)
    state = {
        k: v + 0.5 * torch.randn(v.shape, generator=generator)
        for k, v in compiler.load(degraded).weights.items()
        if v.is_floating_point()
    }
    compiler.refit_package(degraded, state)
    return {"a": a.path, "b": b.path, "d": degraded}


@pytest.fixture(scope="module")
def recorded(mlflow_server, packages) -> dict:
    """A recorded under a zoo run (nested), its result and the warnings recording raised."""
    from registry.tracking import record_package
    from registry.zoo_runs import zoo_run

    path = list(sys.path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # even if an earlier test in this process raised the same one
        with zoo_run("zoo-test", {"zoo": "test"}) as parent:
            result = record_package(packages["a"], "mlp", _request(), {"status": "ok"})
    raised = [f"{w.category.__name__}: {w.message}" for w in caught]
    added = [p for p in sys.path if p not in path]
    return {"a": result, "parent": parent, "warnings": raised, "added_to_path": added}


def test_record_registers_a_version_with_tags_params_metrics_and_artifacts(mlflow_server, packages, recorded):
    import mlflow

    result = recorded["a"]
    manifest = compiler.read_manifest(packages["a"])
    assert (result.registered_model, result.version, result.created) == (NAME, "1", True)
    client = mlflow.MlflowClient(mlflow_server.uri)
    version = client.get_model_version(NAME, "1")
    tags = version.tags
    assert tags[TAG_CONTENT_HASH] == manifest.content_hash and TAG_CONTENT_HASH == "kiln.content_hash"
    assert tags["backend"] == "onnxruntime" and tags["backend_version"] == manifest.backend_version
    assert tags["engine_target"] == "cpu" and tags["precision"] == "fp32"
    assert tags["input_ranges"] == "x: float32 [1..32, 64] (batch=axis 0)"
    assert json.loads(tags["op_modules"]) == ["zoo.models"]
    request = json.loads(tags["request"])  # data, never imported
    assert request["name"] == "mlp" and request["source"] == "factory:zoo.models:mlp_with_fallback"
    assert "factory" not in tags and "zoo_entry" not in tags

    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow.parentRunId"] == recorded["parent"]
    assert client.get_run(recorded["parent"]).info.status == "FINISHED"
    params = run.data.params
    assert params["backend"] == "onnxruntime" and params["precision"] == "fp32"
    assert params["min_block_size"] == "1" and params["strip_weights"] == "False"
    assert params["kiln_version"] == manifest.kiln_version and params["engine_target"] == "cpu"
    metrics = run.data.metrics
    validation = manifest.validation
    assert metrics["rel_l2.output_0"] == pytest.approx(validation.outputs[0].rel_l2)
    assert metrics["rel_l2.output_0"] < 1e-4
    assert metrics["eager_median_ms"] > 0 and metrics["compiled_p95_ms"] > 0
    assert metrics["latency_ratio"] == pytest.approx(validation.latency_ratio)
    assert metrics["partitions"] == len(manifest.report.partitions) >= 2
    assert metrics["unique_engines"] >= 1 and metrics["build_seconds"] > 0 and "cache_hits" in metrics
    assert metrics["package_bytes"] > 10_000
    artifacts = {a.path for a in client.list_artifacts(result.run_id)}
    assert {
        "input_specs.json",
        "manifest.json",
        "validation.json",
        "request.json",
        "latency.png",
    } <= artifacts
    specs = json.loads(Path(client.download_artifacts(result.run_id, "input_specs.json")).read_text())
    assert specs["inputs"][0]["max_shape"] == [32, 64]
    png = Path(client.download_artifacts(result.run_id, "latency.png")).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"

    model_info = mlflow.models.get_model_info(result.model_uri)
    inputs = model_info.signature.inputs.inputs
    assert [(s.name, s.shape, str(s.type)) for s in inputs] == [("x", (-1, 64), "float32")]


def test_same_content_twice_returns_the_existing_version(mlflow_server, packages, recorded, tmp_path):
    from registry.tracking import record_package

    again = record_package(packages["a"], "mlp", _request(), {"status": "ok"})
    assert again.already_recorded and again.version == "1" and again.run_id == recorded["a"].run_id
    copy = tmp_path / "copy-of-a.kiln"  # same content at another path, as a second zoo run would make
    shutil.copytree(packages["a"], copy)
    assert record_package(copy, "mlp", _request(), None).version == "1"
    import mlflow

    assert [v.version for v in all_versions(mlflow.MlflowClient(mlflow_server.uri), NAME)] == ["1"]


def test_two_zoo_runs_at_once_register_one_version(mlflow_server, packages, tmp_path):
    """Two processes record the same new content at the same moment: exactly one version results."""
    script = textwrap.dedent(
        """
        import json, sys
        from registry.tracking import record_package
        from registry.zoo_runs import zoo_run
        from zoo.config import ZooEntry
        with zoo_run(sys.argv[2]):
            request = ZooEntry(name="mlp", factory="zoo.models:mlp_with_fallback").requests()[0]
            r = record_package(sys.argv[1], "mlp", request)
        print("RESULT " + json.dumps(r.to_dict()))
        """
    )
    copies = []
    for i in range(2):
        copies.append(tmp_path / f"b{i}.kiln")
        shutil.copytree(packages["b"], copies[-1])
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(c), f"zoo-{i}"],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i, c in enumerate(copies)
    ]
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=240)
        assert proc.returncode == 0, err[-3000:]
        results.append(json.loads(out.split("RESULT ", 1)[1]))
    import mlflow

    client = mlflow.MlflowClient(mlflow_server.uri)
    content_hash = compiler.read_manifest(packages["b"]).content_hash
    same = versions_with_hash(client, NAME, content_hash)
    assert [v.version for v in same] == ["2"]
    assert {r["version"] for r in results} == {"2"}
    assert sorted(r["created"] for r in results) == [False, True]


def test_duplicate_from_another_host_converges_to_the_lowest_version(mlflow_server, recorded):
    """A writer on another host (no shared file lock) made a duplicate: the next registration removes it."""
    import mlflow

    client = mlflow.MlflowClient(mlflow_server.uri)
    original = client.get_model_version(NAME, "1")
    model_id = original.source.removeprefix("models:/")  # the logged model's id, as the server wants it
    duplicate = client.create_model_version(
        NAME, original.source, run_id=original.run_id, tags=dict(original.tags), model_id=model_id
    )
    assert len(versions_with_hash(client, NAME, original.tags[TAG_CONTENT_HASH])) == 2
    result = register_version(
        client,
        NAME,
        source=original.source,
        run_id=original.run_id,
        model_id=model_id,
        tags=dict(original.tags),
    )
    assert (result.version, result.created) == ("1", False)
    remaining = [v.version for v in versions_with_hash(client, NAME, original.tags[TAG_CONTENT_HASH])]
    assert remaining == ["1"] and str(duplicate.version) not in remaining


def test_logged_model_has_an_input_example_that_fits_its_signature(mlflow_server, recorded):
    """MLflow warned on every log without one; the example is derived from the input specs, checked
    against the signature and served once by MLflow when the model is logged."""
    import mlflow
    from mlflow.models import Model

    assert not [w for w in recorded["warnings"] if "input example" in w.lower()], recorded["warnings"]
    local = mlflow.artifacts.download_artifacts(recorded["a"].model_uri)
    logged = Model.load(local)
    example = logged.load_input_example(local)
    spec = logged.signature.inputs.inputs[0]
    assert list(example) == ["x"] and spec.name == "x"
    assert example["x"].dtype == spec.type and example["x"].shape == (1, 64)  # the spec's smallest batch
    assert list(spec.shape) == [-1, 64]
    # MLflow served the example from a temporary copy of the model and put its code folder on sys.path.
    assert recorded["added_to_path"] == []


def test_logged_model_loads_in_a_fresh_process_and_matches_eager(mlflow_server, recorded, tmp_path):
    case = mlp_with_fallback()
    x = torch.randn(7, 64)
    np.save(tmp_path / "x.npy", x.numpy())
    with torch.no_grad():
        expected = case.model(x).numpy()
    script = textwrap.dedent(
        f"""
        import sys, numpy as np, torch, mlflow
        assert not any(p.rstrip("/") == {str(ROOT)!r} for p in sys.path)
        model = mlflow.pyfunc.load_model({recorded["a"].model_uri!r})
        x = np.load("x.npy")
        np.save("numpy_out.npy", model.predict(x))
        np.save("dict_out.npy", model.predict({{"x": x}}))
        np.save("tensor_out.npy", model.unwrap_python_model().run(torch.from_numpy(x)).numpy())
        import compiler
        print("COMPILER_FROM", compiler.__file__)
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert str(ROOT) not in proc.stdout.split("COMPILER_FROM", 1)[1]  # the code shipped with the model
    for name in ("numpy_out", "dict_out", "tensor_out"):
        np.testing.assert_allclose(np.load(tmp_path / f"{name}.npy"), expected, rtol=1e-4, atol=1e-5)


def test_lookup_picks_the_version_whose_ranges_cover_the_shape(mlflow_server, recorded):
    from registry.lookup import STAGING_PREFIX, default_download_root, lookup
    from tests.fixtures.downloads import killed_download

    # A look-up killed mid-download left its staging directory; the next look-up of the model sweeps it.
    stale = killed_download(default_download_root() / NAME, "v1", STAGING_PREFIX)
    # v1: batch 1..32, v2: batch 16..64, no champion yet -> newest that fits.
    assert lookup("mlp", (8, 64), backend="onnxruntime", precision="fp32").version == "1"
    assert not stale.exists()
    assert not [p for p in stale.parent.iterdir() if p.name.startswith(STAGING_PREFIX)]  # nor its own
    found = lookup("mlp", {"x": (48, 64)})
    assert found.version == "2"
    out = found.module(torch.randn(48, 64))
    assert tuple(out.shape) == (48, 16)
    assert lookup("mlp", [(20, 64)]).version == "2"
    with pytest.raises(NoMatchingVersionError) as err:
        lookup("mlp", (100, 64))
    reasons = {c["version"]: c["reason"] for c in err.value.candidates}
    assert set(reasons) == {"1", "2"}
    assert "outside its range [1..32, 64]" in reasons["1"] and "[16..64, 64]" in reasons["2"]
    with pytest.raises(NoMatchingVersionError, match="precision is 'fp32', not 'fp16'"):
        lookup("mlp", (8, 64), precision="fp16")
    with pytest.raises(NoMatchingVersionError, match="nothing is registered for 'nope'"):
        lookup("nope", (8, 64))


def test_lookup_cli_exit_codes(mlflow_server, recorded):
    from typer.testing import CliRunner

    from flows.cli.registry import build_app

    runner = CliRunner()
    ok = runner.invoke(build_app(), ["lookup", "mlp", "--shape", "8,64", "--json"])
    assert ok.exit_code == 0, ok.output
    assert json.loads(ok.output)["version"] == "1"
    miss = runner.invoke(build_app(), ["lookup", "mlp", "--shape", "100,64"])
    assert miss.exit_code == 1 and "outside its range" in miss.output


@pytest.fixture(scope="module")
def prefect_api():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=180):
        yield


def test_release_promotes_good_candidates_and_rejects_degraded_weights(
    mlflow_server,
    packages,
    recorded,
    prefect_api,
    tmp_path,
):
    import mlflow

    from flows.cli.registry import build_app
    from flows.release import release
    from registry.tracking import record_package

    client = mlflow.MlflowClient(mlflow_server.uri)
    zoo = _zoo_file(tmp_path)
    first = release("mlp", version="1", zoo_path=zoo, max_latency_ratio=3.0, runs=10)
    assert first["promoted"] and first["champion"] == "1" and first["previous"] is None
    assert first["report"]["latency"]["note"].startswith("no champion")

    second = release("mlp", version="2", zoo_path=zoo, max_latency_ratio=3.0, runs=10)
    assert second["promoted"], second["reasons"]
    assert get_aliases(client, NAME) == {CHAMPION: "2", PREVIOUS: "1"}
    gates = json.loads(client.get_model_version(NAME, "2").tags["release_report"])
    assert gates["accuracy"]["max_rel_l2"] < 1e-4 and gates["latency"]["champion_median_ms"] > 0

    degraded = record_package(packages["d"], "mlp", _request(), None)
    assert degraded.created and degraded.version not in ("1", "2")
    from typer.testing import CliRunner

    args = ["release", "mlp", "--zoo", zoo, "--max-latency-ratio", "3.0", "--runs", "10"]
    result = CliRunner().invoke(build_app(), args)
    assert result.exit_code == 1, result.output
    assert "accuracy" in result.output
    tags = client.get_model_version(NAME, degraded.version).tags
    reasons = json.loads(tags[TAG_REJECTED])
    assert len(reasons) == 1 and reasons[0].startswith("accuracy: max relative L2")
    assert get_aliases(client, NAME) == {CHAMPION: "2", PREVIOUS: "1"}  # nothing moved

    from registry.lookup import lookup

    assert lookup("mlp", (20, 64)).version == "2"  # the champion, though the degraded one is newer
    assert lookup("mlp", (8, 64)).version == "1"  # the champion does not cover batch 8


def test_zoo_flow_records_its_models_nested_under_one_zoo_run(mlflow_server, prefect_api, tmp_path):
    """End to end through ``recompile_zoo``: the flow's tracking step lands each package in the registry."""
    import mlflow
    import yaml

    from flows.recompile_zoo import recompile_zoo

    zoo = {
        "settings": {
            "out_dir": str(tmp_path / "out"),
            "workspace": str(tmp_path / "workspace"),
            "engine_cache": str(tmp_path / "engine-cache"),
            "tracking": True,
            "validation": {"samples": 2, "warmup": 1, "runs": 3},
        },
        "models": [
            {"name": "mlp_zoo", "factory": "zoo.models:mlp_with_fallback", "factory_kwargs": {"width": 32}}
        ],
    }
    path = tmp_path / "zoo.yaml"
    path.write_text(yaml.safe_dump(zoo))
    recompile_zoo(zoo_path=str(path))

    client = mlflow.MlflowClient(mlflow_server.uri)
    name = registered_model_name("mlp_zoo", "cpu")
    [version] = all_versions(client, name)
    manifest = compiler.read_manifest(tmp_path / "out" / "mlp_zoo.kiln")
    assert version.tags[TAG_CONTENT_HASH] == manifest.content_hash
    assert version.tags["input_ranges"] == "x: float32 [1..32, 32] (batch=axis 0)"
    assert json.loads(version.tags["request"])["name"] == "mlp_zoo"
    run = client.get_run(version.run_id)
    assert run.data.metrics["rel_l2.output_0"] < 1e-4 and run.data.metrics["compiled_median_ms"] > 0
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])
    assert parent.data.tags["kiln.kind"] == "zoo" and parent.info.status == "FINISHED"


def test_rollback_moves_champion_back_and_refuses_a_second_time(mlflow_server, recorded):
    import mlflow
    from typer.testing import CliRunner

    from flows.cli.registry import build_app

    client = mlflow.MlflowClient(mlflow_server.uri)
    assert get_aliases(client, NAME) == {CHAMPION: "2", PREVIOUS: "1"}
    result = CliRunner().invoke(build_app(), ["rollback", "mlp"])
    assert result.exit_code == 0, result.output
    assert get_aliases(client, NAME) == {CHAMPION: "1"}
    assert "rolled_back" in client.get_model_version(NAME, "2").tags
    from registry.lookup import lookup

    with pytest.raises(NoMatchingVersionError, match="rolled back from champion"):
        lookup("mlp", (48, 64))  # only the demoted version covers batch 48: it is not served
    again = CliRunner().invoke(build_app(), ["rollback", "mlp"])
    assert again.exit_code == 2 and "no 'previous' alias" in again.output


def test_failed_release_step_undoes_the_earlier_ones(mlflow_server, recorded):
    import mlflow

    from registry.release import _alias_step, _run_steps, _tag_steps

    client = mlflow.MlflowClient(mlflow_server.uri)
    before_aliases = get_aliases(client, NAME)
    before_tags = dict(client.get_model_version(NAME, "1").tags)
    steps = [
        _tag_steps(client, NAME, "1", "release_report", '{"half": true}'),
        _alias_step(client, NAME, PREVIOUS, "1", before_aliases.get(PREVIOUS)),
        _alias_step(client, NAME, CHAMPION, "999", before_aliases.get(CHAMPION)),  # no such version
    ]
    with pytest.raises(ReleaseError, match="aborted at step 3"):
        _run_steps(steps, None)
    assert get_aliases(client, NAME) == before_aliases
    assert dict(client.get_model_version(NAME, "1").tags) == before_tags


def _artifact_dir(client, name: str, version: str) -> Path:
    return Path(client.get_model_version_download_uri(name, version))


def test_tampered_artifact_is_refused_at_lookup(mlflow_server, packages):
    import mlflow

    from registry.lookup import lookup
    from registry.tracking import record_package

    client = mlflow.MlflowClient(mlflow_server.uri)
    engines = record_package(packages["a"], "mlp_tamper_engine", _request("mlp_tamper_engine"))
    stored = _artifact_dir(client, engines.registered_model, engines.version)
    engine = next(stored.rglob("engines/*.engine"))
    data = bytearray(engine.read_bytes())
    data[len(data) // 2] ^= 0xFF
    engine.write_bytes(bytes(data))
    with pytest.raises(ArtifactVerificationError, match="does not match its checksum"):
        lookup("mlp_tamper_engine", (4, 64))

    # Editing the manifest (widening the ranges) is not covered by file checksums, but by the content hash.
    manifest_entry = record_package(packages["b"], "mlp_tamper_manifest", _request("mlp_tamper_manifest"))
    stored = _artifact_dir(client, manifest_entry.registered_model, manifest_entry.version)
    manifest_path = next(stored.rglob("manifest.json"))
    manifest = json.loads(manifest_path.read_text())
    manifest["input_specs"][0]["min_shape"][0] = 1
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ArtifactVerificationError, match="content_hash"):
        lookup("mlp_tamper_manifest", (20, 64))


def test_deleted_artifact_gives_a_clear_error(mlflow_server, packages):
    import mlflow

    from registry.lookup import lookup
    from registry.tracking import record_package

    client = mlflow.MlflowClient(mlflow_server.uri)
    gone = record_package(packages["a"], "mlp_gone", _request("mlp_gone"))
    shutil.rmtree(_artifact_dir(client, gone.registered_model, gone.version))
    with pytest.raises(
        ArtifactMissingError, match=r"version 1 of kiln\.mlp_gone\.cpu is registered, but its artifact"
    ):
        lookup("mlp_gone", (4, 64))


def test_embedded_default_store_and_summary(packages, tmp_path):
    """No tracking URI: sqlite under the working folder, artifacts in ./mlruns, and the UI command."""
    script = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(ROOT)!r})
        from registry.tracking import record_package
        from registry.summary import print_registry_summary
        request = {{"name": "mlp", "source": "factory:zoo.models:mlp_with_fallback"}}
        r = record_package({str(packages["a"])!r}, "mlp", request)
        print_registry_summary()
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_TRACKING")}
    env["COLUMNS"] = "250"
    proc = preloaded.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "mlflow.db").is_file()
    assert list((tmp_path / "mlruns").rglob("a.kiln/manifest.json"))
    assert f"mlflow ui --backend-store-uri sqlite:///{tmp_path}/mlflow.db" in proc.stdout
    assert "kiln.mlp.cpu" in proc.stdout and "1..32" in proc.stdout


def test_pool_of_threads_recording_the_same_package(mlflow_server, packages, tmp_path):
    """Threads of one zoo run (Prefect's thread runner) recording equal content: one version, no errors."""
    import mlflow

    from registry.tracking import record_package

    paths = []
    for i in range(3):
        paths.append(tmp_path / f"t{i}.kiln")
        shutil.copytree(packages["b"], paths[-1])
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda p: record_package(p, "mlp_threads", _request("mlp_threads")), paths))
    assert {r.version for r in results} == {"1"}
    client = mlflow.MlflowClient(mlflow_server.uri)
    name = registered_model_name("mlp_threads", "cpu")
    assert [v.version for v in all_versions(client, name)] == ["1"]

    # Someone deletes the version: recording the same package registers the logged model again.
    client.delete_model_version(name, "1")
    again = record_package(paths[0], "mlp_threads", _request("mlp_threads"))
    assert again.already_recorded and again.created and again.version == "2"
    assert (
        client.get_model_version(name, "2").tags["input_ranges"] == "x: float32 [16..64, 64] (batch=axis 0)"
    )


def test_a_failing_logging_step_marks_its_run_failed(mlflow_server, packages, tmp_path):
    """The server is up but rejects the step: the run is marked FAILED with the error, the package kept."""
    import mlflow
    from mlflow.exceptions import MlflowException

    from compiler.package.manifest import SourceRecord
    from registry.tracking import TAG_CONTENT_HASH, record_package

    # A source URI over the registry's tag limit (100,000 characters): the version cannot be created.
    source = SourceRecord("hf:" + "x" * 150_000, "hf")
    path = compiler.save(compiler.load(packages["a"]), tmp_path / "big.kiln", source=source).path
    before = compiler.read_manifest(path)
    with pytest.raises(MlflowException):
        record_package(path, "mlp_bad_source", {"name": "mlp_bad_source"})
    client = mlflow.MlflowClient(mlflow_server.uri)
    experiment = client.get_experiment_by_name("kiln")
    query = f"tags.`{TAG_CONTENT_HASH}` = '{before.content_hash}' and tags.`kiln.model` = 'mlp_bad_source'"
    runs = client.search_runs([experiment.experiment_id], filter_string=query)
    assert [r.info.status for r in runs] == ["FAILED"]
    assert "kiln.error" in runs[0].data.tags
    assert compiler.read_manifest(path) == before


def test_a_corrupt_package_is_refused_before_anything_is_logged(packages, tmp_path):
    from compiler.errors import PackageCorruptError
    from registry.tracking import record_package

    broken = tmp_path / "broken.kiln"
    shutil.copytree(packages["a"], broken)
    (broken / "weights.safetensors").write_bytes(b"not the weights")
    store = tmp_path / "store"
    with pytest.raises(PackageCorruptError, match=r"weights\.safetensors"):
        record_package(broken, "mlp", _request(), tracking_uri=f"sqlite:///{store / 'mlflow.db'}")
    assert not store.exists()  # the check ran before any MLflow call


# ---------------------------------------------------------------- payload, tags, fallback, rollback


def test_a_tensorrt_rtx_package_requires_tensorrt_rtx(packages):
    """Issue 11 bug: the backend is named 'tensorrt-rtx'; the requirement was chosen by 'tensorrt_rtx'."""
    import dataclasses

    from registry.payload import requirement_names, requirements_for

    manifest = compiler.read_manifest(packages["a"])
    rtx = dataclasses.replace(manifest, backend="tensorrt-rtx", backend_version="1.7.1.116")
    reqs = requirements_for(rtx)
    assert "tensorrt-rtx==1.7.1.116" in reqs  # the library version that built the engines
    assert not any(r.split("==")[0] == "tensorrt" for r in reqs), reqs
    assert "tensorrt" in requirement_names(["tensorrt"]) and "tensorrt-rtx" not in requirement_names(
        ["tensorrt"]
    )
    assert not any(r.startswith("tensorrt") for r in requirements_for(manifest))
    assert any(r.startswith("onnxruntime==") for r in requirements_for(manifest))


def test_lookup_never_imports_a_module_a_tag_names(mlflow_server, packages, tmp_path, monkeypatch):
    """Issue 14.4: `kiln lookup` imported the module in a version's `factory` tag."""
    import mlflow

    from registry.lookup import lookup
    from registry.tracking import record_package

    marker = tmp_path / "imported"
    modules = tmp_path / "modules"
    modules.mkdir()
    (modules / "kiln_tag_payload.py").write_text(f"open({str(marker)!r}, 'w').close()\ndef build(): pass\n")
    monkeypatch.syspath_prepend(str(modules))
    recorded = record_package(packages["a"], "mlp_tags", _request("mlp_tags"))
    client = mlflow.MlflowClient(mlflow_server.uri)
    for key, value in (("factory", "kiln_tag_payload:build"), ("op_modules", '["kiln_tag_payload"]')):
        client.set_model_version_tag(recorded.registered_model, recorded.version, key, value)
    found = lookup("mlp_tags", (4, 64))
    assert tuple(found.module(torch.randn(4, 64)).shape) == (4, 16)
    assert found.manifest.op_modules == ("zoo.models",)  # what decides: the verified package's list
    assert not marker.exists() and "kiln_tag_payload" not in sys.modules


def test_versions_with_the_old_content_hash_tag_still_match(mlflow_server, packages):
    import mlflow

    from registry.lookup import lookup
    from registry.models import LEGACY_TAG_CONTENT_HASH
    from registry.tracking import record_package

    client = mlflow.MlflowClient(mlflow_server.uri)
    first = record_package(packages["a"], "mlp_legacy", _request("mlp_legacy"))
    name, version = first.registered_model, first.version
    # What a version registered before the rename looks like: the hash under `content_hash` only.
    client.delete_model_version_tag(name, version, TAG_CONTENT_HASH)
    client.set_model_version_tag(name, version, LEGACY_TAG_CONTENT_HASH, first.content_hash)
    again = record_package(packages["a"], "mlp_legacy", _request("mlp_legacy"))
    assert (again.version, again.created) == (version, False)
    assert [v.version for v in all_versions(client, name)] == [version]
    assert lookup("mlp_legacy", (4, 64)).version == version
    client.set_model_version_tag(name, version, LEGACY_TAG_CONTENT_HASH, "0" * 64)
    with pytest.raises(ArtifactVerificationError, match="the artifact was replaced"):
        lookup("mlp_legacy", (4, 64))


def _swap_program_for_a_payload(package: Path, marker: Path) -> None:
    """Issue 14.1's attack on a stored artifact: a program that unpickles a payload, checksums resealed."""
    from tests.compiler.package.test_package import _evil_program
    from tests.compiler.package.untrusted_probe import _reseal

    program = package / "program.pt2"
    program.write_bytes(_evil_program(program.read_bytes(), "sample_inputs", marker))
    _reseal(package)


def test_lookup_falls_back_past_a_broken_champion_and_says_so(mlflow_server, packages, tmp_path, caplog):
    """Issue 14.7: a corrupt champion stranded every look-up."""
    import logging

    import mlflow
    from typer.testing import CliRunner

    from flows.cli.registry import build_app
    from registry.lookup import lookup
    from registry.tracking import record_package

    client = mlflow.MlflowClient(mlflow_server.uri)
    one = record_package(packages["a"], "mlp_fallback", _request("mlp_fallback"))  # batch 1..32
    two = record_package(packages["b"], "mlp_fallback", _request("mlp_fallback"))  # batch 16..64
    name = one.registered_model
    client.set_registered_model_alias(name, CHAMPION, two.version)
    stored = next(_artifact_dir(client, name, two.version).rglob("manifest.json")).parent
    marker = tmp_path / "payload-ran"
    _swap_program_for_a_payload(stored, marker)

    caplog.set_level(logging.WARNING, logger="kiln.registry")
    found = lookup("mlp_fallback", (20, 64))
    assert found.version == one.version and found.fell_back_from == [two.version]
    reasons = {r["version"]: r["reason"] for r in found.skipped}
    assert reasons[two.version].startswith("failed verification") and "refused" in reasons[two.version]
    assert any(f"serving version {one.version} instead of broken" in r.getMessage() for r in caplog.records)
    assert tuple(found.module(torch.randn(20, 64)).shape) == (20, 16)
    assert not marker.exists()
    with pytest.raises(ArtifactVerificationError):
        lookup("mlp_fallback", (20, 64), version=two.version)  # pinned: no fall-back
    out = CliRunner().invoke(build_app(), ["lookup", "mlp_fallback", "--shape", "20,64"])
    assert out.exit_code == 0, out.output
    assert f"served instead of broken version(s) {two.version}" in out.output
    assert not marker.exists()


def test_release_past_a_broken_champion_needs_force_and_is_recorded(mlflow_server):
    import mlflow

    from registry.lookup import fetch_version, load_package
    from registry.release import GateReport, apply_decision, champion_or_broken

    client = mlflow.MlflowClient(mlflow_server.uri)
    name = registered_model_name("mlp_fallback", "cpu")
    champion = get_aliases(client, name)[CHAMPION]  # broken by the test before
    candidate = next(v.version for v in all_versions(client, name) if v.version != champion)

    def load() -> object:
        return load_package(fetch_version(client, name, champion)[0])

    with pytest.raises(ReleaseError, match="--force-replace-broken"):
        champion_or_broken(load, name, champion)
    module, broken = champion_or_broken(load, name, champion, force_replace_broken=True)
    assert module is None and broken.startswith("ArtifactVerificationError")
    report = GateReport(
        name, candidate, champion, {"passed": True}, {"passed": True}, replaced_broken_champion=broken
    )
    outcome = apply_decision(report)
    assert outcome.promoted and outcome.champion == candidate and outcome.replaced_broken_champion == broken
    assert outcome.previous is None  # a broken version is no rollback target
    tags = client.get_model_version(name, candidate).tags
    assert tags["replaced_broken_champion"].startswith(f"v{champion}: ArtifactVerificationError")
    assert json.loads(tags["release_report"])["replaced_broken_champion"] == broken
    assert client.get_model_version(name, champion).tags["broken"] == broken[:1000]


def test_rollback_to_a_named_version(mlflow_server, recorded):
    import mlflow
    from typer.testing import CliRunner

    from flows.cli.registry import build_app
    from registry.release import rollback

    client = mlflow.MlflowClient(mlflow_server.uri)
    assert get_aliases(client, NAME) == {CHAMPION: "1"}  # after the plain rollback: no 'previous'
    outcome = rollback("mlp", to_version="2")
    assert outcome.champion == "2" and get_aliases(client, NAME) == {CHAMPION: "2"}
    assert "rolled_back" in client.get_model_version(NAME, "1").tags
    assert "rolled_back" not in client.get_model_version(NAME, "2").tags  # it serves again
    rejected = next(v.version for v in all_versions(client, NAME) if TAG_REJECTED in v.tags)
    for version, why in ((rejected, "rejected by a release"), ("99", "has no version 99"), ("2", "already")):
        with pytest.raises(ReleaseError, match=why):
            rollback("mlp", to_version=version)
    result = CliRunner().invoke(build_app(), ["rollback", "mlp", "--to", "1"])
    assert result.exit_code == 0, result.output
    assert get_aliases(client, NAME) == {CHAMPION: "1"}


KILL_BETWEEN_ALIAS_MOVES = """
import os, signal
from mlflow import MlflowClient

moved = []
set_alias = MlflowClient.set_registered_model_alias


def set_alias_then_die(self, name, alias, version):
    moved.append(alias)
    if len(moved) == 2:  # 'previous' moved, 'champion' not yet: the process dies here
        os.kill(os.getpid(), signal.SIGKILL)
    return set_alias(self, name, alias, version)


MlflowClient.set_registered_model_alias = set_alias_then_die
from registry.release import GateReport, apply_decision

apply_decision(GateReport({name!r}, "3", "2", {{"passed": True}}, {{"passed": True}}))
"""


def test_alias_moves_are_all_or_nothing_across_a_kill(mlflow_server, tmp_path):
    import mlflow

    from registry.models import TAG_ALIAS_INTENT
    from registry.release import rollback

    client = mlflow.MlflowClient(mlflow_server.uri)
    name = registered_model_name("killed", "cpu")
    with mlflow.start_run() as run:
        mlflow.log_text("weights", "model/weights.txt")
    client.create_registered_model(name)
    for _ in range(3):
        client.create_model_version(name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
    client.set_registered_model_alias(name, CHAMPION, "2")
    client.set_registered_model_alias(name, PREVIOUS, "1")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = KILL_BETWEEN_ALIAS_MOVES.format(name=name)
    proc = preloaded.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr  # killed between the two moves
    raw = client.get_registered_model(name)
    assert raw.aliases == {CHAMPION: "2", PREVIOUS: "2"} and TAG_ALIAS_INTENT in raw.tags  # half done
    # The next reader (lookup, release, rollback all read through get_aliases) finishes the moves.
    assert get_aliases(client, name) == {CHAMPION: "3", PREVIOUS: "2"}
    assert TAG_ALIAS_INTENT not in client.get_registered_model(name).tags
    outcome = rollback("killed")
    assert outcome.champion == "2" and get_aliases(client, name) == {CHAMPION: "2"}
    # A registry an older kiln left half moved: rollback changes nothing rather than orphan a version.
    client.set_registered_model_alias(name, PREVIOUS, "2")
    with pytest.raises(ReleaseError, match="both name version 2; nothing to roll back to"):
        rollback("killed")
    assert get_aliases(client, name) == {CHAMPION: "2", PREVIOUS: "2"}
