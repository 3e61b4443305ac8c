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

Each delivery id is accepted once: ids seen within the replay window are kept in a small JSON file
(``--state``, default ``.kiln/webhook-deliveries.json``, so a restarted receiver remembers them), and a
replay is answered 200 without starting anything. The file is replaced atomically (and its directory
synced) on every write. A state file that cannot be read, or is not what the receiver writes, fails
closed: every delivery is answered 503 naming it, since a replay cannot be told from a first delivery.
Once the file was last written more than ``2 * MAX_AGE_S`` ago, no delivery it may have recorded can
verify again, so it is moved aside (``<state>.corrupt-<time>``) and the receiver starts afresh.

Every request gets an HTTP answer, and none can hold the receiver: the body is bounded before it is
read (a missing ``Content-Length`` is 411; anything but ASCII digits, or two different lengths, 400;
over ``MAX_BODY_BYTES`` 413); the whole request (line, headers, body) must arrive within
``REQUEST_TIMEOUT_S`` of the connection (408 otherwise: a per-read timeout would restart on every
trickled byte); at most ``MAX_CONNECTIONS`` requests are handled at once, and a connection beyond
that is answered 503 with ``Retry-After`` at once, by the accepting thread, and closed. A failure
after verification (a broken zoo file, Prefect down) is a 500 naming it, and the delivery id is
released so MLflow's retry can succeed once the cause is fixed.

The secret comes from ``$KILN_WEBHOOK_SECRET``; the zoo file is re-read on every event, so entries
added since the receiver started are seen.
"""

from __future__ import annotations

import base64
import contextvars
import hashlib
import hmac
import io
import json
import logging
import math
import os
import re
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from compiler import json_reader
from compiler.atomic import write_bytes_atomic
from compiler.errors import KilnError

log = logging.getLogger("kiln.webhook")

SECRET_ENV = "KILN_WEBHOOK_SECRET"
MAX_AGE_S = 300
MAX_BODY_BYTES = 1 << 20
REQUEST_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 16
RETRY_AFTER_S = 5
DEFAULT_STATE = ".kiln/webhook-deliveries.json"
EVENTS = ("model_version.created", "model_version_alias.created")
# A decimal byte count in ASCII: str.isdigit() also takes "²" (which int() refuses) and int() takes
# other scripts' digits; a bound on the digits keeps int() away from its 4300-digit limit.
_LENGTH_RE = re.compile(r"[0-9]{1,32}")


class WebhookSignatureError(KilnError):
    """A delivery whose signature or timestamp does not verify."""


class DeliveryStateError(KilnError):
    """The file of accepted delivery ids cannot be read, or holds something the receiver never writes:
    deliveries are refused until it is repaired, or old enough that nothing it recorded verifies."""


def sign(secret: str, delivery_id: str, timestamp: str, body: str) -> str:
    """The ``X-MLflow-Signature`` MLflow sends for this delivery."""
    digest = hmac.new(secret.encode(), f"{delivery_id}.{timestamp}.{body}".encode(), hashlib.sha256).digest()
    return "v1," + base64.b64encode(digest).decode()


def verify(secret: str, headers: Any, body: bytes, now: float | None = None) -> dict:
    """The event, after its signature and age check out; else WebhookSignatureError."""
    delivery = headers.get("X-MLflow-Delivery-Id") or ""
    timestamp = headers.get("X-MLflow-Timestamp") or ""
    signature = headers.get("X-MLflow-Signature") or ""
    if not delivery:
        raise WebhookSignatureError("no X-MLflow-Delivery-Id (each delivery is accepted once, by its id)")
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
        event = json_reader.loads(text, "the delivery's body")
    except ValueError:
        raise WebhookSignatureError("the body is not JSON") from None
    if not isinstance(event, dict) or not isinstance(event.get("data"), dict):
        raise WebhookSignatureError("the body is not an MLflow webhook event")
    return event


def entries_for(zoo_path: str, model_name: str) -> list[str]:
    """Names of the zoo entries whose source is a version or alias of registered model ``model_name``."""
    from zoo.sources.mlflow_registry import parse_models_uri
    from zoo.zoo_file import load_zoo

    names = []
    for entry in load_zoo(zoo_path).entries:
        try:
            name, _, _ = parse_models_uri(entry.source_uri)
        except ValueError:  # another kind of source
            continue
        if name == model_name:
            names.append(entry.name)
    return names


def _parse_state(raw: bytes) -> dict[str, float] | None:
    """The ids and acceptance times of a state file, or None when it is not what ``_write`` writes."""
    try:
        data = json_reader.loads(raw, "the webhook state")
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    seen = {}
    for key, value in data.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            return None
        seen[key] = float(value)
    return seen


class DeliveryLog:
    """Delivery ids accepted within the replay window, kept in a JSON file (id -> time accepted).

    An id older than twice ``MAX_AGE_S`` can be forgotten: its signed timestamp no longer verifies.
    For the same reason a damaged file whose last write is older than that is safe to start over from;
    a younger one is refused (:class:`DeliveryStateError`), never read as empty.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()

    def _read(self, now: float) -> dict[str, float]:
        try:
            raw = self.path.read_bytes()
            written = self.path.stat().st_mtime
        except FileNotFoundError:
            return {}
        except OSError as exc:
            raise DeliveryStateError(
                f"the delivery state {self.path} cannot be read ({exc.strerror or exc}); deliveries are "
                "refused until it can (fix its permissions or --state)"
            ) from None
        seen = _parse_state(raw)
        if seen is not None:
            return seen
        safe_at = written + 2 * MAX_AGE_S
        if now < safe_at:
            raise DeliveryStateError(
                f"the delivery state {self.path} is corrupt (not a JSON object of delivery id -> time): "
                f"a replay cannot be told from a first delivery, so deliveries are refused for "
                f"{safe_at - now:.0f} s more, until nothing it recorded can verify again (it is then "
                "moved aside and the receiver starts afresh); or restore it from a copy"
            )
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(now)}")
        os.replace(self.path, aside)
        log.warning(
            "the delivery state %s was corrupt; last written %.0f s ago, so no delivery it recorded "
            "verifies any more: kept as %s, starting afresh",
            self.path,
            now - written,
            aside,
        )
        return {}

    def _write(self, seen: dict[str, float]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(self.path, json.dumps(seen, sort_keys=True).encode())
        # The rename is durable only once the directory is synced: a crash must not bring back a state
        # without the ids just accepted.
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def check(self, now: float | None = None) -> None:
        """Raise DeliveryStateError when deliveries would be refused because of the state file."""
        with self._lock:
            self._read(time.time() if now is None else now)

    def claim(self, delivery_id: str, now: float | None = None) -> bool:
        """True the first time ``delivery_id`` is claimed within the window (recorded on disk first).

        Raises DeliveryStateError when the state cannot be trusted (see the class)."""
        now = time.time() if now is None else now
        with self._lock:
            seen = {k: t for k, t in self._read(now).items() if now - t <= 2 * MAX_AGE_S}
            if delivery_id in seen:
                return False
            seen[delivery_id] = now
            self._write(seen)
            return True

    def release(self, delivery_id: str) -> None:
        """Forget a claimed id whose handling failed, so that a retry of the delivery is accepted."""
        with self._lock:
            seen = self._read(time.time())
            if seen.pop(delivery_id, None) is not None:
                self._write(seen)


@dataclass(frozen=True)
class Receiver:
    """What a delivery leads to: which zoo file to read, which deployment to start, and where the ids
    of accepted deliveries are kept."""

    zoo_path: str
    deployment: str
    secret: str
    state: str = DEFAULT_STATE
    deliveries: DeliveryLog = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "deliveries", DeliveryLog(self.state))

    def handle(self, headers: Any, body: bytes) -> tuple[int, dict]:
        """(HTTP status, JSON answer) for one delivery."""
        try:
            event = verify(self.secret, headers, body)
        except WebhookSignatureError as exc:
            log.warning("refused a webhook delivery: %s", exc)
            return 401, {"error": str(exc)}
        delivery = headers.get("X-MLflow-Delivery-Id")
        try:
            first = self.deliveries.claim(delivery)
        except DeliveryStateError as exc:
            log.error("refused webhook delivery %s: %s", delivery, exc)
            return 503, {"error": str(exc)}
        if not first:
            log.warning("webhook delivery %s replayed; ignored", delivery)
            return 200, {"ignored": f"delivery {delivery!r} was already accepted"}
        try:
            return self._start(event)
        except Exception as exc:
            try:
                self.deliveries.release(delivery)
            except DeliveryStateError as state_exc:
                log.error("could not release delivery %s for a retry: %s", delivery, state_exc)
            log.error("webhook delivery %s failed: %s: %s", delivery, type(exc).__name__, exc)
            return 500, {"error": f"{type(exc).__name__}: {exc}"}

    def _start(self, event: dict) -> tuple[int, dict]:
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


def _response(status: int, answer: dict, extra: dict[str, str] | None = None) -> bytes:
    """A whole HTTP/1.0 answer with a JSON body; the connection closes after it."""
    data = json.dumps(answer).encode()
    lines = [
        f"HTTP/1.0 {status} {HTTPStatus(status).phrase}",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in (extra or {}).items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + data


class _RequestDeadline(Exception):
    """The client did not send its whole request before the deadline."""


class _DeadlineReader(io.RawIOBase):
    """A connection's bytes, each receive bounded by what is left of the request's deadline."""

    def __init__(self, sock: socket.socket, deadline: float):
        self.sock, self.deadline = sock, deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise _RequestDeadline
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buffer)
        except TimeoutError:
            raise _RequestDeadline from None


class _BoundedServer(ThreadingHTTPServer):
    """A thread per request, at most ``max_connections`` at once; past that, an immediate 503."""

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int):
        self._slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self._refuse(request, client_address)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: its slot is free again
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that resets its connection mid-request is logged, not printed as a traceback.
        log.warning("a request from %s ended early: %s", client_address[0], sys.exc_info()[1])

    def _refuse(self, request: socket.socket, client_address: Any) -> None:
        # On the accepting thread, so never a blocking call: a fresh socket's send buffer takes the
        # few hundred bytes at once, or the answer is dropped with the connection.
        log.warning(
            "refused a connection from %s: %d requests are being handled (--max-connections)",
            client_address[0],
            self.max_connections,
        )
        answer = {"error": f"the receiver is handling {self.max_connections} requests; retry later"}
        try:
            request.setblocking(False)
            request.send(_response(503, answer, {"Retry-After": str(RETRY_AFTER_S)}))
        except OSError:
            pass
        self.shutdown_request(request)


def serve(
    receiver: Receiver,
    host: str = "127.0.0.1",
    port: int = 8765,
    request_timeout: float = REQUEST_TIMEOUT_S,
    max_connections: int = MAX_CONNECTIONS,
) -> ThreadingHTTPServer:
    """An HTTP server that answers deliveries with ``receiver`` (call ``serve_forever`` on it).

    ``request_timeout``: seconds from a connection to its whole request (line, headers, body) having
    arrived. ``max_connections``: requests handled at once; each further connection gets a 503.

    Each request is handled in a copy of the caller's context: Prefect's settings (the API URL) live in
    context variables, which the server's per-request threads would not otherwise see.
    """
    if request_timeout <= 0 or max_connections < 1:
        raise KilnError(
            f"request_timeout must be > 0 and max_connections >= 1 (got {request_timeout}, {max_connections})"
        )
    context = contextvars.copy_context()

    class Handler(BaseHTTPRequestHandler):
        timeout = request_timeout

        def setup(self) -> None:
            super().setup()
            # One deadline for the whole request: a per-read timeout restarts on every trickled byte.
            deadline = time.monotonic() + request_timeout
            self.rfile.close()
            self.rfile = io.BufferedReader(_DeadlineReader(self.connection, deadline))

        def handle_one_request(self) -> None:
            try:
                super().handle_one_request()
            except _RequestDeadline:
                self.close_connection = True
                log.warning(
                    "a request from %s did not arrive within %g s", self.client_address[0], request_timeout
                )
                self._send(
                    _response(408, {"error": f"the request did not arrive within {request_timeout:g} s"})
                )

        def do_POST(self) -> None:
            # Every answer closes the connection: one request per connection, one deadline per request.
            self.close_connection = True
            length, refusal = _body_length(self.headers.get_all("Content-Length"))
            if refusal is not None:
                self._answer(*refusal)  # nothing of the body is read
                return
            body = self.rfile.read(length)
            if len(body) != length:
                self._answer(400, {"error": f"the body ended after {len(body)} of {length} bytes"})
                return
            try:
                status, answer = context.copy().run(receiver.handle, self.headers, body)
            except Exception as exc:  # always an answer, never a dropped connection
                status, answer = 500, {"error": f"{type(exc).__name__}: {exc}"}
            self._answer(status, answer)

        def _answer(self, status: int, answer: dict) -> None:
            self.log_request(status)
            self._send(_response(status, answer))

        def _send(self, data: bytes) -> None:
            self.connection.settimeout(request_timeout)  # a client that reads nothing cannot hold it
            try:
                self.wfile.write(data)
            except OSError as exc:
                log.debug("could not answer %s: %s", self.client_address[0], exc)

        def log_message(self, format: str, *args: Any) -> None:
            log.debug(format, *args)

    return _BoundedServer((host, port), Handler, max_connections)


def _body_length(headers: list[str] | None) -> tuple[int, tuple[int, dict] | None]:
    """(body length, None), or (0, (status, answer)) refusing the request before its body is read."""
    if not headers:
        return 0, (411, {"error": "Content-Length is required"})
    texts = {header.strip() for header in headers}
    if len(texts) > 1:
        return 0, (400, {"error": f"Content-Length is given {len(headers)} times with different values"})
    text = texts.pop()
    if not _LENGTH_RE.fullmatch(text):  # no sign, no spaces inside, no hex, no non-ASCII digits
        return 0, (400, {"error": f"Content-Length {headers[0]!r} is not a byte count (ASCII digits)"})
    length = int(text)
    if length > MAX_BODY_BYTES:
        return 0, (413, {"error": f"body of {length} bytes is over {MAX_BODY_BYTES} bytes"})
    return length, None


def secret_from_env() -> str:
    secret = os.environ.get(SECRET_ENV, "")
    if len(secret) < 16:
        raise KilnError(f"${SECRET_ENV} must hold the webhook's shared secret (16+ characters)")
    return secret
