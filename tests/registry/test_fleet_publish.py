"""Publishing packages to an MLflow server whose artifacts live on S3 (moto on 127.0.0.1), as a fleet does.

What it proves:
- an upload and a download report running progress, file by file as the bytes land (each report's
  bytes are on the store, or on disk, when it arrives), ending at the total; a log that nobody
  watches live gets throttled lines, a terminal a progress bar;
- a ``kiln zoo`` killed (SIGKILL) while it uploads a package leaves nothing that anyone reads: no
  version is registered, the partial upload is not even a model (``MLmodel`` goes up last), a version
  pointed at it by hand is refused with a typed error and loads nothing, and a re-run registers
  exactly one good version that ``kiln lookup`` verifies and loads.
"""

from __future__ import annotations

import io
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from mlflow.entities import LoggedModelStatus
from rich.console import Console
from torch.export import Dim

import compiler
from registry import config
from registry.errors import ArtifactMissingError, ArtifactVerificationError, NoMatchingVersionError
from registry.lookup import STAGING_PREFIX, fetch_version, lookup
from registry.models import all_versions, content_hash_of
from registry.tracking import record_package
from registry.transfer import LogLines, Progress, reporting
from tests.fixtures import preloaded
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.s3_server import BUCKET, MotoServer
from zoo.models import mlp_with_fallback

ROOT = Path(__file__).resolve().parents[2]
REQUEST = {"name": "mlp_progress", "source": "factory:zoo.models:mlp_with_fallback"}


def _model_objects(s3) -> dict[str, int]:
    """key -> bytes of every logged model's artifact on the store (``.../models/<id>/artifacts/...``)."""
    found: dict[str, int] = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix="mlflow/"):
        found.update({o["Key"]: o["Size"] for o in page.get("Contents", []) if "/models/" in o["Key"]})
    return found


def _check_reports(reports: list[Progress], direction: str) -> None:
    assert len(reports) > 1 and all(p.direction == direction for p in reports)
    done = [p.done for p in reports]
    assert done == sorted(done) and done[0] < done[-1]  # increasing, as the files go
    assert [p.files_done for p in reports] == list(range(1, len(reports) + 1))
    assert done[-1] == reports[-1].total and len(reports) == reports[-1].files_total
    assert reports[-1].percent == 100.0


def test_upload_and_download_report_progress_as_the_files_go(
    s3_server: MotoServer, s3_mlflow: MlflowServer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    case = mlp_with_fallback(width=256)
    program = compiler.export(
        case.model, (torch.randn(4, 256),), dynamic_shapes=({0: Dim("batch", min=1, max=16)},)
    )
    compiled = compiler.compile(program)
    report = compiler.validate(case.model, compiled, samples=1, warmup=1, runs=2)
    package = compiler.save(compiled, tmp_path / "mlp.kiln", validation=report).path

    s3 = s3_server.client("s3")
    mlclient = config.client()
    before = set(_model_objects(s3))
    uploads: list[Progress] = []
    sizes: list[int] = []  # each reported file's bytes on S3 when its report came
    listed: dict[int, int] = {}  # report number -> bytes of every new object on S3 then
    registered_during: list[int] = []
    where: list[str] = []  # the logged model's artifact prefix on S3

    def uploaded(p: Progress) -> None:
        # One object read per report (the file just reported); the whole listing and the registry only
        # where they can fail: objects are never deleted, so an early MLmodel or an early registration
        # would still be there at the next-to-last and the last report.
        uploads.append(p)
        if not where or p.files_done >= p.files_total - 1:
            new = {k: v for k, v in _model_objects(s3).items() if k not in before}
            listed[p.files_done] = sum(new.values())
            assert p.path == "MLmodel" or not any(k.endswith("/artifacts/MLmodel") for k in new)
            if not where:
                [key] = [k for k in new if k.endswith(f"/artifacts/{p.path}")]
                where.append(key[: -len(p.path)])
        sizes.append(s3.head_object(Bucket=BUCKET, Key=where[0] + p.path)["ContentLength"])
        if p.files_done == p.files_total:
            registered_during.append(len(all_versions(mlclient, "kiln.mlp_progress.cpu")))

    with caplog.at_level(logging.INFO, logger="kiln.registry"):
        result = record_package(package, "mlp_progress", REQUEST, on_progress=uploaded)
    _check_reports(uploads, "upload")
    # each report's bytes were on S3 when it came, and at the first and the last two nothing more was
    assert [sum(sizes[:i]) for i in range(1, len(sizes) + 1)] == [p.done for p in uploads]
    assert listed == {i: uploads[i - 1].done for i in (1, len(uploads) - 1, len(uploads))}
    assert uploads[-1].path == "MLmodel"  # last: a cut-off upload is not a model
    assert set(registered_during) == {0} and result.created  # registered only after every file
    package_bytes = sum(f.stat().st_size for f in package.rglob("*") if f.is_file())
    assert uploads[-1].total > package_bytes
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("uploading mlp_progress")]
    assert lines and "(100%" in lines[-1] and f"file {len(uploads)}/{len(uploads)}" in lines[-1]

    downloads: list[Progress] = []
    on_disk: list[int] = []

    def downloaded(p: Progress) -> None:
        downloads.append(p)
        staging = [d for d in tmp_path.iterdir() if d.name.startswith(STAGING_PREFIX)]
        assert len(staging) == 1 and not (tmp_path / "fetched").exists()  # nothing unverified at dst
        on_disk.append(sum(f.stat().st_size for f in staging[0].rglob("*") if f.is_file()))

    package_dir, manifest, tags = fetch_version(
        mlclient, result.registered_model, result.version, dst=tmp_path / "fetched", on_progress=downloaded
    )
    _check_reports(downloads, "download")
    assert on_disk == [p.done for p in downloads]  # each report's bytes were on disk when it came
    # MLmodel (first: it names the package's folder) and the package; the pyfunc model's code files,
    # uploaded for mlflow.pyfunc.load_model, stay in the store.
    mlmodel_bytes = uploads[-1].done - uploads[-2].done
    package_files = [f for f in package.rglob("*") if f.is_file()]
    assert downloads[0].path == "MLmodel" and len(uploads) > len(package_files) + 100
    assert downloads[-1].files_total == 1 + len(package_files)
    assert downloads[-1].total == package_bytes + mlmodel_bytes
    assert manifest.content_hash == content_hash_of(tags) == result.content_hash
    assert (package_dir / "manifest.json").read_bytes() == (package / "manifest.json").read_bytes()

    # The model logged file by file is the model MLflow's Model.log made: READY, linked to its run,
    # loadable through MLflow and serving the package.
    import mlflow

    model_id = result.model_uri.removeprefix("models:/")
    assert mlclient.get_logged_model(model_id).status.to_proto() == LoggedModelStatus.READY.to_proto()
    assert model_id in [o.model_id for o in mlclient.get_run(result.run_id).outputs.model_outputs]
    served = mlflow.pyfunc.load_model(result.model_uri)
    x = torch.randn(3, 256)
    assert torch.allclose(torch.as_tensor(served.predict(x.numpy())), case.model(x), atol=1e-4)


def test_log_lines_come_every_step_or_every_few_seconds_and_at_the_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    lines = LogLines(step=10.0, seconds=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="kiln.registry"):
        for i in range(1, 101):  # 100 files of 1 MB, 0.1 s each: a line per 10 %
            now[0] += 0.1
            lines(Progress("upload", "m", f"f{i}", i * 1_000_000, 100_000_000, i, 100))
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 10 and said[-1].startswith("uploading m: 100.0/100.0 MB (100%, file 100/100")
    caplog.clear()
    slow = LogLines(step=10.0, seconds=5.0, clock=lambda: now[0])
    with caplog.at_level(logging.INFO, logger="kiln.registry"):
        for i in range(1, 4):  # 1 % per file, 6 s each: a line per file, however little moved
            now[0] += 6.0
            slow(Progress("download", "m", f"f{i}", i, 100, i, 100))
    assert len(caplog.records) == 3 and "downloading m: 0.0/0.0 MB (3%" in caplog.records[-1].getMessage()


def test_a_terminal_gets_a_progress_bar() -> None:
    screen = io.StringIO()
    console = Console(file=screen, force_terminal=True, width=100)
    with reporting("upload", "mlp_progress", 2_000_000, None, console=console) as report:
        report(Progress("upload", "mlp_progress", "a", 1_000_000, 2_000_000, 1, 2))
        report(Progress("upload", "mlp_progress", "b", 2_000_000, 2_000_000, 2, 2))
    shown = screen.getvalue()
    assert "upload mlp_progress" in shown and "2.0/2.0 MB" in shown


# Caught mid-upload by the width of the upload, not of the weights: after the package's first file (an
# engine) come its ~3 MB of weights and the ~150 source files the pyfunc model carries (``code/``), one
# request each, before ``MLmodel``: seconds, against a poll every 20 ms. (At width 2048, 50 MB of
# weights, the kill still landed after the second of ~165 files; the test then cost 5 s more.)
BIG = {
    "name": "big",
    "factory": "zoo.models:mlp_with_fallback",
    "factory_kwargs": {"width": 512},
}


@pytest.mark.slow
def test_a_zoo_killed_mid_upload_leaves_nothing_that_is_read_and_a_rerun_registers_one_version(
    s3_server: MotoServer, s3_mlflow: MlflowServer, prefect_api, tmp_path: Path
) -> None:
    zoo = tmp_path / "zoo.yaml"
    settings = {
        "workspace": str(tmp_path / "workspace"),
        "engine_cache": str(tmp_path / "engines"),
        "tracking": True,
        "parallel_models": 1,
        "validation": {"samples": 1, "warmup": 1, "runs": 2},
    }
    zoo.write_text(yaml.safe_dump({"settings": settings, "models": [BIG]}))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "flows.cli", "zoo", str(zoo), "--out", str(tmp_path / "out"), "--json"]
    s3 = s3_server.client("s3")
    mlclient = config.client()
    before = set(_model_objects(s3))

    worker = subprocess.Popen(
        command,
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: the kill takes everything it started
    )
    deadline = time.monotonic() + 120
    try:
        while not set(_model_objects(s3)) - before:
            assert worker.poll() is None, f"the zoo ended before its upload was seen: {worker.stderr.read()}"
            assert time.monotonic() < deadline, "no package object appeared on S3 within 120 s"
            time.sleep(0.02)
        os.killpg(worker.pid, signal.SIGKILL)  # the first package object is on the store: mid-publish
    finally:
        if worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
        worker.wait(timeout=30)
    assert worker.returncode == -signal.SIGKILL
    print("PARTIAL", sorted(_model_objects(s3).items()))

    partial = {k for k in _model_objects(s3) if k not in before}
    assert partial and not any(k.endswith("/artifacts/MLmodel") for k in partial)  # cut off mid-upload
    assert all_versions(mlclient, "kiln.big.cpu") == []  # nothing registered points at it
    with pytest.raises(NoMatchingVersionError):
        lookup("big", load=False)

    # Even a version pointed at the partial upload by hand is refused, typed, and nothing is loaded.
    model_id = next(iter(partial)).split("/models/", 1)[1].split("/", 1)[0]
    mlclient.create_registered_model("kiln.big-partial.cpu")
    mlclient.create_model_version("kiln.big-partial.cpu", f"models:/{model_id}", model_id=model_id)
    with pytest.raises((ArtifactMissingError, ArtifactVerificationError)):
        lookup("big-partial", dst=tmp_path / "partial", allowed_modules=["zoo.models"])
    assert not (tmp_path / "partial").exists()

    rerun = preloaded.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["models"][0]["status"] == "ok" and summary["models"][0]["tracking"]["created"]
    versions = all_versions(mlclient, "kiln.big.cpu")
    assert [str(v.version) for v in versions] == ["1"]

    looked = preloaded.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "lookup",
            "big",
            "--shape",
            "4,512",
            "--allow-op-module",
            "zoo.models",
            "--json",
        ],
        cwd=ROOT,
        env={**env, "KILN_REGISTRY_CACHE": str(tmp_path / "lookups")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert looked.returncode == 0, looked.stderr[-3000:]
    found = json.loads(looked.stdout)
    assert found["version"] == "1" and found["content_hash"] == content_hash_of(versions[0].tags)
    assert Path(found["package_dir"], "manifest.json").is_file()


def test_a_version_tampered_on_s3_is_refused_by_kiln_lookup(
    s3_server: MotoServer, s3_mlflow: MlflowServer, tmp_path: Path
) -> None:
    """The look-up attack on the fleet's store: an engine of a registered version rewritten on S3 (by
    whoever can write the bucket) is refused at ``kiln lookup``, before anything of it is loaded."""
    case = mlp_with_fallback(width=16)
    program = compiler.export(case.model, case.args, dynamic_shapes=case.dynamic_shapes)
    package = compiler.save(compiler.compile(program, cache=False), tmp_path / "mlp.kiln").path
    s3 = s3_server.client("s3")
    before = set(_model_objects(s3))
    request = {**REQUEST, "name": "mlp_tampered_s3"}
    result = record_package(package, "mlp_tampered_s3", request)
    engine = next(k for k in _model_objects(s3) if k not in before and k.endswith(".engine"))
    data = bytearray(s3.get_object(Bucket=BUCKET, Key=engine)["Body"].read())
    data[len(data) // 2] ^= 0xFF
    s3.put_object(Bucket=BUCKET, Key=engine, Body=bytes(data))
    with pytest.raises(ArtifactVerificationError, match="does not match its checksum"):
        lookup("mlp_tampered_s3", tuple(case.args[0].shape), version=result.version)
    shape = ",".join(map(str, case.args[0].shape))
    done = preloaded.run(
        [
            sys.executable,
            "-m",
            "flows.cli",
            "lookup",
            "mlp_tampered_s3",
            "--version",
            result.version,
            "-s",
            shape,
        ],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode != 0 and "does not match its checksum" in done.stdout + done.stderr, done.stderr
