"""Where tasks run: threads in the flow's process, or a Dask cluster (prefect-dask), by configuration.

``task_runner: thread`` builds engines in a thread pool of the flow run's process (a Prefect worker or
the CLI). ``task_runner: dask`` fans builds out over a Dask cluster: an existing scheduler
(``dask.address: tcp://host:8786``) or, without an address, a ``LocalCluster`` started for the run.
Engine-build tags carry a Prefect concurrency limit per target device, so parallel builds never
oversubscribe a GPU whichever runner is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from flows.zoo_config import ZooConfigError, ZooSettings
from tasks.stages import build_tag


def task_runner_for(settings: ZooSettings, dask_address: str | None = None) -> Any:
    """A Prefect task runner for one compile: threads, or Dask at ``dask_address`` / its own LocalCluster."""
    if settings.task_runner == "thread":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=settings.max_workers)
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError as exc:
        raise ZooConfigError(
            f"settings.task_runner: 'dask' needs prefect-dask ({exc}); "
            "pip install prefect-dask 'dask[distributed]' or use task_runner: thread"
        ) from None
    address = dask_address or settings.dask.address
    if address:
        return DaskTaskRunner(address=address)
    return DaskTaskRunner(
        cluster_class="distributed.LocalCluster",
        cluster_kwargs={
            "n_workers": settings.dask.n_workers,
            "threads_per_worker": settings.dask.threads_per_worker,
            "processes": settings.dask.processes,
        },
    )


@contextlib.contextmanager
def shared_dask_cluster(settings: ZooSettings) -> Iterator[str | None]:
    """One LocalCluster for a whole zoo run (when Dask is asked for without an address); yields its address.

    Every model's flow connects to the same cluster instead of starting its own.
    """
    if settings.task_runner != "dask" or settings.dask.address:
        yield settings.dask.address
        return
    from distributed import LocalCluster

    with LocalCluster(
        n_workers=settings.dask.n_workers,
        threads_per_worker=settings.dask.threads_per_worker,
        processes=settings.dask.processes,
        dashboard_address=None,
    ) as cluster:
        yield cluster.scheduler_address


def ensure_build_limits(settings: ZooSettings, targets: Iterable[str]) -> dict[str, int]:
    """Create or update the tag concurrency limit of each target's engine builds; returns tag -> limit."""
    from prefect import get_client

    limits = {build_tag(t): settings.build_limit(t) for t in sorted(set(targets))}
    with get_client(sync_client=True) as client:
        for tag, limit in limits.items():
            client.create_concurrency_limit(tag=tag, concurrency_limit=limit)
    return limits
