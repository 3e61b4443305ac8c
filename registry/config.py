"""Where kiln's MLflow data lives, and how kiln talks to a tracking server that may be down.

With no tracking URI set (neither ``MLFLOW_TRACKING_URI`` nor ``mlflow.set_tracking_uri``), kiln
uses an embedded store under the working folder: ``sqlite:///<cwd>/mlflow.db`` for runs and the
registry, ``<cwd>/mlruns`` for artifacts. ``mlflow ui --backend-store-uri sqlite:///<cwd>/mlflow.db``
then shows everything.

Every MLflow call kiln makes goes through :func:`call_with_retry`: transient failures (connection
refused, timeouts, 5xx, a locked sqlite file) are retried with exponential back-off, then turned
into :class:`RegistryUnavailableError`. MLflow's own HTTP retries are capped low (unless the user set
them) so that kiln's policy, not urllib3's four silent minutes, decides how long a step waits.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import mlflow
from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from registry.errors import RegistryUnavailableError

log = logging.getLogger("kiln.registry")

DEFAULT_EXPERIMENT = "kiln"
EXPERIMENT_ENV = "KILN_MLFLOW_EXPERIMENT"

T = TypeVar("T")

_TRANSIENT_CODES = {
    "TEMPORARILY_UNAVAILABLE",
    "SERVICE_UNDER_MAINTENANCE",
    "DEADLINE_EXCEEDED",
    "REQUEST_LIMIT_EXCEEDED",
    "COULD_NOT_ACQUIRE_LOCK",
    "ABORTED",
}
# MLflow reports a dead connection as INTERNAL_ERROR with the urllib3 text in the message.
_TRANSIENT_TEXT = (
    "max retries exceeded",
    "connection refused",
    "connection aborted",
    "connection reset",
    "remotedisconnected",
    "read timed out",
    "timed out",
    "database is locked",
    "bad gateway",
    "service unavailable",
    "gateway timeout",
    "too many 500 error responses",
    "too many 502 error responses",
    "too many 503 error responses",
    "response: 502",
    "response: 503",
    "response: 504",
)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential back-off: ``attempts`` tries, sleeping ``base_delay * 2**i`` (capped, with jitter)."""

    attempts: int = 6
    base_delay: float = 1.0
    max_delay: float = 20.0

    @classmethod
    def from_env(cls) -> RetryPolicy:
        """``KILN_MLFLOW_RETRIES``, ``KILN_MLFLOW_RETRY_DELAY``, ``KILN_MLFLOW_RETRY_MAX_DELAY`` override."""
        default = cls()
        return cls(
            attempts=max(1, int(os.environ.get("KILN_MLFLOW_RETRIES", default.attempts))),
            base_delay=float(os.environ.get("KILN_MLFLOW_RETRY_DELAY", default.base_delay)),
            max_delay=float(os.environ.get("KILN_MLFLOW_RETRY_MAX_DELAY", default.max_delay)),
        )

    def delay(self, attempt: int) -> float:
        base = min(self.max_delay, self.base_delay * (2**attempt))
        # Jitter keeps two zoo runs that failed together from hammering a restarting server in step.
        return base * (0.75 + 0.5 * random.random())


def is_transient(exc: BaseException) -> bool:
    """Whether an MLflow failure is worth retrying (the server or store is briefly unreachable)."""
    if isinstance(exc, MlflowException):
        if exc.error_code in _TRANSIENT_CODES:
            return True
        text = str(exc).lower()
        return any(t in text for t in _TRANSIENT_TEXT)
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    try:
        import requests

        if isinstance(exc, (requests.ConnectionError, requests.Timeout)):
            return True
    except ImportError:  # pragma: no cover - requests comes with mlflow
        pass
    name = type(exc).__name__
    return name == "OperationalError" and "locked" in str(exc).lower()


def call_with_retry(fn: Callable[[], T], what: str, policy: RetryPolicy | None = None) -> T:
    """Run ``fn``; retry transient failures with back-off; then raise RegistryUnavailableError."""
    policy = policy or RetryPolicy.from_env()
    started = time.monotonic()
    last: BaseException | None = None
    for attempt in range(policy.attempts):
        try:
            return fn()
        except Exception as exc:
            if not is_transient(exc):
                raise
            last = exc
            if attempt + 1 < policy.attempts:
                pause = policy.delay(attempt)
                log.warning(
                    "%s failed (%s); retry %d/%d in %.1fs",
                    what,
                    _short(exc),
                    attempt + 1,
                    policy.attempts - 1,
                    pause,
                )
                time.sleep(pause)
    raise RegistryUnavailableError(
        f"{what}: the tracking server at {mlflow.get_tracking_uri()} did not answer after "
        f"{policy.attempts} attempts over {time.monotonic() - started:.1f}s ({_short(last)}); "
        "check that it is running, then re-run: completed steps are not repeated"
    ) from last


def log_inputs(mlclient: MlflowClient, run_id: str, datasets: list) -> None:
    """``log_inputs``, once more where another run of the experiment created the same dataset (name and
    digest) between the store's look-up and its insert: the store then refuses the second insert
    ("UNIQUE constraint failed: datasets..."), and the dataset it looked for now exists. The models of
    one `kiln zoo` run recorded at once with the same recorded data met it (a 2-core Zen 3, 2026-11-28)."""
    try:
        mlclient.log_inputs(run_id, datasets=datasets)
    except MlflowException as exc:
        text = str(exc).lower()
        if "datasets" not in text or not any(k in text for k in ("unique constraint", "duplicate")):
            raise
        mlclient.log_inputs(run_id, datasets=datasets)


def _short(exc: BaseException | None, limit: int = 300) -> str:
    text = f"{type(exc).__name__}: {exc}" if exc is not None else "no error"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def embedded_uri(workdir: str | os.PathLike | None = None) -> str:
    """The embedded default store: ``sqlite:///<workdir>/mlflow.db``."""
    root = Path(workdir or os.getcwd()).resolve()
    return f"sqlite:///{root / 'mlflow.db'}"


def embedded_artifact_root(workdir: str | os.PathLike | None = None) -> Path:
    return Path(workdir or os.getcwd()).resolve() / "mlruns"


def is_embedded(uri: str) -> bool:
    return uri.startswith("sqlite:") or uri.startswith("file:") or "://" not in uri


def resolve_tracking_uri(workdir: str | os.PathLike | None = None) -> str:
    """The URI kiln uses: the one the user set, else the embedded sqlite store under ``workdir``."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if mlflow.is_tracking_uri_set():
        return mlflow.get_tracking_uri()
    return embedded_uri(workdir)


def configure(tracking_uri: str | None = None, workdir: str | os.PathLike | None = None) -> str:
    """Point MLflow (tracking and registry) at ``tracking_uri`` or kiln's default; return the URI."""
    # Cap MLflow's internal HTTP retries (default: 7 with factor 2, ~4 minutes) unless the user chose.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    # Batch logs and CLI output stay readable: no per-file download progress bars.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = tracking_uri or resolve_tracking_uri(workdir)
    if mlflow.get_tracking_uri() != uri or not mlflow.is_tracking_uri_set():
        mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return uri


def client(tracking_uri: str | None = None) -> MlflowClient:
    uri = configure(tracking_uri)
    if uri.startswith("sqlite:"):
        _initialize_sqlite_store(uri)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


@functools.cache
def _initialize_sqlite_store(uri: str) -> None:
    """Create (or migrate) an embedded sqlite store in one process at a time.

    MLflow creates a fresh store's tables and runs its migrations when a process first opens it, with
    no lock: two ``kiln zoo`` runs starting together on a fresh store both ran them, and one failed
    (``the zoo run stopped before any model ran: dimension_attributes``, a table the other had just
    made; or ``duplicate column name``). A file lock beside the database serialises the first open;
    later opens find the tables made and pass straight through. Once per process and URI.
    """
    from filelock import FileLock

    path = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
    if not path.parent.is_dir():
        return  # MLflow names the problem itself on first use
    with FileLock(str(path) + ".init.lock", timeout=300):
        mlclient = MlflowClient(tracking_uri=uri, registry_uri=uri)  # opens the store: eager in MLflow 3
        mlclient.search_experiments(max_results=1)  # opens the tracking store: tables, migrations
        mlclient.search_registered_models(max_results=1)  # and the registry's


def experiment_name(name: str | None = None) -> str:
    return name or os.environ.get(EXPERIMENT_ENV) or DEFAULT_EXPERIMENT


def ensure_experiment(
    mlclient: MlflowClient, name: str | None = None, policy: RetryPolicy | None = None
) -> str:
    """The experiment's id, created if missing (embedded stores keep artifacts under ``./mlruns``)."""
    name = experiment_name(name)

    def get_or_create() -> str:
        found = mlclient.get_experiment_by_name(name)
        if found is not None:
            return found.experiment_id
        location = None
        if is_embedded(mlclient.tracking_uri):
            location = (embedded_artifact_root() / name).as_uri()
        try:
            return mlclient.create_experiment(name, artifact_location=location)
        except MlflowException as exc:
            # Two zoo runs creating it at once: the loser reads the winner's.
            if exc.error_code == "RESOURCE_ALREADY_EXISTS":
                return mlclient.get_experiment_by_name(name).experiment_id
            raise

    return call_with_retry(get_or_create, f"get or create experiment {name!r}", policy)
