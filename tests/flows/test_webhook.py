"""Registry events -> recompiles: a real MLflow server delivers signed webhooks to ``kiln webhook serve``,
which starts the zoo deployment on a real Prefect server for exactly the entries that use the model."""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from flows.webhook import MAX_AGE_S, Receiver, WebhookSignatureError, serve, sign, verify

ROOT = Path(__file__).resolve().parents[2]
SECRET = "kiln-test-secret-0123456789"


def _headers(
    body: str, secret: str = SECRET, timestamp: int | None = None, delivery: str = "d1"
) -> dict[str, str]:
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    return {
        "X-MLflow-Delivery-Id": delivery,
        "X-MLflow-Timestamp": stamp,
        "X-MLflow-Signature": sign(secret, delivery, stamp, body),
    }


def _post(url: str, body: str, headers: dict[str, str]) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body.encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _raw(port: int, data: bytes, send_more: int = 0) -> bytes:
    """The server's whole answer to ``data`` (then ``send_more`` zero bytes, as far as it takes them)."""
    with socket.create_connection(("127.0.0.1", port), timeout=15) as sock:
        sock.sendall(data)
        sock.settimeout(0.05)
        sent = 0
        while sent < send_more:  # a stream the server must not wait for
            try:
                sent += sock.send(bytes(min(1 << 16, send_more - sent)))
            except (TimeoutError, OSError):
                break
        sock.settimeout(15)
        answer = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := sock.recv(1 << 16):
                answer += chunk
        return answer


def test_every_request_gets_an_answer_and_bodies_are_bounded_before_reading(tmp_path: Path) -> None:
    zoo = tmp_path / "zoo.yaml"
    zoo.write_text("models: [\n")  # broken while a verified delivery arrives
    receiver = Receiver(str(zoo), "recompile-zoo/none", SECRET, str(tmp_path / "seen.json"))
    server = serve(receiver, "127.0.0.1", 0, request_timeout=1.0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    port = server.server_port
    try:
        head = "POST / HTTP/1.1\r\nHost: x\r\n"
        # A negative length with a 300 MiB stream behind it: refused at once, the stream not read.
        start = time.monotonic()
        answer = _raw(port, (head + "Content-Length: -1\r\n\r\n").encode(), send_more=300 << 20)
        assert answer.startswith(b"HTTP/1.0 400") and b"not a byte count" in answer, answer[:200]
        assert time.monotonic() - start < 10
        answer = _raw(port, (head + "Content-Length: abc\r\n\r\n").encode())
        assert answer.startswith(b"HTTP/1.0 400"), answer[:200]
        assert _raw(port, (head + "\r\n").encode()).startswith(b"HTTP/1.0 411")
        big = _raw(port, (head + f"Content-Length: {(1 << 20) + 1}\r\n\r\n").encode())
        assert big.startswith(b"HTTP/1.0 413")
        # Half-open: the length promised, the body never sent; the server gives up after its timeout.
        start = time.monotonic()
        _raw(port, (head + "Content-Length: 100\r\n\r\n" + "x" * 10).encode())
        assert time.monotonic() - start < 10
        # Verified, but the zoo file is broken: a 500 naming it, and the id stays free for a retry.
        body = json.dumps({"entity": "model_version", "action": "created", "data": {"name": "m"}})
        status, answer = _post(f"http://127.0.0.1:{port}/", body, _headers(body, delivery="retry-me"))
        assert status == 500 and "not valid YAML" in answer["error"], answer
        zoo.write_text("models: [{name: mlp, factory: 'zoo.models:mlp_with_fallback'}]\n")
        status, answer = _post(f"http://127.0.0.1:{port}/", body, _headers(body, delivery="retry-me"))
        assert status == 200 and "uses registered model 'm'" in answer["ignored"], answer
    finally:
        server.shutdown()
        server.server_close()


@contextlib.contextmanager
def _serving(tmp_path: Path, **options: float) -> Iterator[int]:
    """A receiver (zoo without models:/ entries) on a free port; yields the port."""
    zoo = tmp_path / "zoo.yaml"
    zoo.write_text("models: [{name: mlp, factory: 'zoo.models:mlp_with_fallback'}]\n")
    receiver = Receiver(str(zoo), "recompile-zoo/none", SECRET, str(tmp_path / "seen.json"))
    server = serve(receiver, "127.0.0.1", 0, **options)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()


def test_a_content_length_of_non_ascii_or_too_many_digits_is_a_400(tmp_path: Path) -> None:
    """'²' passes str.isdigit() and then breaks int(): the connection used to close with no answer."""
    head = b"POST / HTTP/1.1\r\nHost: x\r\n"
    with _serving(tmp_path, request_timeout=2.0) as port:
        for value in (b"\xb2", b"1\xb9", b"9" * 5000, b"\xd9\xa3"):
            answer = _raw(port, head + b"Content-Length: " + value + b"\r\n\r\n")
            assert answer.startswith(b"HTTP/1.0 400") and b"not a byte count" in answer, (value, answer[:200])
        # Two different lengths: which one frames the body is ambiguous, so neither is used.
        answer = _raw(port, head + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd")
        assert answer.startswith(b"HTTP/1.0 400") and b"different values" in answer, answer[:200]


def _trickle(port: int, interval: float, limit: float) -> tuple[float, bytes]:
    """Send one header line every ``interval`` s until the server answers or ``limit`` s pass:
    (seconds until the server answered or closed, its answer)."""
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\n")
        line = 0
        while time.monotonic() - start < limit:
            if select.select([sock], [], [], interval)[0]:
                answer = b""
                with contextlib.suppress(ConnectionResetError):
                    while chunk := sock.recv(1 << 16):
                        answer += chunk
                return time.monotonic() - start, answer
            line += 1
            with contextlib.suppress(OSError):
                sock.sendall(f"X-Slow-{line}: {line}\r\n".encode())
        return time.monotonic() - start, b""


def test_a_trickling_client_is_cut_off_at_the_whole_request_deadline(tmp_path: Path) -> None:
    """A header line every 0.3 s never trips a 1 s per-read timeout; the request's deadline is 1 s."""
    with _serving(tmp_path, request_timeout=1.0) as port:
        seconds, answer = _trickle(port, interval=0.3, limit=4.0)
    assert answer.startswith(b"HTTP/1.0 408") and b"within 1 s" in answer, answer[:200]
    assert seconds < 2.5


def test_handler_threads_are_bounded_and_excess_connections_get_a_503(tmp_path: Path) -> None:
    threads_before = threading.active_count()
    # The holders' deadline (3 s) stands well apart from "at once", so a loaded CI machine cannot blur
    # the two (a 1 s deadline failed at 1.02 s on a clean-clone run).
    with _serving(tmp_path, request_timeout=3.0, max_connections=2) as port:
        # Two silent connections take both handler threads until their deadline.
        silent = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(2)]
        time.sleep(0.2)
        extra = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(10)]
        try:
            start = time.monotonic()
            answer = _raw(port, b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            assert time.monotonic() - start < 2.0  # answered at once, not after a holder's deadline
            assert answer.startswith(b"HTTP/1.0 503") and b"Retry-After: 5" in answer, answer[:200]
            assert threading.active_count() <= threads_before + 1 + 2  # serve_forever + 2 handlers
        finally:
            for sock in silent + extra:
                sock.close()
        # The holders' slots come free at their deadline: a request is handled again.
        time.sleep(3.2)
        assert _raw(port, b"POST / HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.0 411")


def test_a_corrupt_delivery_state_refuses_deliveries_until_nothing_in_it_verifies(tmp_path: Path) -> None:
    """A damaged state file used to read as empty: the replay of an accepted delivery went through."""
    zoo = tmp_path / "zoo.yaml"
    zoo.write_text("models: [{name: mlp, factory: 'zoo.models:mlp_with_fallback'}]\n")
    state = tmp_path / "seen.json"
    receiver = Receiver(str(zoo), "recompile-zoo/none", SECRET, str(state))
    body = json.dumps({"entity": "model_version", "action": "created", "data": {"name": "m"}})
    accepted = _headers(body, delivery="accepted")
    status, answer = receiver.handle(accepted, body.encode())
    assert status == 200 and "uses registered model" in answer["ignored"], answer
    inode = state.stat().st_ino
    receiver.handle(_headers(body, delivery="second"), body.encode())
    assert state.stat().st_ino != inode  # replaced by a rename, never rewritten in place
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".seen")] == []  # no temp files left

    for damage in (b'{"accepted": 17', b"[]", b'{"accepted": "yesterday"}', b'{"accepted": NaN}'):
        state.write_bytes(damage)
        for delivery in ("accepted", "new"):  # the replay, and a delivery never seen: both refused
            status, answer = receiver.handle(_headers(body, delivery=delivery), body.encode())
            assert status == 503 and f"{state} is corrupt" in answer["error"], (damage, answer)
            assert "refused for" in answer["error"]
        assert state.read_bytes() == damage  # kept as found, for whoever repairs it
    # Last written more than twice the replay window ago: nothing it recorded verifies, so it is moved
    # aside and deliveries are accepted again.
    old = time.time() - 2 * MAX_AGE_S - 5
    os.utime(state, (old, old))
    status, answer = receiver.handle(_headers(body, delivery="new"), body.encode())
    assert status == 200 and "uses registered model" in answer["ignored"], answer
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("seen.json.corrupt-")]
    assert len(aside) == 1 and aside[0].read_bytes() == b'{"accepted": NaN}'
    # A state that cannot be read at all (here a directory) is refused too, naming it.
    state.unlink()
    state.mkdir()
    status, answer = receiver.handle(_headers(body, delivery="third"), body.encode())
    assert status == 503 and f"{state} cannot be read" in answer["error"], answer


def test_only_a_fresh_delivery_signed_with_the_secret_is_read() -> None:
    body = json.dumps({"entity": "model_version", "action": "created", "data": {"name": "m"}})
    assert verify(SECRET, _headers(body), body.encode())["data"]["name"] == "m"
    with pytest.raises(WebhookSignatureError, match="signature"):
        verify(SECRET, _headers(body, secret="another-secret-0123456789"), body.encode())
    with pytest.raises(WebhookSignatureError, match="signature"):
        verify(SECRET, _headers(body), body.replace('"m"', '"n"').encode())  # tampered after signing
    with pytest.raises(WebhookSignatureError, match="old"):
        verify(SECRET, _headers(body, timestamp=int(time.time()) - 3600), body.encode())  # a replay


def _flow_runs_of(deployment_id: object) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=50,  # Prefect 3.8.8's server rejects the client's default None
        )


def _started_by_webhook(deployment_id: object, before: set, zoo: Path) -> list:
    # The deployment's cron schedule adds runs of its own (deploy/zoo.yaml); the receiver's name this zoo.
    runs = _flow_runs_of(deployment_id)
    return [r for r in runs if r.id not in before and r.parameters.get("zoo_path") == str(zoo)]


def test_a_new_source_version_starts_the_deployment_for_its_entries_only(
    mlflow_server,
    prefect_api,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlflow import MlflowClient
    from prefect import get_client

    from flows.deployments import register

    monkeypatch.setenv("KILN_REPO", str(ROOT))
    register(ROOT / "deploy" / "prefect.yaml", ["zoo-nightly-cpu"])
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("recompile-zoo/zoo-nightly-cpu")
    before = {r.id for r in _flow_runs_of(deployment.id)}

    zoo = tmp_path / "zoo.yaml"
    entries = [
        {"name": "fraud", "source": "models:/fraud-source@production"},
        {"name": "mlp", "factory": "zoo.models:mlp_with_fallback"},
    ]
    zoo.write_text(yaml.safe_dump({"models": entries}))
    receiver = Receiver(str(zoo), "recompile-zoo/zoo-nightly-cpu", SECRET, str(tmp_path / "seen.json"))
    server = serve(receiver, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/"
    try:
        # A forged delivery: 401, nothing started.
        body = json.dumps({"entity": "model_version", "action": "created", "data": {"name": "fraud-source"}})
        request = urllib.request.Request(
            url, data=body.encode(), headers=_headers(body, secret="forged-secret-0123456789"), method="POST"
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 401

        mlflow = MlflowClient()
        mlflow.create_webhook(
            name="kiln-test",
            url=url,
            events=["model_version.created", "model_version_alias.created"],
            secret=SECRET,
        )
        import mlflow as mlflow_api

        with mlflow_api.start_run() as run:  # a version's source must be a run's artifact
            mlflow_api.log_text("weights", "model/weights.txt")
        for name in ("fraud-source", "unused-model"):
            mlflow.create_registered_model(name)
            mlflow.create_model_version(name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id)
        # MLflow delivers webhooks from a background worker: on a loaded 2-core machine that took > 60 s.
        deadline = time.monotonic() + 180
        started: list = []
        while time.monotonic() < deadline and not started:
            started = _started_by_webhook(deployment.id, before, zoo)
            time.sleep(0.5)
        assert len(started) == 1, started  # the unused model's event was ignored
        assert started[0].parameters["models"] == ["fraud"] and started[0].parameters["zoo_path"] == str(zoo)

        # One signed delivery sent 5 times within its window (and once more to a restarted receiver):
        # one recompile.
        body = json.dumps({"entity": "model_version", "action": "created", "data": {"name": "fraud-source"}})
        headers = _headers(body, delivery="replayed")
        answers = [_post(url, body, headers) for _ in range(5)]
        assert answers[0][0] == 202 and all(a[0] == 200 for a in answers[1:]), answers
        assert "already accepted" in answers[1][1]["ignored"]
        restarted = Receiver(str(zoo), "recompile-zoo/zoo-nightly-cpu", SECRET, str(tmp_path / "seen.json"))
        assert restarted.handle(headers, body.encode())[0] == 200
        time.sleep(1)
        replayed = _started_by_webhook(deployment.id, before, zoo)
    finally:
        server.shutdown()
        server.server_close()
    assert len(replayed) == 2, replayed
