"""``kiln webhook serve``: recompile when a source model changes in the MLflow registry.

MLflow's registry webhooks (``model_version.created``, ``model_version_alias.created``) POST a JSON
event signed with a shared secret: ``X-MLflow-Signature: v1,<base64 HMAC-SHA256 of
"<delivery id>.<timestamp>.<body>">``. The receiver checks the signature and the timestamp (at most
``MAX_AGE_S`` old, so a captured delivery cannot be replayed later) before reading anything else: a
bad one gets 401 and starts nothing. A good one names a registered model; every zoo entry whose
``source:`` is ``models:/<that name>/...`` or ``models:/<that name>@...`` is recompiled by starting the
Prefect deployment for exactly those entries. Unchanged entries cost a hash there (``tasks.reuse``),
so recompiling every entry of the model is both correct and cheap. Events for models no entry uses
are answered 200, logged, and ignored.

The secret comes from ``$KILN_WEBHOOK_SECRET``; the zoo file is re-read on every event, so entries
added since the receiver started are seen.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from compiler.errors import KilnError

log = logging.getLogger("kiln.webhook")

SECRET_ENV = "KILN_WEBHOOK_SECRET"
MAX_AGE_S = 300
MAX_BODY_BYTES = 1 << 20
EVENTS = ("model_version.created", "model_version_alias.created")


class WebhookSignatureError(KilnError):
    """A delivery whose signature or timestamp does not verify."""


def sign(secret: str, delivery_id: str, timestamp: str, body: str) -> str:
    """The ``X-MLflow-Signature`` MLflow sends for this delivery."""
    digest = hmac.new(secret.encode(), f"{delivery_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify(secret: str, headers: Any, body: bytes, now: float | None = None) -> dict:
    """The event, after its signature and age check out; else WebhookSignatureError."""
    delivery = headers.get("X-MLflow-Delivery-Id") or ""
    timestamp = headers.get("X-MLflow-Timestamp") or ""
    signature = headers.get("X-MLflow-Signature") or ""
    try:
        text = body.decode("utf-8")
        age = abs((now or time.time()) - int(timestamp))
    except (UnicodeDecodeError, ValueError):
        raise WebhookSignatureError("missing or malformed timestamp or body") from None
    if not signature or not hmac.compare_digest(sign(secret, delivery, timestamp, text), signature):
        raise WebhookSignatureError("the signature does not match this receiver's secret")
    if age > MAX_AGE_S:
        raise WebhookSignatureError(f"the delivery is {age:.0f} s old (at most {MAX_AGE_S} s)")
    try:
        event = json.loads(text)
    except ValueError:
        raise WebhookSignatureError("the body is not JSON") from None
    if not isinstance(event, dict) or not isinstance(event.get("data"), dict):
        raise WebhookSignatureError("the body is not an MLflow webhook event")
    return event


def entries_for(zoo_path: str, model_name: str) -> list[str]:
    """Names of the zoo entries whose source is a version or alias of registered model ``model_name``."""
    from zoo.config import load_zoo
    from zoo.sources.mlflow_registry import parse_models_uri

    names = []
    for entry in load_zoo(zoo_path).entries:
        try:
            name, _, _ = parse_models_uri(entry.source_uri)
        except ValueError:  # another kind of source
            continue
        if name == model_name:
            names.append(entry.name)
    return names


@dataclass(frozen=True)
class Receiver:
    """What a delivery leads to: which zoo file to read, and which deployment to start."""

    zoo_path: str
    deployment: str
    secret: str

    def handle(self, headers: Any, body: bytes) -> tuple[int, dict]:
        """(HTTP status, JSON answer) for one delivery."""
        try:
            event = verify(self.secret, headers, body)
        except WebhookSignatureError as exc:
            log.warning("refused a webhook delivery: %s", exc)
            return 401, {"error": str(exc)}
        kind = f"{event.get('entity')}.{event.get('action')}"
        model = str(event["data"].get("name", ""))
        if kind not in EVENTS:
            return 200, {"ignored": f"event {kind} does not change a source"}
        entries = entries_for(self.zoo_path, model)
        if not entries:
            log.info("webhook %s for %s: no zoo entry uses it; ignored", kind, model)
            return 200, {"ignored": f"no entry of {self.zoo_path} uses registered model {model!r}"}
        from prefect.deployments import run_deployment

        flow_run = run_deployment(
            self.deployment, parameters={"zoo_path": self.zoo_path, "models": entries}, timeout=0
        )
        log.info(
            "webhook %s for %s: started %s for %s (%s)", kind, model, self.deployment, entries, flow_run.id
        )
        return 202, {"flow_run_id": str(flow_run.id), "models": entries, "event": kind}


def serve(receiver: Receiver, host: str = "127.0.0.1", port: int = 8765) -> ThreadingHTTPServer:
    """An HTTP server that answers deliveries with ``receiver`` (call ``serve_forever`` on it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                status, answer = 413, {"error": f"body over {MAX_BODY_BYTES} bytes"}
            else:
                status, answer = receiver.handle(self.headers, self.rfile.read(length))
            data = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format, *args)

    return ThreadingHTTPServer((host, port), Handler)


def secret_from_env() -> str:
    secret = os.environ.get(SECRET_ENV, "")
    if len(secret) < 16:
        raise KilnError(f"${SECRET_ENV} must hold the webhook's shared secret (16+ characters)")
    return secret
