"""What a kill, a tampered workspace or a second run must not break, against a real Prefect server."""

from __future__ import annotations

import contextvars
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]

HOLD_SLOT = """
import sys, time
from tasks.concurrency import build_slot
with build_slot("cpu:slot-test"):
    print("held", flush=True)
    time.sleep(600)
"""

# A run on its own temporary server (as `kiln zoo` without PREFECT_API_URL) whose build holds a slot
# (the kiln flows' runner and server; a tiny flow instead of a zoo, to be quick).
HOLD_SLOT_IN_A_FLOW = """
import time
from prefect import flow, task
from flows.runners import PromptThreadPoolTaskRunner
from flows.server import prefect_api
from tasks.concurrency import build_slot, ensure_limits

@task
def build():
    with build_slot("cpu:slot-test"):
        print("held", flush=True)
        time.sleep(600)

@flow(task_runner=PromptThreadPoolTaskRunner(max_workers=1))  # as kiln's flows
def zoo():
    build.submit().result()

with prefect_api():
    ensure_limits({"cpu:slot-test": 1})
    zoo()
"""

WAIT_FOR_SLOT = """
import time
from flows.server import prefect_api
from tasks.concurrency import build_slot
with prefect_api():
    start = time.monotonic()
    with build_slot("cpu:slot-test", timeout=150):
        print(f"waited {time.monotonic() - start:.1f}", flush=True)
"""


CHECKS_DEAD_HOLDERS = "test_a_killed_build_frees_its_slot_on_a_real_and_on_a_temporary_server"


@pytest.fixture(scope="module", autouse=True)
def dead_slot_holders(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict | None]:
    """Holders of the build slot ``cpu:slot-test`` on the real server and on two temporary ones, killed
    before the module's first test, and the waiters for the slot, started then. What a dead holder's
    slot needs is its lease's end (60 s, the shortest Prefect's server accepts: an API bound, no
    setting), and it comes whatever else runs meanwhile: here the module's other tests, not an idle
    minute. Records what it saw; the test asserts it."""
    from tasks.concurrency import BuildSlotTimeoutError, build_slot, ensure_limits

    if not any(item.originalname == CHECKS_DEAD_HOLDERS for item in request.session.items):
        yield None  # that test is not run (-k, -m "not slow"): nothing to start
        return
    request.getfixturevalue("prefect_api")
    tmp_path = tmp_path_factory.mktemp("slot-holders")
    ensure_limits({"cpu:slot-test": 1})
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    # The temporary server's runs share one PREFECT_HOME (database and leases), as on a user's machine.
    temporary = {k: v for k, v in env.items() if k != "PREFECT_API_URL"}
    temporary["PREFECT_HOME"] = str(tmp_path / "home")
    # Another user's machine, whose run is ended by SIGKILL (the case: no exit path runs at all).
    killed_home = {**temporary, "PREFECT_HOME": str(tmp_path / "home-killed")}
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_SLOT], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    run, killed_run = (
        subprocess.Popen(
            [sys.executable, "-c", HOLD_SLOT_IN_A_FLOW], cwd=ROOT, env=e, stdout=subprocess.PIPE, text=True
        )
        for e in (temporary, killed_home)
    )
    seen: dict = {"refused": None}
    try:
        seen["held"] = [p.stdout.readline().strip() for p in (holder, run, killed_run)]
        try:
            with build_slot("cpu:slot-test", timeout=2):
                pass
        except BuildSlotTimeoutError as exc:
            seen["refused"] = str(exc)
    finally:
        for process in (holder, killed_run):
            process.send_signal(signal.SIGKILL)
            process.wait()
        # SIGTERM ends the run promptly although its build thread holds the slot (it hung for minutes);
        # the slot is left taken, as by a kill.
        run.send_signal(signal.SIGTERM)
        start = time.monotonic()
        run.wait(timeout=60)
        seen["sigterm_exit_s"] = time.monotonic() - start
    # The next run on a fresh temporary server, one on each home, waits for the slot from now on.
    seen["waiters"] = [
        subprocess.Popen(
            [sys.executable, "-c", WAIT_FOR_SLOT], cwd=ROOT, env=e, stdout=subprocess.PIPE, text=True
        )
        for e in (temporary, killed_home)
    ]
    yield seen
    for waiter in seen["waiters"]:
        if waiter.poll() is None:  # the test failed before they were done
            waiter.kill()
            waiter.wait()


def _server_children(pid: int) -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(pid).children(recursive=True) if "server" in " ".join(p.cmdline())]
    except psutil.NoSuchProcess:
        return []


@pytest.mark.parametrize(
    "command",
    ["compile", "release"],
)
def test_the_temporary_api_server_dies_with_a_killed_cli(command: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PYTHONPATH": str(ROOT), "PREFECT_HOME": str(tmp_path / "home")})
    store = f"sqlite:///{tmp_path}/mlflow.db"
    if command == "release":
        # What kiln release checks before its API server starts: a zoo entry and a registered target.
        import mlflow

        # The registry named too: without it MLflow takes the registry URI an earlier test of this
        # process set (mlflow.set_registry_uri is process-wide), the model went to that store, and
        # the CLI exited at its target check before starting its server (failed only in full runs).
        mlflow.MlflowClient(store, registry_uri=store).create_registered_model("kiln.mlp.cpu")
        entry = "{name: mlp, factory: 'zoo.models:mlp_with_fallback'}"
        (tmp_path / "zoo.yaml").write_text(f"models:\n  - {entry}\n")
    args = {
        "compile": ["compile", "zoo.models:mlp_with_fallback", "--no-tracking",
                    "--out", str(tmp_path / "out"), "--workspace", str(tmp_path / "ws")],
        "release": ["release", "mlp", "--tracking-uri", store, "--zoo", str(tmp_path / "zoo.yaml")],
    }[command]  # fmt: skip
    log = tmp_path / "cli.log"
    with open(log, "wb") as output:  # what the CLI said, for a failure's message
        cli = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", *args],
            cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        servers: list[psutil.Process] = []
        while not servers and time.monotonic() < deadline and cli.poll() is None:
            servers = _server_children(cli.pid)
            time.sleep(0.2)
        assert servers, f"the CLI started no API server (exit {cli.poll()}):\n{log.read_text()[-3000:]}"
    finally:
        cli.send_signal(signal.SIGKILL)
        cli.wait()
    _, alive = psutil.wait_procs(servers, timeout=30)
    assert not alive, f"still running after the CLI was killed: {[p.cmdline() for p in alive]}"


# The task is called from plain threads, outside a flow run: Prefect notes its logs stay local.
@pytest.mark.filterwarnings("ignore:Logger 'prefect.task_runs' attempted to send logs")
def test_two_runs_writing_one_path_each_record_their_own_package(prefect_api, tmp_path: Path) -> None:
    import torch

    import compiler
    from compiler.validation.validate import validate
    from tasks.refs import StagedRef, ValidatedRef
    from tasks.stages import package_model
    from zoo.models import mlp_with_fallback

    staged = []
    for width in (16, 32):
        case = mlp_with_fallback(width=width)
        program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
        compiled = compiler.compile(program, cache=False)
        info = compiler.save(compiled, tmp_path / f"staged-{width}.kiln")
        report = validate(case.model, compiled, samples=1, warmup=0, runs=1)
        staged.append(
            ValidatedRef(StagedRef(str(width), str(info.path), info.content_hash, compiled.report), report)
        )
    out = tmp_path / "out" / "mlp.kiln"
    refs = [None, None]

    def run(i: int) -> None:
        refs[i] = package_model(staged[i], str(out), str(tmp_path / "ws"))

    # Each thread carries this context: Prefect's settings (the test server's URL) live in contextvars.
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(run, i)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # Each run's record comes from its own copy, with its own content; the published path holds one
    # whole package, never a mix.
    hashes = {compiler.read_manifest(ref.run_copy).content_hash for ref in refs}
    assert hashes == {ref.content_hash for ref in refs} and len(hashes) == 2
    assert compiler.read_manifest(out).content_hash in hashes
    # The published package is one run's copy byte for byte (copied into place, not saved again).
    [winner] = [ref for ref in refs if ref.content_hash == compiler.read_manifest(out).content_hash]
    files = {f.relative_to(out): f.read_bytes() for f in sorted(out.rglob("*")) if f.is_file()}
    copy = Path(winner.run_copy)
    assert files == {f.relative_to(copy): f.read_bytes() for f in sorted(copy.rglob("*")) if f.is_file()}
    assert not [f.name for f in out.parent.iterdir() if f.name.startswith(".mlp.kiln.tmp-")]
    published = compiler.load(out)
    assert published(torch.randn(3, published.input_specs[0].max_shape[1])).shape == (3, 16)


def test_fleet_workers_starting_at_once_all_get_the_build_limit(prefect_api) -> None:
    # Each worker's zoo run creates its device's limit where it is missing; two that start together
    # both find it missing and one creates it first (a fleet test once stopped with ObjectAlreadyExists).
    from prefect import get_client

    from tasks.concurrency import ensure_limits, limit_name

    device = f"cpu:race-{os.getpid()}-{time.monotonic_ns()}"
    start, errors = threading.Barrier(6), []

    def worker() -> None:
        start.wait()
        try:
            ensure_limits({device: 2})
        except Exception as exc:  # reported below
            errors.append(repr(exc))

    # Each thread carries this context: Prefect's settings (the test server's URL) live in contextvars.
    threads = [threading.Thread(target=contextvars.copy_context().run, args=(worker,)) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    with get_client(sync_client=True) as client:
        assert client.read_global_concurrency_limit_by_name(limit_name(device)).limit == 2


def test_run_logs_reach_the_server_before_a_temporary_one_is_stopped(prefect_api) -> None:
    """Prefect sends run logs in batches (every 2 s) and the rest at interpreter exit: by then
    `prefect_api()` had stopped its temporary server, so `kiln release` printed "Error logging to API",
    once after a minute of retries. `flush_to_api`, which `prefect_api()` calls before stopping its
    server, must leave nothing queued."""
    import uuid

    from prefect import flow, get_client, get_run_logger
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from flows.server import flush_to_api

    words = f"last words {uuid.uuid4()}"

    @flow(name="last-words")
    def last_words() -> None:
        get_run_logger().info(words)

    flow_run_id = last_words(return_state=True).state_details.flow_run_id
    flush_to_api(timeout=30)
    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])), limit=50)
    assert words in [log.message for log in logs], [log.message for log in logs]


# Last in the module, so that the module's other tests run while the leases run out.
@pytest.mark.slow
def test_a_killed_build_frees_its_slot_on_a_real_and_on_a_temporary_server(dead_slot_holders: dict) -> None:
    from tasks.concurrency import build_slot

    seen = dead_slot_holders
    assert seen["held"] == ["held", "held", "held"]
    assert seen["refused"] is not None and re.search(
        r"engine-build:cpu:slot-test.*prefect gcl", seen["refused"]
    )
    assert seen["sigterm_exit_s"] < 30
    # The next run on a fresh temporary server, and a waiter on the real one, both get the slot once
    # the dead holders' leases (60 s, Prefect's minimum) expire; nobody resets anything by hand.
    start = time.monotonic()
    with build_slot("cpu:slot-test", timeout=150):
        waited = time.monotonic() - start
    assert waited < 150
    for waiter in seen["waiters"]:
        out, _ = waiter.communicate(timeout=240)
        assert waiter.returncode == 0 and out.startswith("waited"), out
