"""A temporary Prefect API server for one CLI run that dies with its parent, whatever kills it.

Prefect's own ephemeral server is a plain child process: a SIGTERM or SIGKILL of the CLI left it
running (about 225 MB each). Here the CLI starts ``prefect server start`` on a free 127.0.0.1 port
with the kernel's parent-death signal set (Linux ``PR_SET_PDEATHSIG``): the server gets SIGTERM the
moment its parent dies, even by SIGKILL. SIGTERM to the CLI itself ends it through the normal exit
path, which stops the server too; if that path has not ended the process within ``SIGTERM_GRACE_S``
(worker threads still building, or waiting for a build slot), it exits at once. With
``PREFECT_API_URL`` set, the configured server is used instead.

Build slots (``tasks/concurrency.py``) are leases. Prefect's default lease storage is the server's
memory: a temporary server killed with its run took the leases with it while the slots stayed
counted in the database (``PREFECT_HOME``), so they were never given back and the next run waited
out its slot timeout. The temporary server therefore keeps leases on disk next to the database
(Prefect's filesystem lease storage), and the next run's server revokes the expired ones within its
repossessor loop (``REPOSSESSOR_LOOP_S``). A long-lived server keeps its leases in memory and
revokes them itself; one that is restarted should use the filesystem storage (or Redis) too.

A dead run's slot is taken for the rest of its lease (``tasks.concurrency.LEASE_SECONDS``, 60 s:
the shortest lease Prefect's server accepts, a bound of its API and no setting) plus at most one
repossessor loop. Prefect's default loop is 15 s; a scan of the lease index costs nothing measurable
(an idle server used 0.86 CPU-s in 30 s with a 1 s loop, 0.82 with 5 s), so the loop here is 1 s.

Prefect sends run logs and events from background workers, in batches (logs every 2 s), and what is
still queued at interpreter exit. By then the temporary server was already stopped: ``kiln release``
ended with "Error logging to API", and where a batch was in flight as the server went down, the
client retried the dead server with backoff for about a minute first (a 25 s release took 94 s).
So before the temporary server is stopped, :func:`flush_to_api` sends what is queued.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from compiler.errors import KilnError

FLUSH_TIMEOUT_S = 10.0
STARTUP_TIMEOUT = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180"))
SIGTERM_GRACE_S = 10.0
REPOSSESSOR_LOOP_S = 1
# Settings of the temporary server (the environment wins where it sets them).
SERVER_SETTINGS = {
    "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem",
    "PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": str(REPOSSESSOR_LOOP_S),
}
_PR_SET_PDEATHSIG = 1


class ServerStartError(KilnError):
    """The temporary Prefect API server did not come up."""


def die_with_parent() -> None:
    # Runs in the child between fork and exec.
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _sigterm_exits(signum: int, frame: object) -> None:
    # The normal exit path waits for worker threads, which may hold a build for minutes; past the
    # grace period the process ends at once (its server follows by PR_SET_PDEATHSIG, and the slots
    # its builds held come free when their leases expire).
    timer = threading.Timer(SIGTERM_GRACE_S, os._exit, args=(128 + signum,))
    timer.daemon = True
    timer.start()
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def prefect_api() -> Iterator[str]:
    """The API URL to use: the configured server, else a temporary one that dies with this process."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    configured = PREFECT_API_URL.value()
    if configured:
        yield configured
        return
    port = _free_port()
    url = f"http://127.0.0.1:{port}/api"
    log = tempfile.NamedTemporaryFile(prefix="kiln-prefect-server-", suffix=".log", delete=False)  # noqa: SIM115
    env = {**SERVER_SETTINGS, **{k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}}
    proc = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=env,
        preexec_fn=die_with_parent,
    )
    previous = signal.signal(signal.SIGTERM, _sigterm_exits)
    try:
        _wait_healthy(url, proc, Path(log.name))
        with temporary_settings(updates={PREFECT_API_URL: url}):
            yield url
    finally:
        signal.signal(signal.SIGTERM, previous)
        flush_to_api()  # while the server still answers
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        Path(log.name).unlink(missing_ok=True)


def flush_to_api(timeout: float = FLUSH_TIMEOUT_S) -> None:
    """Send the run logs and events Prefect still holds to the API now; wait at most ``timeout`` s in
    all (an unresponsive server must not hold the exit longer).

    Prefect's workers stop once drained; the next log or event starts a new one."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    deadline = time.monotonic() + timeout
    for worker in (APILogWorker, EventsWorker):
        try:
            worker.drain_all(timeout=max(deadline - time.monotonic(), 0.1))
        except Exception as exc:  # the server is going away anyway: never stop that
            logging.getLogger("kiln").debug("could not flush %s: %s", worker.__name__, exc)


def _wait_healthy(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ServerStartError(f"the temporary Prefect server exited ({proc.returncode}): {_tail(log)}")
        with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/health", timeout=2) as response:
            if response.status == 200:
                return
        time.sleep(0.3)
    raise ServerStartError(
        f"the temporary Prefect server did not answer within {STARTUP_TIMEOUT:.0f} s "
        f"(PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS): {_tail(log)}"
    )


def _tail(log: Path, chars: int = 2000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"
