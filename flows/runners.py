"""Where tasks run: threads in the flow's process, or a Dask cluster (prefect-dask), by configuration.

``task_runner: thread`` builds engines in a thread pool of the flow run's process (a Prefect worker or
the CLI). ``task_runner: dask`` fans builds out over a Dask cluster: an existing scheduler
(``dask.address: tcp://host:8786``) or, without an address, a ``LocalCluster`` started for the run.
Engine builds hold a leased Prefect concurrency slot per device (``tasks.concurrency``), so parallel
builds never oversubscribe a GPU whichever runner is used.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

from tasks.concurrency import ensure_limits
from zoo.config import ZooConfigError, ZooSettings


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


def ensure_build_limits(settings: ZooSettings, devices: Iterable[str]) -> dict[str, int]:
    """Create or update each device's engine-build concurrency limit (leased slots); returns name -> limit."""
    return ensure_limits({d: settings.build_limit(d) for d in sorted(set(devices))})
