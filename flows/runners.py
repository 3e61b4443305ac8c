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

from prefect.exceptions import TerminationSignal
from prefect.task_runners import ThreadPoolTaskRunner

from tasks.concurrency import ensure_limits
from zoo.errors import ZooConfigError
from zoo.settings import ZooSettings


class PromptThreadPoolTaskRunner(ThreadPoolTaskRunner):
    """Prefect's thread pool, except that a flow ended by a signal does not wait for its threads.

    Prefect's pool joins its worker threads on exit. After SIGTERM that join waited for every running
    build, and for every build still waiting for a slot (up to the slot timeout): the CLI hung for
    minutes. Here a run ended by SIGTERM, Ctrl-C or SystemExit cancels what has not started and lets
    the running threads go; the process then exits (``flows.server`` ends it after a grace period).
    """

    def __exit__(self, exc_type: Any, exc_value: Any, traceback: Any) -> None:
        if exc_type is not None and issubclass(exc_type, (TerminationSignal, KeyboardInterrupt, SystemExit)):
            for event in self._cancel_events.values():
                event.set()
            if self._executor is not None:
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = None
        super().__exit__(exc_type, exc_value, traceback)


def task_runner_for(settings: ZooSettings, dask_address: str | None = None) -> Any:
    """A Prefect task runner for one compile: threads, or Dask at ``dask_address`` / its own LocalCluster."""
    if settings.task_runner == "thread":
        return PromptThreadPoolTaskRunner(max_workers=settings.max_workers)
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
