"""Moving a package to and from the artifact store one file at a time, with running progress.

A package is hundreds of MB; a person at a terminal and a Prefect worker's log both need to see it
move, not a size before and a rate after. MLflow's client moves one file per call here
(``MlflowClient.log_model_artifact``, ``mlflow.artifacts.download_artifacts``), and after each file a
:class:`Progress` (bytes done / total) goes to the caller's callback, or to a rich progress bar on a
terminal; in any case throttled log lines go to ``kiln.registry`` (every 10 % or 5 s, and the end).

Integrity does not rest on the order of anything here: a version is registered only after the upload
returned (:mod:`registry.tracking`), and a download is verified file by file against its manifest
before anything is loaded (:mod:`registry.lookup`). The order still helps: ``MLmodel``, which makes a
directory a loadable model, goes up last, so a cut-off upload is never even a model.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import mlflow
from mlflow import MlflowClient
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, TextColumn, TransferSpeedColumn
from rich.progress import Progress as RichProgress

from registry.config import RetryPolicy, call_with_retry

log = logging.getLogger("kiln.registry")

LAST_FILE = "MLmodel"  # uploaded last: a partial upload is not a model


@dataclass(frozen=True)
class Progress:
    """One report: ``path`` (relative to the model directory) has just been moved."""

    direction: str  # "upload" or "download"
    name: str  # what moves: the model, or registered model and version
    path: str
    done: int  # bytes moved so far, this file included
    total: int
    files_done: int
    files_total: int

    @property
    def percent(self) -> float:
        return 100.0 * self.done / self.total if self.total else 100.0


ProgressCallback = Callable[[Progress], None]


class LogLines:
    """Progress as log lines, for logs nobody watches live: at most one per ``step`` of the bytes or
    per ``seconds``, whichever comes first, and always the last."""

    def __init__(self, step: float = 10.0, seconds: float = 5.0, clock: Callable[[], float] = time.monotonic):
        self.step, self.seconds, self.clock = step, seconds, clock
        self.started = self.last_time = clock()
        self.last_percent = 0.0

    def __call__(self, p: Progress) -> None:
        now = self.clock()
        last = p.files_done == p.files_total
        if not last and p.percent - self.last_percent < self.step and now - self.last_time < self.seconds:
            return
        self.last_percent, self.last_time = p.percent, now
        rate = p.done / 1e6 / max(now - self.started, 1e-6)
        log.info(
            "%sing %s: %.1f/%.1f MB (%.0f%%, file %d/%d, %.1f MB/s)",
            p.direction,
            p.name,
            p.done / 1e6,
            p.total / 1e6,
            p.percent,
            p.files_done,
            p.files_total,
            rate,
        )


@contextlib.contextmanager
def reporting(
    direction: str,
    name: str,
    total: int,
    on_progress: ProgressCallback | None,
    console: Console | None = None,
) -> Iterator[ProgressCallback]:
    """The callback a transfer reports to: log lines, plus ``on_progress`` when given, else a rich
    bar when stderr (or ``console``) is a terminal."""
    lines = LogLines()
    from registry.terminal import SafeConsole

    console = console or SafeConsole(stderr=True)
    if on_progress is None and console.is_terminal:
        columns = (TextColumn("{task.description}"), BarColumn(), DownloadColumn(), TransferSpeedColumn())
        with RichProgress(*columns, console=console, transient=True) as bar:
            task = bar.add_task(f"{direction} {name}", total=total)

            def both(p: Progress) -> None:
                bar.update(task, completed=p.done)
                lines(p)

            yield both
        return
    callbacks = [lines] if on_progress is None else [on_progress, lines]

    def each(p: Progress) -> None:
        for callback in callbacks:
            callback(p)

    yield each


def _upload_order(local_dir: Path) -> list[Path]:
    files = sorted(p for p in local_dir.rglob("*") if p.is_file())
    return sorted(files, key=lambda p: p.relative_to(local_dir).as_posix() == LAST_FILE)


def upload_model_dir(
    mlclient: MlflowClient,
    model_id: str,
    local_dir: Path,
    name: str,
    *,
    on_progress: ProgressCallback | None = None,
    policy: RetryPolicy | None = None,
) -> int:
    """Upload ``local_dir`` into logged model ``model_id``, file by file (``MLmodel`` last); bytes sent.

    Each file is retried on its own (:func:`registry.config.call_with_retry`); a file sent again
    replaces itself.
    """

    def send(rel: str) -> None:
        folder = PurePosixPath(rel).parent.as_posix()
        mlclient.log_model_artifact(model_id, str(local_dir / rel), None if folder == "." else folder)

    files = [(p.relative_to(local_dir).as_posix(), p.stat().st_size) for p in _upload_order(local_dir)]
    return _transfer("upload", name, files, send, on_progress, policy)


def _list_files(artifact_uri: str, policy: RetryPolicy | None, prefix: str = "") -> list[tuple[str, int]]:
    """(path relative to ``artifact_uri``, bytes) of every file under it."""
    here = f"{artifact_uri.rstrip('/')}/{prefix}" if prefix else artifact_uri
    found = call_with_retry(
        lambda: mlflow.artifacts.list_artifacts(artifact_uri=here), f"list {here}", policy
    )
    files = []
    for info in found:
        rel = f"{prefix}/{PurePosixPath(info.path).name}" if prefix else PurePosixPath(info.path).name
        if info.is_dir:
            files += _list_files(artifact_uri, policy, rel)
        else:
            files.append((rel, int(info.file_size or 0)))
    return files


def download_model_dir(
    artifact_uri: str,
    dst: Path,
    name: str,
    *,
    select: Callable[[Path], str] | None = None,
    on_progress: ProgressCallback | None = None,
    policy: RetryPolicy | None = None,
) -> Path:
    """Download the files under ``artifact_uri`` into ``dst`` (same layout), file by file; ``dst``.

    ``select``: given ``dst`` with ``MLmodel`` in it (fetched first), the folder (relative path) whose
    files are wanted beside ``MLmodel``; the rest (the ~165 code files a pyfunc model carries for
    ``mlflow.pyfunc.load_model``, one request each) stays in the store. ``None``: every file.
    Nothing here is verified: the caller verifies the result before using any of it.
    """
    files = _list_files(artifact_uri, policy)
    if not files:  # deleted from the store, or never uploaded: nothing to download is an error
        raise FileNotFoundError(f"no files under {artifact_uri}")

    def fetch(rel: str) -> None:
        folder = dst / PurePosixPath(rel).parent
        folder.mkdir(parents=True, exist_ok=True)
        mlflow.artifacts.download_artifacts(
            artifact_uri=f"{artifact_uri.rstrip('/')}/{rel}", dst_path=str(folder)
        )

    here: set[str] = set()
    if select is not None and any(rel == LAST_FILE for rel, _ in files):
        call_with_retry(lambda: fetch(LAST_FILE), f"download {LAST_FILE} of {name}", policy)
        here.add(LAST_FILE)
        wanted = select(dst).strip("/") + "/"
        files = [(rel, size) for rel, size in files if rel == LAST_FILE or rel.startswith(wanted)]
        files.sort(key=lambda item: item[0] != LAST_FILE)
    # MLmodel, already here, is reported with the rest: the progress counts what is on disk.
    _transfer("download", name, files, lambda rel: rel in here or fetch(rel), on_progress, policy)
    return dst


def _transfer(
    direction: str,
    name: str,
    files: list[tuple[str, int]],
    move: Callable[[str], None],
    on_progress: ProgressCallback | None,
    policy: RetryPolicy | None,
) -> int:
    """``move`` each of ``files`` ((relative path, bytes)) in turn, each retried on its own, reporting
    after each; the bytes moved."""
    total, done = sum(size for _, size in files), 0
    with reporting(direction, name, total, on_progress) as report:
        for index, (rel, size) in enumerate(files, 1):
            call_with_retry(lambda rel=rel: move(rel), f"{direction} {rel} of {name}", policy)
            done += size
            report(Progress(direction, name, rel, done, total, index, len(files)))
    return total
