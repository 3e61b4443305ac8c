"""A fleet of two workers against real servers on 127.0.0.1: moto (S3), MLflow with its artifacts on
moto (``--artifacts-destination s3://...``), Prefect.

Two ``kiln zoo`` processes with separate local caches and workspaces compile overlapping zoos at the
same time through one engine cache on S3. What it proves:
- each unique engine is built once in the whole fleet (built engines == entries on S3);
- a model both workers compiled has one registered version (it once got one per worker, identical
  but for the measured latencies);
- the registered package's artifacts live on S3, and a look-up downloads them through the tracking
  server and verifies every checksum;
- an unreachable cache store is a warning in the summary and a run on the local layer, never a
  failed run;
- two processes opening one fresh embedded sqlite store at once both succeed (MLflow's table creation
  raced: ``the zoo run stopped before any model ran: dimension_attributes``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.fixtures import preloaded
from tests.fixtures.mlflow_server import MlflowServer
from tests.fixtures.s3_server import BUCKET, MotoServer

ROOT = Path(__file__).resolve().parents[2]
CACHE_URL = f"s3://{BUCKET}/engines"
REP3 = {
    "name": "rep3",
    "factory": "zoo.models:repeated_fallback",
    "factory_kwargs": {"depth": 3, "width": 32},
}
REP2 = {  # rep3's blocks, one fewer
    "name": "rep2",
    "factory": "zoo.models:repeated_fallback",
    "factory_kwargs": {"depth": 2, "width": 32},
}


def _zoo(path: Path, models: list[dict]) -> Path:
    settings = {
        "workspace": str(path.parent / "workspace"),
        "engine_cache": CACHE_URL,
        "tracking": True,
        "parallel_models": 1,
        "validation": {"samples": 1, "warmup": 1, "runs": 2},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"settings": settings, "models": models}))
    return path


@pytest.mark.slow
def test_two_workers_build_each_engine_once_and_register_one_version(
    s3_server: MotoServer, s3_mlflow: MlflowServer, prefect_api, tmp_path: Path
) -> None:
    workers = []
    for name, models in (("w1", [REP3]), ("w2", [REP2, REP3])):
        zoo = _zoo(tmp_path / name / "zoo.yaml", models)
        env = {**os.environ, "PYTHONPATH": str(ROOT), "KILN_CACHE_LOCAL_DIR": str(tmp_path / name / "local")}
        workers.append(
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "flows.cli",
                    "zoo",
                    str(zoo),
                    "--out",
                    str(tmp_path / name / "out"),
                    "--json",
                ],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    outputs = [w.communicate(timeout=400) for w in workers]
    for worker, (out, err) in zip(workers, outputs, strict=True):
        assert worker.returncode == 0, err[-3000:] + out[-2000:]
    summaries = [json.loads((tmp_path / n / "out" / "summary.json").read_text()) for n in ("w1", "w2")]
    assert all(s["engine_cache"]["path"] == CACHE_URL for s in summaries)
    assert not [w for s in summaries for w in s["warnings"] if "engine cache" in w]

    s3 = s3_server.client("s3")
    listed = s3.list_objects_v2(Bucket=BUCKET, Prefix="engines/entries/").get("Contents", [])
    built = sum(s["engines_built"] for s in summaries)
    reused = sum(s["engines_reused"] for s in summaries)
    assert built == len(listed) > 0  # every unique engine built once in the fleet, and published
    assert reused >= built  # rep3 twice, rep2 made of rep3's blocks

    from registry import config
    from registry.lookup import fetch_version
    from registry.models import all_versions

    mlclient = config.client()
    for model in ("rep3", "rep2"):
        assert len(all_versions(mlclient, f"kiln.{model}.cpu")) == 1, model
    package_dir, manifest, tags = fetch_version(mlclient, "kiln.rep3.cpu", "1", dst=tmp_path / "fetched")
    assert (package_dir / "manifest.json").is_file() and manifest.content_hash == tags["kiln.content_hash"]
    artifacts = s3.list_objects_v2(Bucket=BUCKET, Prefix="mlflow/").get("Contents", [])
    assert any(o["Key"].endswith("manifest.json") for o in artifacts)  # the package lives on S3

    # A store that serves a damaged engine: the download is verified against the manifest and refused.
    from registry.errors import ArtifactVerificationError

    engines = [o["Key"] for o in artifacts if "/engines/" in o["Key"]]
    assert engines
    for name in engines:
        s3.put_object(
            Bucket=BUCKET, Key=name, Body=s3.get_object(Bucket=BUCKET, Key=name)["Body"].read()[:-1]
        )
    with pytest.raises(ArtifactVerificationError, match=r"kiln\.rep3\.cpu failed verification"):
        fetch_version(mlclient, "kiln.rep3.cpu", "1", dst=tmp_path / "fetched-damaged")
    assert not (tmp_path / "fetched-damaged").exists()  # nothing unverified is left to load


def test_an_unreachable_cache_store_is_a_summary_warning(prefect_api, tmp_path: Path) -> None:
    from tests.fixtures.server_process import free_port

    zoo = _zoo(tmp_path / "zoo.yaml", [REP2])
    zoo.write_text(zoo.read_text().replace("tracking: true", "tracking: false"))
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "KILN_CACHE_LOCAL_DIR": str(tmp_path / "local"),
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",  # nothing listens there
        "AWS_ACCESS_KEY_ID": "a",
        "AWS_SECRET_ACCESS_KEY": "b",
    }
    out = tmp_path / "out"
    proc = preloaded.run(
        [sys.executable, "-m", "flows.cli", "zoo", str(zoo), "--out", str(out), "--json"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["models"][0]["status"] == "ok" and summary["engines_built"] > 0
    said = [w for w in summary["warnings"] if f"{CACHE_URL} is unreachable" in w]
    assert said and all("local cache" in w and "AWS_ENDPOINT_URL" in w for w in said), summary["warnings"]
    assert list((tmp_path / "local").glob("*.bin"))  # the engines were kept on the local layer


def test_two_processes_open_a_fresh_sqlite_store_at_once(tmp_path: Path) -> None:
    code = (
        "import sys; from registry import config; print(config.ensure_experiment(config.client(sys.argv[1])))"
    )
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("MLFLOW_TRACKING_URI", None)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, uri],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (_, err) in zip(procs, outputs, strict=True):
        assert proc.returncode == 0, err[-2000:]
    assert outputs[0][0].strip() == outputs[1][0].strip()  # one experiment, the same id


def test_meaning_hash_ignores_what_a_compile_measured_and_nothing_else() -> None:
    from compiler.package.digest import content_hash, meaning_hash

    manifest = {
        "format_version": 2,
        "files": {"engines/a.engine": {"sha256": "1" * 64, "bytes": 10}},
        "plan": {"options": {"precision": "fp32"}},
        "report": {"stage_seconds": {"build": 1.5}, "cache_hits": 0},
        "validation": {"latency": {"median_ms": 2.0}},
    }
    other_worker = {**manifest, "report": {"stage_seconds": {"build": 0.1}, "cache_hits": 3}}
    other_worker["validation"] = {"latency": {"median_ms": 2.7}}
    assert meaning_hash(manifest) == meaning_hash(other_worker)
    assert content_hash(manifest) != content_hash(other_worker)  # the bytes still differ, and say so
    rebuilt = {**manifest, "files": {"engines/a.engine": {"sha256": "2" * 64, "bytes": 10}}}
    assert meaning_hash(rebuilt) != meaning_hash(manifest)
