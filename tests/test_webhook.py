"""Registry events -> recompiles: a real MLflow server delivers signed webhooks to ``kiln webhook serve``,
which starts the zoo deployment on a real Prefect server for exactly the entries that use the model."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from flows.webhook import Receiver, WebhookSignatureError, serve, sign, verify

ROOT = Path(__file__).resolve().parents[1]
SECRET = "kiln-test-secret-0123456789"


def _headers(body: str, secret: str = SECRET, timestamp: int | None = None) -> dict[str, str]:
    stamp = str(int(time.time()) if timestamp is None else timestamp)
    return {
        "X-MLflow-Delivery-Id": "d1",
        "X-MLflow-Timestamp": stamp,
        "X-MLflow-Signature": sign(secret, "d1", stamp, body),
    }


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
    receiver = Receiver(str(zoo), "recompile-zoo/zoo-nightly-cpu", SECRET)
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
        deadline = time.monotonic() + 60
        started: list = []
        while time.monotonic() < deadline and not started:
            started = [r for r in _flow_runs_of(deployment.id) if r.id not in before]
            time.sleep(0.5)
    finally:
        server.shutdown()
        server.server_close()
    assert len(started) == 1, started  # the unused model's event was ignored
    assert started[0].parameters["models"] == ["fraud"] and started[0].parameters["zoo_path"] == str(zoo)
