"""Zoo runs: the parent MLflow run a zoo compile's package runs nest under.

One per ``kiln zoo`` (:func:`zoo_run` in this context, :func:`start_zoo_run` where the run outlives a
block) or per outside run such as a Prefect flow run (:func:`zoo_run_for`, found by tag so that the
parallel models of one zoo share it). Each is tagged with its host and process, so that the next zoo
run on the host ends those whose process died (``KILLED``) instead of leaving them RUNNING.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from mlflow import MlflowClient
from mlflow.entities import Param

from registry import config
from registry.config import RetryPolicy, call_with_retry
from registry.errors import RegistryUnavailableError

log = logging.getLogger("kiln.registry")

TAG_KIND = "kiln.kind"
TAG_ERROR = "kiln.error"
TAG_ZOO_HOST = "kiln.zoo.host"
TAG_ZOO_PROCESS = "kiln.zoo.process"
TAG_ZOO_KEY = "kiln.zoo_key"
PARENT_ENV = "KILN_MLFLOW_PARENT_RUN_ID"

# The zoo run of the current context (thread or Prefect task); record_package nests under it.
_zoo_run: contextvars.ContextVar[str | None] = contextvars.ContextVar("kiln_zoo_run", default=None)


@contextlib.contextmanager
def zoo_run(
    name: str = "zoo",
    params: Mapping[str, Any] | None = None,
    *,
    experiment: str | None = None,
    tracking_uri: str | None = None,
    policy: RetryPolicy | None = None,
) -> Iterator[str]:
    """A parent run for one zoo recompile; ``record_package`` calls inside nest under it.

    Yields the run id (pass it on explicitly as ``parent_run_id`` where work leaves this context,
    e.g. to Dask workers). The run ends ``FINISHED``, or ``FAILED`` if the block raised.
    """
    run_id = start_zoo_run(name, params, experiment=experiment, tracking_uri=tracking_uri, policy=policy)
    token = _zoo_run.set(run_id)
    status = "FAILED"
    try:
        yield run_id
        status = "FINISHED"
    finally:
        _zoo_run.reset(token)
        end_run(run_id, status, tracking_uri=tracking_uri, policy=policy)


def start_zoo_run(
    name: str = "zoo",
    params: Mapping[str, Any] | None = None,
    *,
    experiment: str | None = None,
    tracking_uri: str | None = None,
    policy: RetryPolicy | None = None,
) -> str:
    """A new parent run, tagged with this host and process; first, this host's zoo runs whose process
    is gone (killed, or its end never reached a restarted server) are ended ``KILLED``."""
    mlclient = config.client(tracking_uri)
    experiment_id = config.ensure_experiment(mlclient, experiment, policy)
    host, process = socket.gethostname(), _process_token(os.getpid())
    tags = {"mlflow.runName": name, TAG_KIND: "zoo", TAG_ZOO_HOST: host}
    if process is not None:
        tags[TAG_ZOO_PROCESS] = process
        end_abandoned_zoo_runs(mlclient, experiment_id, host, policy)

    def create() -> str:
        run = mlclient.create_run(experiment_id, tags=tags)
        if params:
            mlclient.log_batch(run.info.run_id, params=[Param(k, str(v)) for k, v in sorted(params.items())])
        return run.info.run_id

    return call_with_retry(create, f"start zoo run {name}", policy)


def _process_token(pid: int) -> str | None:
    """``<pid>:<start time>`` of a live process (Linux ``/proc``; a reused pid has another start
    time), or None when there is no such process or no ``/proc``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{pid}:{stat.rsplit(')', 1)[1].split()[19]}"


def end_abandoned_zoo_runs(
    mlclient: MlflowClient, experiment_id: str, host: str, policy: RetryPolicy | None = None
) -> list[str]:
    """End ``KILLED`` every RUNNING zoo run of ``host`` whose process no longer exists; their ids."""
    query = (
        f"tags.`{TAG_KIND}` = 'zoo' and attributes.status = 'RUNNING' and tags.`{TAG_ZOO_HOST}` = '{host}'"
    )

    def find() -> list[Any]:
        return mlclient.search_runs([experiment_id], filter_string=query, max_results=100)

    ended = []
    for run in call_with_retry(find, "find open zoo runs", policy):
        token = run.data.tags.get(TAG_ZOO_PROCESS, "")
        pid = token.split(":", 1)[0]
        if not pid.isdigit() or _process_token(int(pid)) == token:
            continue  # still running (or not ours to judge)
        run_id = run.info.run_id

        def end(run_id: str = run_id) -> None:
            mlclient.set_tag(run_id, TAG_ERROR, "its process ended before the zoo run did (killed)")
            mlclient.set_terminated(run_id, "KILLED")

        call_with_retry(end, f"end abandoned zoo run {run_id}", policy)
        log.warning("zoo run %s: its process %s is gone; marked KILLED", run_id, token)
        ended.append(run_id)
    return ended


def current_zoo_run() -> str | None:
    """The parent run set by :func:`zoo_run` in this context, or ``$KILN_MLFLOW_PARENT_RUN_ID``."""
    return _zoo_run.get() or os.environ.get(PARENT_ENV) or None


def zoo_run_for(
    key: str,
    name: str,
    *,
    experiment: str | None = None,
    tracking_uri: str | None = None,
    policy: RetryPolicy | None = None,
) -> str:
    """The zoo run for an outside run id (e.g. the Prefect zoo flow run): found by tag, else created.

    Models of one zoo compile in parallel, so find-or-create runs under a lock; should two hosts
    still race, the oldest run with the key is the one every caller returns.
    """
    from registry.models import registry_lock

    mlclient = config.client(tracking_uri)
    experiment_id = config.ensure_experiment(mlclient, experiment, policy)
    query = f"tags.`{TAG_ZOO_KEY}` = '{key}'"

    def find() -> str | None:
        runs = mlclient.search_runs(
            [experiment_id], filter_string=query, max_results=10, order_by=["attributes.start_time ASC"]
        )
        return runs[0].info.run_id if runs else None

    with registry_lock(mlclient, f"zoo-run:{key}"):
        found = call_with_retry(find, f"find zoo run {key}", policy)
        if found:
            return found
        tags = {"mlflow.runName": name, TAG_KIND: "zoo", TAG_ZOO_KEY: key}
        call_with_retry(
            lambda: mlclient.create_run(experiment_id, tags=tags), f"start zoo run {name}", policy
        )
        return call_with_retry(find, f"find zoo run {key}", policy) or ""


def end_run(
    run_id: str,
    status: str = "FINISHED",
    *,
    tracking_uri: str | None = None,
    policy: RetryPolicy | None = None,
) -> None:
    mlclient = config.client(tracking_uri)
    try:
        call_with_retry(lambda: mlclient.set_terminated(run_id, status), f"end run {run_id}", policy)
    except RegistryUnavailableError as exc:
        log.warning("could not end run %s: %s", run_id, exc)
