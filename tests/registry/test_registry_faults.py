"""Faults: the real tracking server stopped and restarted while packages are being recorded.

Each scenario stops the session's `mlflow server` at a point where a record is half done, and checks
that nothing is lost: the package stays on disk untouched, the failure is a typed error that names the
run, and the next attempt completes the same run and registers exactly one version.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch.export import Dim

import compiler
from registry.config import RetryPolicy
from registry.errors import RegistryUnavailableError
from registry.models import all_versions, content_hash_of, registered_model_name
from registry.tracking import TAG_CONTENT_HASH, record_package
from tests.fixtures.mlflow_server import MlflowServer
from zoo.models import mlp_with_fallback

MODEL = "mlp_faults"
REQUEST = {"name": MODEL, "source": "factory:zoo.models:mlp_with_fallback"}


@pytest.fixture(scope="module")
def base_package(tmp_path_factory: pytest.TempPathFactory) -> Path:
    case = mlp_with_fallback(width=32)
    program = compiler.export(
        case.model, (torch.randn(4, 32),), dynamic_shapes=({0: Dim("batch", min=1, max=16)},)
    )
    compiled = compiler.compile(program)
    report = compiler.validate(case.model, compiled, samples=1, warmup=1, runs=3)
    return compiler.save(compiled, tmp_path_factory.mktemp("faults") / "base.kiln", validation=report).path


def _variant(base: Path, dst: Path, seed: int) -> Path:
    """Another package of the same structure with other weights: new content, no rebuild."""
    shutil.copytree(base, dst)
    generator = torch.Generator().manual_seed(seed)
    weights = compiler.load(dst).weights
    compiler.refit_package(dst, {k: torch.randn(v.shape, generator=generator) for k, v in weights.items()})
    return dst


def _snapshot(package: Path) -> dict[str, bytes]:
    return {str(p.relative_to(package)): p.read_bytes() for p in sorted(package.rglob("*")) if p.is_file()}


def _wait_for_run(uri: str, content_hash: str, timeout: float = 120.0) -> str:
    import mlflow

    client = mlflow.MlflowClient(uri)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        experiment = client.get_experiment_by_name("kiln")
        if experiment is not None:
            runs = client.search_runs(
                [experiment.experiment_id], filter_string=f"tags.`{TAG_CONTENT_HASH}` = '{content_hash}'"
            )
            if runs:
                return runs[0].info.run_id
        time.sleep(0.02)
    raise AssertionError(f"no run for {content_hash[:12]} appeared within {timeout}s")


class _Recorder(threading.Thread):
    def __init__(self, package: Path, policy: RetryPolicy):
        super().__init__(daemon=True)
        self.package, self.policy = package, policy
        self.result, self.error = None, None

    def run(self) -> None:
        try:
            self.result = record_package(self.package, MODEL, REQUEST, {"status": "ok"}, policy=self.policy)
        except BaseException as exc:
            self.error = exc


def test_server_lost_mid_run_fails_cleanly_and_a_rerun_completes_the_same_run(
    mlflow_server: MlflowServer,
    base_package,
    tmp_path,
):
    import mlflow

    package = _variant(base_package, tmp_path / "v1.kiln", seed=1)
    content_hash = compiler.read_manifest(package).content_hash
    before = _snapshot(package)
    recorder = _Recorder(package, RetryPolicy(attempts=2, base_delay=0.2, max_delay=0.2))
    try:
        recorder.start()
        run_id = _wait_for_run(mlflow_server.uri, content_hash)
        mlflow_server.stop()  # the run exists; its params, artifacts, model and version do not yet
        recorder.join(timeout=120)
        assert isinstance(recorder.error, RegistryUnavailableError), recorder.error
        assert recorder.error.run_id == run_id and recorder.error.package_dir == str(package.resolve())
        assert "re-run to complete it" in str(recorder.error)
        assert _snapshot(package) == before  # nothing lost, nothing touched

        # While the server is away, another model's logging step fails fast with the same typed error.
        other = _variant(base_package, tmp_path / "v2.kiln", seed=2)
        started = time.monotonic()
        with pytest.raises(RegistryUnavailableError, match="did not answer after 2 attempts"):
            record_package(
                other, MODEL, REQUEST, policy=RetryPolicy(attempts=2, base_delay=0.2, max_delay=0.2)
            )
        assert time.monotonic() - started < 30
    finally:
        mlflow_server.start()

    client = mlflow.MlflowClient(mlflow_server.uri)
    assert client.get_run(run_id).info.status in ("RUNNING", "FAILED")  # not finished, not lost
    name = registered_model_name("mlp_faults", "cpu")
    assert not [v for v in all_versions(client, name) if content_hash_of(v.tags) == content_hash]

    again = record_package(package, MODEL, REQUEST, {"status": "ok"})
    assert again.resumed and again.run_id == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.data.tags["kiln.complete"] == "true"
    assert run.data.metrics["package_bytes"] > 0
    matching = [v for v in all_versions(client, name) if content_hash_of(v.tags) == content_hash]
    assert [v.version for v in matching] == [again.version]


def test_server_restart_mid_run_is_ridden_out_by_back_off(
    mlflow_server: MlflowServer,
    base_package,
    tmp_path,
    caplog,
):
    import mlflow

    package = _variant(base_package, tmp_path / "v3.kiln", seed=3)
    content_hash = compiler.read_manifest(package).content_hash
    # Enough patience to outlast a restart (~15 s here): 0.5 + 1 + 2 + 4 + 4 * 8 s.
    recorder = _Recorder(package, RetryPolicy(attempts=13, base_delay=0.5, max_delay=4.0))
    caplog.set_level(logging.WARNING, logger="kiln.registry")
    try:
        recorder.start()
        run_id = _wait_for_run(mlflow_server.uri, content_hash)
        mlflow_server.restart()
    finally:
        mlflow_server.start()
    recorder.join(timeout=240)
    assert recorder.error is None, recorder.error
    result = recorder.result
    assert result.created and result.run_id == run_id and not result.resumed
    assert any("retry" in r.getMessage() for r in caplog.records)  # it really waited for the server
    client = mlflow.MlflowClient(mlflow_server.uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    version = client.get_model_version(result.registered_model, result.version)
    assert version.tags[TAG_CONTENT_HASH] == content_hash


OPEN_A_ZOO_RUN = """
import sys, time
from registry.zoo_runs import start_zoo_run
print(start_zoo_run("zoo-killed", {"zoo": "z.yaml"}), flush=True)
time.sleep(600)
"""


def test_a_zoo_run_whose_process_died_is_ended_by_the_next_zoo_run(mlflow_server: MlflowServer) -> None:
    import os
    import signal
    import subprocess
    import sys

    import mlflow

    from registry.zoo_runs import start_zoo_run

    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "MLFLOW_TRACKING_URI": mlflow_server.uri}
    holder = subprocess.Popen(
        [sys.executable, "-c", OPEN_A_ZOO_RUN], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        killed = holder.stdout.readline().strip()
    finally:
        holder.send_signal(signal.SIGKILL)  # the zoo run is left open, as after a kill or a lost server
        holder.wait()
    client = mlflow.MlflowClient(mlflow_server.uri)
    assert client.get_run(killed).info.status == "RUNNING"
    mlflow.set_tracking_uri(mlflow_server.uri)
    live = start_zoo_run("zoo-next", {"zoo": "z.yaml"})
    assert client.get_run(killed).info.status == "KILLED"
    assert "process ended" in client.get_run(killed).data.tags["kiln.error"]
    # A live process's run is left alone: this one is still RUNNING after another zoo run starts.
    third = start_zoo_run("zoo-third", {"zoo": "z.yaml"})
    assert client.get_run(live).info.status == "RUNNING"
    for run_id in (live, third):
        client.set_terminated(run_id)


def test_runs_logging_the_same_data_at_once_all_log_it(tmp_path: Path) -> None:
    """The models of one zoo run, recorded at once, log the same recorded data as an MLflow dataset: the
    store looks the dataset up, then inserts it, and every run but the first to insert was refused
    ("UNIQUE constraint failed: datasets...", which failed a model of `kiln zoo`). Each run logs it."""
    import mlflow
    import numpy as np
    from mlflow import MlflowClient
    from mlflow.entities import DatasetInput

    from registry.config import log_inputs

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("zoo")
    runs = [client.create_run(experiment).info.run_id for _ in range(6)]
    for round_ in range(3):  # without the retry, 22 of 30 such calls failed here
        data = mlflow.data.from_numpy(np.random.default_rng(round_).random((8, 4)), name=f"recorded-{round_}")
        dataset = DatasetInput(data._to_mlflow_entity(), [])
        together = threading.Barrier(len(runs))

        def log(run_id: str, dataset: DatasetInput = dataset, together: threading.Barrier = together) -> None:
            together.wait()  # all at once
            log_inputs(client, run_id, [dataset])

        with ThreadPoolExecutor(len(runs)) as pool:
            list(pool.map(log, runs))  # a refused call raises here
    for run_id in runs:
        logged = sorted(d.dataset.name for d in client.get_run(run_id).inputs.dataset_inputs)
        assert logged == ["recorded-0", "recorded-1", "recorded-2"], (run_id, logged)
