"""Serving registered versions on the real Triton Inference Server (issue 33), on the CPU.

One registry (embedded sqlite) with three versions of a tiny model (one graph, three sets of weights,
so each version answers differently), one repository written by ``kiln serve triton export`` and one
``tritonserver`` started by ``kiln serve triton run`` on free 127.0.0.1 ports, shared by the file. The
tests run in file order and build on each other's registry and server state: v1 champion -> release
v2 under load -> rollback to v1 -> two releases at once -> a tampered candidate -> a silent server ->
no champion.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.export import Dim

import compiler
from registry.errors import ReleaseError
from registry.models import CHAMPION, PREVIOUS, TAG_ROLLED_BACK, get_aliases, set_alias
from registry.release import GateReport, apply_decision, rollback
from serving.triton.config import ServedModel, TensorSig, render_config
from serving.triton.control import TritonControl
from serving.triton.errors import (
    NoChampionError,
    RepositoryBusyError,
    RepositoryError,
    ServerRefusedError,
    ServerStartError,
    ServerUnavailableError,
    TritonConfigError,
)
from serving.triton.live import TritonRelease
from serving.triton.repository import backend_bytes, export, repository_lock
from serving.triton.server import TritonServer
from tests.fixtures.server_process import free_port
from tests.fixtures.triton_server import kiln_triton

ROOT = Path(__file__).resolve().parents[2]
NAME = "kiln.tiny.cpu"
HASH = "ab" * 32
TOL = 1e-6


class Tiny(torch.nn.Module):
    """x [batch, seq, 8] -> [batch, 4]: two dynamic axes, so a seq outside the range reaches kiln."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)).mean(dim=1)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Versions 1..3 of kiln.tiny.cpu recorded in an embedded store; champion -> 1."""
    from registry import config
    from registry.tracking import record_package

    root = tmp_path_factory.mktemp("triton")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    torch.manual_seed(0)
    model = Tiny()
    program = compiler.export(
        model,
        (torch.randn(4, 6, 8),),
        dynamic_shapes=({0: Dim("batch", min=1, max=16), 1: Dim("seq", min=2, max=12)},),
    )
    compiled = compiler.compile(program, profiles=({"batch": 4}, {"batch": 8}))
    packages = {"1": compiler.save(compiled, root / "v1.kiln").path}
    for version in ("2", "3"):
        path = root / f"v{version}.kiln"
        shutil.copytree(packages["1"], path)
        generator = torch.Generator().manual_seed(int(version))
        weights = compiler.load(path).weights
        compiler.refit_package(
            path, {k: torch.randn(v.shape, generator=generator) for k, v in weights.items()}
        )
        packages[version] = path
    with contextlib.chdir(root):  # the embedded store keeps artifacts under the working folder
        for version, path in packages.items():
            assert record_package(path, "tiny", {"name": "tiny"}, tracking_uri=uri).version == version
    set_alias(config.client(uri), NAME, CHAMPION, "1")
    modules = {v: compiler.load(p) for v, p in packages.items()}
    return {"root": root, "uri": uri, "packages": packages, "modules": modules}


@pytest.fixture(scope="module")
def repository(store: dict) -> Path:
    repo = store["root"] / "repository"
    # A long queue delay so that concurrent clients are batched even on a busy 2-core machine.
    export(["tiny"], repo, tracking_uri=store["uri"], queue_delay_us=20000)
    return repo


@pytest.fixture(scope="module")
def server(store: dict, repository: Path):
    """``kiln serve triton run`` in the foreground of its own process group, as an operator runs it."""
    with kiln_triton(store["root"], repository, start_timeout=180) as run:
        yield {
            "http": run.http,
            "grpc": run.grpc,
            "pid": run.pid,
            "control": run.control,
            "log": run.log_path,
        }


def _infer_http(url: str, x: np.ndarray) -> tuple[np.ndarray, str]:
    import tritonclient.http as http

    tensor = http.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    # Closed after each request: a kept-alive connection holds the server's exit for its 10 s timeout.
    with http.InferenceServerClient(url) as client:
        result = client.infer("tiny", [tensor])
    return result.as_numpy("output_0"), result.get_response()["model_version"]


def _infer_grpc(url: str, x: np.ndarray) -> tuple[np.ndarray, str]:
    import tritonclient.grpc as grpc

    tensor = grpc.InferInput("x", list(x.shape), "FP32")
    tensor.set_data_from_numpy(x)
    with grpc.InferenceServerClient(url) as client:
        result = client.infer("tiny", [tensor])
    return result.as_numpy("output_0"), result.get_response().model_version


def _expected(store: dict, version: str, x: np.ndarray) -> np.ndarray:
    return store["modules"][version](torch.from_numpy(x)).numpy()


def _x(batch: int = 3, seq: int = 5, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((batch, seq, 8)).astype(np.float32)


def _live(store: dict, server: dict, repository: Path, **kw) -> TritonRelease:
    return TritonRelease(server["http"], repository, "tiny", tracking_uri=store["uri"], **kw)


def _aliases(store: dict) -> dict[str, str]:
    from registry import config

    return get_aliases(config.client(store["uri"]), NAME)


def test_export_writes_a_repository_triton_loads_from_the_registry(store, repository, server):
    model_dir = repository / "tiny"
    config = (model_dir / "config.pbtxt").read_text()
    assert 'name: "tiny"' in config and 'backend: "python"' in config
    assert "max_batch_size: 16" in config  # the batch range's maximum
    assert "version_policy: { specific: { versions: [ 1 ] } }" in config  # exactly the champion
    assert '{ name: "x" data_type: TYPE_FP32 dims: [ -1, 8 ] }' in config  # seq dynamic, batch implicit
    assert '{ name: "output_0" data_type: TYPE_FP32 dims: [ 4 ] }' in config
    assert "preferred_batch_size" not in config  # on the CPU every batch size runs alike (config.py)
    assert ServedModel.from_json((model_dir / "1" / "kiln.json").read_text(), "x").preferred_batch_sizes == (
        4,
        8,
    )
    assert "max_queue_delay_microseconds: 20000" in config
    assert "instance_group [ { kind: KIND_CPU count: 1 } ]" in config
    assert 'parameters: { key: "kiln_threads" value: { string_value: "0" } }' in config  # automatic
    # The stub applied it (cores less one for Triton's front end) and logged what its load cost.
    from serving.triton.runtime import available_cores, instance_threads

    loaded = re.search(
        r"kiln: tiny version 1 ready in [0-9.]+ s \(torch [0-9.]+ s, verify and load [0-9.]+ s, "
        r"warm-up [0-9.]+ s; (\d+) intra-op threads\)",
        server["log"].read_text(),
    )
    assert loaded and int(loaded.group(1)) == instance_threads(0, 1, available_cores())
    assert (model_dir / "1" / "model.py").read_bytes() == backend_bytes()
    assert (
        compiler.read_manifest(model_dir / "1" / "package").content_hash
        == compiler.read_manifest(store["packages"]["1"]).content_hash
    )
    assert sorted(p.name for p in model_dir.iterdir() if p.is_dir()) == ["1"]  # no previous yet
    assert server["control"].served_versions("tiny") == ["1"]


def test_http_and_grpc_answers_equal_the_package_loaded_by_compiler_load(store, server):
    x = _x(3, 5)
    expected = _expected(store, "1", x)
    by_http, version = _infer_http(server["http"], x)
    by_grpc, _ = _infer_grpc(server["grpc"], x)
    assert version == "1"
    np.testing.assert_allclose(by_http, expected, rtol=0, atol=TOL)
    np.testing.assert_allclose(by_grpc, expected, rtol=0, atol=TOL)


def test_an_input_outside_the_declared_range_is_refused_with_the_reason(server):
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as caught:
        _infer_http(server["http"], _x(2, 20))  # seq 20 > 12
    message = str(caught.value)
    assert "InputSpecError" in message and "'x'" in message and "(16, 12, 8)" in message
    answer, _ = _infer_http(server["http"], _x(2, 12))  # the server still answers in range
    assert answer.shape == (2, 4)


def test_concurrent_clients_are_batched(store, server):
    before = _batches(server)
    x = _x(1, 6, seed=3)
    expected = _expected(store, "1", x)
    failures: list[str] = []

    def client() -> None:
        for _ in range(8):
            try:
                answer, _ = _infer_http(server["http"], x)
                np.testing.assert_allclose(answer, expected, rtol=0, atol=TOL)
            except Exception as exc:  # counted, asserted below
                failures.append(repr(exc))

    threads = [threading.Thread(target=client) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
    after = _batches(server)
    grown = {size: after.get(size, 0) - before.get(size, 0) for size in after}
    assert sum(size * n for size, n in grown.items()) == 16 * 8
    assert any(size > 1 and n > 0 for size, n in grown.items()), grown


def _batches(server: dict) -> dict[int, int]:
    stats = server["control"].statistics("tiny")["model_stats"]
    return {
        int(b["batch_size"]): int(b["compute_infer"]["count"])
        for s in stats
        for b in s.get("batch_stats", [])
    }


def _steady_load(server: dict, stop: threading.Event, seen: Counter, x: np.ndarray) -> None:
    while not stop.is_set():
        try:
            _, version = _infer_http(server["http"], x)
            seen[version] += 1
        except Exception as exc:
            seen[f"error: {exc}"] += 1


def _until(condition, timeout: float = 60.0) -> None:
    """Wait for ``condition()`` (polled every 10 ms); fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not reached within {timeout} s"
        time.sleep(0.01)


def test_a_release_under_steady_load_swaps_versions_with_no_failed_request(store, server, repository):
    stop, seen = threading.Event(), Counter()
    x = _x(2, 4, seed=5)
    clients = [threading.Thread(target=_steady_load, args=(server, stop, seen, x)) for _ in range(4)]
    for t in clients:
        t.start()
    try:
        _until(lambda: seen["1"] >= 8)  # the load is on before the release starts
        started = time.monotonic()
        outcome = apply_decision(
            GateReport(NAME, "2", "1", {}, {}),
            tracking_uri=store["uri"],
            live=_live(store, server, repository),
        )
        took = time.monotonic() - started
        answered = seen["2"]
        _until(lambda: seen["2"] >= answered + 8)  # and still on once the new version serves
    finally:
        stop.set()
        for t in clients:
            t.join()
    errors = {k: n for k, n in seen.items() if k.startswith("error")}
    assert not errors, errors
    assert seen["1"] > 0 and seen["2"] > 0, seen
    assert (outcome.champion, outcome.previous) == ("2", "1")
    assert server["control"].served_versions("tiny") == ["2"]
    answer, version = _infer_http(server["http"], x)
    assert version == "2"
    np.testing.assert_allclose(answer, _expected(store, "2", x), rtol=0, atol=TOL)
    # champion and previous are both in the repository: a rollback downloads nothing
    assert sorted(p.name for p in (repository / "tiny").iterdir() if p.is_dir()) == ["1", "2"]
    assert took < 60, took


def test_kiln_rollback_with_triton_restores_the_previous_version(store, server, repository):
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(
        app,
        [
            "rollback",
            "tiny",
            "--triton",
            server["http"],
            "--repository",
            str(repository),
            "--tracking-uri",
            store["uri"],
        ],
    )
    assert result.exit_code == 0, result.output
    assert _aliases(store) == {CHAMPION: "1"}
    x = _x(2, 7, seed=6)
    answer, version = _infer_http(server["http"], x)
    assert version == "1"
    np.testing.assert_allclose(answer, _expected(store, "1", x), rtol=0, atol=TOL)
    assert server["control"].served_versions("tiny") == ["1"]
    assert sorted(p.name for p in (repository / "tiny").iterdir() if p.is_dir()) == ["1"]
    from registry import config

    assert TAG_ROLLED_BACK in config.client(store["uri"]).get_model_version(NAME, "2").tags


def test_two_releases_at_once_one_wins_and_the_other_is_refused(store, server, repository):
    results: dict[str, object] = {}

    def release(version: str) -> None:
        try:
            results[version] = apply_decision(
                GateReport(NAME, version, "1", {}, {}),
                tracking_uri=store["uri"],
                live=_live(store, server, repository),
            )
        except Exception as exc:
            results[version] = exc

    threads = [threading.Thread(target=release, args=(v,)) for v in ("2", "3")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    won = [v for v, r in results.items() if not isinstance(r, Exception)]
    lost = [v for v, r in results.items() if isinstance(r, Exception)]
    assert len(won) == 1 and len(lost) == 1, results
    assert isinstance(results[lost[0]], ReleaseError) and "champion moved" in str(results[lost[0]])
    assert _aliases(store) == {CHAMPION: won[0], PREVIOUS: "1"}
    assert server["control"].served_versions("tiny") == [won[0]]
    store["won"], store["lost"] = won[0], lost[0]
    # A writer holding the repository is refused at once, not queued behind it.
    live = _live(store, server, repository)
    with repository_lock(live.repository, "tiny"), pytest.raises(RepositoryBusyError, match="tiny"):
        apply_decision(GateReport(NAME, lost[0], won[0], {}, {}), tracking_uri=store["uri"], live=live)
    assert _aliases(store) == {CHAMPION: won[0], PREVIOUS: "1"}


def test_a_tampered_package_is_refused_at_load_and_the_server_keeps_serving(store, server, repository):

    won, lost = store["won"], store["lost"]
    model_dir = repository / "tiny"
    # Staged by a fresh process, as a release staging it would: same program as the staged versions,
    # so its signature is theirs and the process never imports torch (nor any torch submodule).
    code = (
        "import sys, pathlib; from registry import config; "
        "from serving.triton.repository import stage_version; "
        f"_, created = stage_version(config.client({store['uri']!r}), pathlib.Path(sys.argv[1]), "
        f"'tiny', {NAME!r}, {lost!r}); print('created' if created else 'kept', "
        "sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    staged = subprocess.run(
        [sys.executable, "-c", code, str(model_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        check=False,
    )
    assert staged.returncode == 0, staged.stderr[-3000:]
    assert staged.stdout.strip() == "created []", staged.stdout  # staged here, and no torch module loaded
    assert ServedModel.from_json((model_dir / lost / "kiln.json").read_text(), "x").version == lost
    weights = model_dir / lost / "package" / "weights.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    before = (model_dir / "config.pbtxt").read_text()
    with pytest.raises(ReleaseError) as caught:
        apply_decision(
            GateReport(NAME, lost, won, {}, {}),
            tracking_uri=store["uri"],
            live=_live(store, server, repository),
        )
    cause = caught.value.__cause__
    assert isinstance(cause, ServerRefusedError) and "weights.safetensors" in cause.server_message
    assert _aliases(store) == {CHAMPION: won, PREVIOUS: "1"}  # nothing moved
    assert (model_dir / "config.pbtxt").read_text() == before
    assert not (model_dir / lost).exists()  # a later release downloads it afresh
    x = _x(4, 3, seed=7)
    answer, version = _infer_http(server["http"], x)
    assert version == won
    np.testing.assert_allclose(answer, _expected(store, won, x), rtol=0, atol=TOL)


def _tritonserver_child(pid: int) -> int:
    """The tritonserver process `kiln serve triton run` started, found by name (not as the first child
    listed: a CI run once saw the "stopped" server answer, cause not pinned down)."""
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        with contextlib.suppress(OSError):  # a child that exited since
            if Path(f"/proc/{child}/comm").read_text().strip() == "tritonserver":
                found.append(int(child))
    (server,) = found
    return server


def _wait_stopped(pid: int, within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    while Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop within {within} s"
        time.sleep(0.01)


def test_a_server_that_does_not_answer_is_named_with_its_timeout_and_nothing_moves(store, server, repository):
    triton_pid = _tritonserver_child(server["pid"])
    before = _aliases(store)
    config_before = (repository / "tiny" / "config.pbtxt").read_text()
    folders = sorted(p.name for p in (repository / "tiny").iterdir())
    os.kill(triton_pid, signal.SIGSTOP)
    _wait_stopped(triton_pid)  # every thread of it stopped before the check is sent
    try:
        live = _live(store, server, repository, timeout=0.5, load_timeout=0.5)
        with pytest.raises(ServerUnavailableError, match=r"within 0.5 s \(timeout\)"):
            live.check()
        with pytest.raises(ReleaseError) as caught:
            rollback("tiny", to_version="1", tracking_uri=store["uri"], live=live)
        assert isinstance(caught.value.__cause__, ServerUnavailableError)
        assert "within 0.5 s (timeout)" in str(caught.value)
    finally:
        os.kill(triton_pid, signal.SIGCONT)
    assert _aliases(store) == before
    assert (repository / "tiny" / "config.pbtxt").read_text() == config_before
    assert sorted(p.name for p in (repository / "tiny").iterdir()) == folders
    # The load it was sent while stopped reads the restored config; a load of our own queues behind it.
    server["control"].load("tiny")
    assert server["control"].served_versions("tiny") == [before[CHAMPION]]
    # Nothing listening there at all: refused before anything is measured or moved.
    nowhere = TritonRelease(f"127.0.0.1:{free_port()}", repository, "tiny", tracking_uri=store["uri"])
    with pytest.raises(ServerUnavailableError, match="cannot be reached"):
        nowhere.check()
    with pytest.raises(ReleaseError) as caught:
        rollback("tiny", to_version="1", tracking_uri=store["uri"], live=nowhere)
    assert isinstance(caught.value.__cause__, ServerUnavailableError)
    assert _aliases(store) == before
    assert (repository / "tiny" / "config.pbtxt").read_text() == config_before
    assert sorted(p.name for p in (repository / "tiny").iterdir()) == folders  # previous's folder kept


def test_a_dtype_triton_has_no_type_for_is_refused_naming_the_input():
    with pytest.raises(TritonConfigError, match=r"input 'scales' of kiln.q.cpu has dtype float8_e4m3fn"):
        ServedModel(
            "q",
            "kiln.q.cpu",
            "1",
            HASH,
            "cpu",
            (TensorSig("x", "float32", (-1, 4)), TensorSig("scales", "float8_e4m3fn", (4,))),
            (TensorSig("y", "float32", (-1, 4)),),
        )
    served = ServedModel(
        "q",
        "kiln.q.cpu",
        "1",
        HASH,
        "cuda:sm_90",
        (TensorSig("x", "int64", (-1, 7)),),
        (TensorSig("y", "bool", (-1, 7)),),
    )
    text = render_config(served)
    assert "max_batch_size: 0" in text and "dims: [ -1, 7 ]" in text and "KIND_GPU" in text
    assert "dynamic_batching" not in text  # not batched: no batch axis
    batched = ServedModel(
        "q", "kiln.q.cpu", "1", HASH, "cuda:sm_90", (TensorSig("x", "float32", (-1, 4)),),
        (TensorSig("y", "float32", (-1, 4)),), 16, (4, 8),
    )  # fmt: skip
    assert "preferred_batch_size: [ 4, 8 ]" in render_config(batched)  # a GPU's captured profile sizes
    with pytest.raises(TritonConfigError, match=r"threads \(0: automatic\) is -1; expected an integer >= 0"):
        render_config(batched, threads=-1)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        (
            "registered_model",
            'kiln.q.cpu version 1\ndefault_model_filename: "evil.py"',
            "the registered model",
        ),
        ("version", '1\nbackend: "onnxruntime"', "the version"),
        ("version", 1, "the version"),
        ("name", 'q" backend: "x', "the model name"),
        ("engine_target", "cpu\n", "the engine target"),
        ("max_batch_size", "8", "max_batch_size"),
        ("max_batch_size", True, "max_batch_size"),
        ("preferred_batch_sizes", ["4"], "a preferred batch size"),
        ("inputs", [{"name": "x\ny", "dtype": "float32", "shape": [-1, 4]}], "a tensor name"),
        ("outputs", [{"name": "y", "dtype": "float32", "shape": ["-1", 4]}], "tensor 'y' shape"),
    ],
)
def test_a_served_record_that_could_change_the_config_is_refused_by_field(tmp_path, field, value, named):
    """kiln.json is read back on every release and rollback: a value that would add config lines (a
    newline in a name, a version that is not digits) or a number written as a string is refused by
    name, before anything is rendered."""
    good = ServedModel(
        "q", "kiln.q.cpu", "1", HASH, "cpu", (TensorSig("x", "float32", (-1, 4)),),
        (TensorSig("y", "float32", (-1, 4)),), 8, (4,),
    )  # fmt: skip
    data = json.loads(good.to_json())
    assert ServedModel.from_json(json.dumps(data), "kiln.json") == good
    data[field] = value
    with pytest.raises(TritonConfigError, match=re.escape(named)) as caught:
        ServedModel.from_json(json.dumps(data), "kiln.json")
    assert "kiln.json" in str(caught.value)


def test_serving_settings_with_a_mistyped_field_are_a_repository_error_naming_it(tmp_path):
    from serving.triton.repository import SETTINGS_FILE, ServingSettings

    good = ServingSettings("kiln.q.cpu", "q", "cpu", 1000, 1, 0)
    (tmp_path / SETTINGS_FILE).write_text(good.to_json())
    assert ServingSettings.read(tmp_path) == good
    for field, value in (("instances", "2"), ("queue_delay_us", -1), ("model", "q\nx"), ("threads", 1.5)):
        data = json.loads(good.to_json())
        data[field] = value
        (tmp_path / SETTINGS_FILE).write_text(json.dumps(data))
        with pytest.raises(RepositoryError, match=field):
            ServingSettings.read(tmp_path)


def test_a_repository_the_server_cannot_read_is_refused(tmp_path):
    from typer.testing import CliRunner

    from flows.cli import app

    missing = tmp_path / "nowhere"
    with pytest.raises(RepositoryError, match="does not exist"):
        TritonServer(missing)
    # An object-store URL is named and refused; nothing is created locally (export used to make ./s3:).
    with contextlib.chdir(tmp_path):
        for url in ("s3://models/kiln/repo", "gs://models/repo"):
            with pytest.raises(RepositoryError, match=f"{url.split(':')[0]} URL"):
                export(["tiny"], url)
            with pytest.raises(RepositoryError, match=f"{url.split(':')[0]} URL"):
                TritonServer(url)
        assert sorted(p.name for p in tmp_path.iterdir()) == []
    result = CliRunner().invoke(app, ["serve", "triton", "run", "--repository", str(tmp_path / "x.txt")])
    assert result.exit_code == 2 and "RepositoryError" in result.output
    broken = tmp_path / "repo" / "broken"
    broken.mkdir(parents=True)
    (broken / "config.pbtxt").write_text("name: broken backend: [")
    with pytest.raises(ServerStartError, match="broken"):
        TritonServer(tmp_path / "repo", http_port=free_port(), grpc_port=free_port()).start(timeout=60)


def test_the_kserve_runtime_loads_the_exported_repository(store, repository, tmp_path):
    """deploy/kserve's runtime arguments, run by the same server binary on the exported repository
    (KServe copies storageUri to /mnt/models); only the listen addresses are this machine's."""
    import yaml

    from serving.triton.server import backend_directory, find_tritonserver, server_environment

    runtime, service = yaml.safe_load_all((ROOT / "deploy" / "kserve" / "kiln-triton.yaml").read_text())
    predictor = service["spec"]["predictor"]["model"]
    assert (service["kind"], runtime["kind"]) == ("InferenceService", "ServingRuntime")
    assert predictor["runtime"] == runtime["metadata"]["name"] and predictor["storageUri"]
    assert predictor["modelFormat"]["name"] in [f["name"] for f in runtime["spec"]["supportedModelFormats"]]
    container = runtime["spec"]["containers"][0]
    http, grpc = free_port(), free_port()
    ports = {
        "--model-store=/mnt/models": f"--model-store={repository}",
        "--http-port=8080": f"--http-port={http}",
        "--grpc-port=9000": f"--grpc-port={grpc}",
    }
    assert container["args"][0] == "tritonserver" and set(ports) <= set(container["args"])
    install = find_tritonserver()
    command = [str(install.binary), *(ports.get(a, a) for a in container["args"][1:])]
    command += [f"--backend-directory={backend_directory(install, tmp_path)}", "--allow-metrics=false"]
    command += ["--http-address=127.0.0.1", "--grpc-address=127.0.0.1"]
    env = server_environment({e["name"]: e["value"] for e in container.get("env", [])})
    with open(tmp_path / "kserve.log", "wb") as log:
        proc = subprocess.Popen(
            command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        control = TritonControl(f"127.0.0.1:{http}", timeout=2)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(ServerUnavailableError):
                control.ready()
                break
            time.sleep(0.2)
        assert proc.poll() is None, (tmp_path / "kserve.log").read_text()[-3000:]
        assert control.served_versions("tiny") == [store["won"]]
        x = _x(2, 9, seed=8)
        answer, version = _infer_grpc(f"127.0.0.1:{grpc}", x)
        assert version == store["won"]
        np.testing.assert_allclose(answer, _expected(store, store["won"], x), rtol=0, atol=TOL)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_model_with_no_champion_is_a_typed_error_naming_it_and_its_aliases(store, repository):
    from typer.testing import CliRunner

    from flows.cli import app
    from registry import config

    mlclient = config.client(store["uri"])
    set_alias(mlclient, NAME, CHAMPION, None)  # last test: the registry keeps only previous
    before = sorted(str(p.relative_to(repository)) for p in repository.rglob("*"))
    (failure,) = export(["tiny"], repository, tracking_uri=store["uri"])
    assert failure.error == NoChampionError.__name__
    assert "previous -> 1" in failure.message and "kiln release tiny" in failure.message
    assert sorted(str(p.relative_to(repository)) for p in repository.rglob("*")) == before  # as it was
    result = CliRunner().invoke(
        app,
        [
            "serve",
            "triton",
            "export",
            "nothing",
            "--repository",
            str(repository),
            "--tracking-uri",
            store["uri"],
        ],
    )
    # registry.targets: nothing is registered for the model under any engine target
    assert result.exit_code == 1 and "nothing is registered for 'nothing'" in result.output
    assert "not exported" in result.output and not (repository / "nothing").exists()
