"""This machine's own AOTInductor package of an engine, built in a background process (issue 34).

An engine whose AOTInductor package may not run here (its package is not trusted to run code, or the
package does not load on this machine) is served at once by its graph compiled here from its program,
while a detached process builds this machine's own native package from the same program, with this
machine's compiler and kiln's own settings, checks it in a fresh process and puts it into the local
engine cache (trusted input, docs/security.md). Loads after that run natively, as a trusted load does:
no Inductor compiler, no Triton compiler imported. The first caller never waits for the C++ build
(minutes on a GPU host).

A build is a job directory under the local cache, ``<cache>/native-builds/<key>/``: the program, the
weights the check runs with (the loading process's own), and ``job.json`` (what was compiled and how:
engine IO, kiln's options, device, precision). The worker takes the entry's build lock without waiting: a
second process that finds it held leaves the build to the first (one build per entry across
processes), and one that finds the entry built does nothing. What happened is appended to the cache's
log, ``<cache>/native-builds.log`` (one JSON object per line: started, built, failed or skipped, with
the key, seconds and the reason), which ``kiln cache ls`` shows; a failed build leaves the served graph
serving and is tried again by the next load that finds no package.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiler import json_reader

if TYPE_CHECKING:  # torch where a build runs or a package loads, not on import (kiln cache ls reads the log)
    import torch

    from compiler.backends.inductor.aot import AotGraph

LOG_NAME = "native-builds.log"
LOG_READ_BYTES = 4 << 20  # what `kiln cache ls` reads of the log: its last lines
JOBS_DIR = "native-builds"
MODE_ENV = "KILN_NATIVE_BUILD"  # "background" (default), "inline" (wait for it), "off"
_MODES = ("background", "inline", "off")


@dataclass
class NativeBuild:
    """A started build: its entry key, job directory and process (None once it ran inline)."""

    key: str
    job: Path
    process: subprocess.Popen | None

    def wait(self, timeout: float | None = None) -> int | None:
        """The worker's exit status (None where it ran inline); TimeoutExpired past ``timeout``."""
        return None if self.process is None else self.process.wait(timeout)


_STARTED: dict[str, NativeBuild] = {}  # this process's builds by entry key


def build_mode() -> str:
    mode = os.environ.get(MODE_ENV, "background").strip().lower() or "background"
    if mode not in _MODES:
        from compiler.errors import BuildSettingsError

        raise BuildSettingsError(f"${MODE_ENV}={mode!r}: expected one of {list(_MODES)}")
    return mode


def running(key: str) -> NativeBuild | None:
    """This process's build of ``key`` while its worker runs."""
    build = _STARTED.get(key)
    return build if build is not None and build.process is not None and build.process.poll() is None else None


def write_job(
    cache_dir: Path, key: str, program: bytes, weights: Sequence[Any], job: Mapping[str, Any]
) -> Path:
    """The job's directory, written: the program, the weights (copied to the host) and ``job.json``."""
    from safetensors.torch import save_file

    jobs = cache_dir / JOBS_DIR
    jobs.mkdir(mode=0o700, exist_ok=True)
    _sweep(jobs)
    # One directory per attempt: a second process's job never overwrites a running worker's files.
    directory = jobs / f"{key}.{uuid.uuid4().hex[:8]}"
    directory.mkdir(mode=0o700)
    (directory / "program.pt2").write_bytes(program)
    save_file(
        {f"w{i}": w.detach().cpu().contiguous() for i, w in enumerate(weights)},
        directory / "weights.safetensors",
    )
    # The worker is a fresh process: the custom ops its program calls (kiln's decode attention in a
    # generation package's decode program) are registered there from the modules registered here.
    try:
        from compiler.program.text import registered_op_modules

        ops = registered_op_modules(program)
    except Exception:  # not a readable archive: the worker's own read says why, in the log
        ops = []
    (directory / "job.json").write_text(json.dumps({**job, "key": key, "op_modules": ops}, sort_keys=True))
    return directory


def start(
    cache_dir: Path,
    key: str,
    program: bytes,
    weights: Sequence[Any],
    job: Mapping[str, Any],
    *,
    written: Future[Path] | None = None,
) -> NativeBuild | None:
    """Write the job (or take the one ``written`` already) and start its worker (detached: it
    outlives a caller that exits); None where builds are off. ``job``: io, options, device,
    precision, frozen, target, torch."""
    mode = build_mode()
    if mode == "off":
        return None
    if (build := running(key)) is not None:  # the instances of one engine (dedup) share its build
        if written is not None:
            shutil.rmtree(written.result(), ignore_errors=True)
        return build
    directory = written.result() if written is not None else write_job(cache_dir, key, program, weights, job)
    command = [sys.executable, "-m", "compiler.backends.inductor.native", str(directory)]
    if mode == "inline":
        subprocess.run(command, check=False, env=_worker_env(), timeout=3600)
        return NativeBuild(key, directory, None)
    with open(directory / "worker.log", "wb") as log:
        process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=_worker_env(),
            start_new_session=True,  # not killed with a serving process that exits or is interrupted
        )
    _STARTED[key] = NativeBuild(key, directory, process)
    return _STARTED[key]


class LocalAot:
    """This machine's own AOTInductor package of an engine whose package carried one that may not run
    here (not trusted to run code, or it does not load on this machine).

    The package's AOTInductor bytes are native code and never run untrusted. Instead the first such
    load serves the engine's graph compiled here and starts building this machine's own package in the
    background (``compiler.backends.inductor.native``), from the engine's program with this machine's
    compiler and kiln's own settings, checked in a fresh process like a compile's, kept in the local
    engine cache (trusted input, docs/security.md) keyed by what was compiled. Loads after it run
    natively, as a trusted load does: no Inductor imported, no recompile.
    """

    def __init__(
        self,
        wanted: bool,
        program: bytes,
        options: Mapping[str, Any],
        device: torch.device,
        target: str,
        header: Mapping[str, Any],
        cache: Any = None,
    ):
        from compiler.backends.inductor.graph import LocalCompiled

        self.wanted, self.device, self.options, self.header = wanted, device, options, header
        self.program, self.target = program, target
        self.entry = LocalCompiled(program, options, target, aot=True, cache=cache) if wanted else None
        self._written: Future[Path] | None = None  # the job, being written (prepare)

    def loaded(self) -> AotGraph | None:
        """The package built here before, loaded; None where there is none (or not wanted)."""
        from compiler.backends.inductor.aot import AotGraph

        data = self.entry.read() if self.entry is not None else None
        if data is None:
            return None
        try:
            return AotGraph(data, self.device, self.header["constants"])
        except Exception:  # built by another torch or toolchain since: build it again
            return None

    def will_build(self) -> bool:
        """Whether a load that compiles the engine starts this package's build (wanted, builds on, a
        local cache): then the loads after it run natively."""
        return self.entry is not None and build_mode() != "off" and self.entry._cache() is not None

    def prepare(self, io: Any, weights: Sequence[torch.Tensor], why: str = "") -> None:
        """Write the build's job on a thread while this load compiles the engine (the weights' copy to
        the host and their file take ~0.8 s for OPT-350m's on the H200's host); :meth:`start` waits
        for it and starts the worker."""
        if not self.will_build() or running(self.entry.key) is not None:
            return
        pool = ThreadPoolExecutor(1, thread_name_prefix="kiln-native-job")
        args = (self.entry._cache().directory, self.entry.key, self.program, weights, self._job(io, why))
        self._written = pool.submit(write_job, *args)
        pool.shutdown(wait=False)

    @contextlib.contextmanager
    def discarded_on_error(self) -> Iterator[None]:
        """Around the compile :meth:`prepare` runs beside: where it raises, the job written for a build
        that will not start is removed (else it waited for the 24 h sweep)."""
        try:
            yield
        except BaseException:
            written, self._written = self._written, None
            if written is not None and written.exception() is None:  # waits for it: a second at most
                shutil.rmtree(written.result(), ignore_errors=True)
            raise

    def _job(self, io: Any, why: str) -> dict[str, Any]:
        import torch

        return {
            "io": io.to_dict(),
            "options": dict(self.options),
            "device": str(self.device),
            "precision": str(self.header.get("precision", "fp32")),
            "frozen": bool(self.header.get("frozen")),
            "target": self.target,
            "torch": torch.__version__,
            "why": why,  # why the package's own does not serve here: the log's "started" line says so
        }

    def start(self, io: Any, weights: Sequence[torch.Tensor], why: str = "") -> Any:
        """Start building it (``compiler.backends.inductor.native``: a detached process by default,
        ``$KILN_NATIVE_BUILD=inline`` waits for it, ``off`` builds none), warned; the build handle, or
        None where there is no local cache or builds are off. ``why``: why the package's own does not
        serve here, for the cache's log."""
        import warnings

        cache = self.entry._cache() if self.entry is not None else None
        if cache is None:
            return None
        written, self._written = self._written, None
        build = start(
            cache.directory, self.entry.key, self.program, weights, self._job(io, why), written=written
        )
        if build is not None:
            how = (
                "was built"
                if build.process is None
                else f"is being built in the background (pid {build.process.pid})"
            )
            warnings.warn(
                "Inductor engine: serving its graph compiled here from its program; this machine's own "
                f"AOTInductor package {how} into the local engine cache {cache.directory}, and loads after "
                f"it run natively (its log: {cache.directory / LOG_NAME})",
                stacklevel=4,
            )
        return build


def _sweep(jobs: Path, max_age_s: float = 24 * 3600) -> None:
    """Remove job directories a killed worker left (a worker removes its own when it ends)."""
    cutoff = time.time() - max_age_s
    for job in jobs.iterdir():
        try:
            if job.is_dir() and not job.is_symlink() and job.stat().st_mtime < cutoff:
                shutil.rmtree(job, ignore_errors=True)
        except OSError:
            continue


def _worker_env() -> dict[str, str]:
    # The worker imports kiln as this process did: the folder that holds compiler/ on its path.
    root = str(Path(__file__).resolve().parents[3])
    path = os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{path}" if path else root}


def log_events(cache_dir: Path) -> list[dict[str, Any]]:
    """The cache's native-build log, oldest first (its last :data:`LOG_READ_BYTES`; lines that are not
    a JSON object within compiler.json_reader's bounds are skipped)."""
    try:
        flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)  # a FIFO in its place must not hang `cache ls`
        with os.fdopen(os.open(cache_dir / LOG_NAME, flags), "rb") as file:
            if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
                return []
            size = os.fstat(file.fileno()).st_size
            file.seek(max(0, size - LOG_READ_BYTES))
            lines = file.read(LOG_READ_BYTES).decode("utf-8", errors="replace").splitlines()
    except OSError:
        return []
    events = []
    for line in lines[-10000:]:
        try:
            event = json_reader.loads(line, f"{LOG_NAME} line", max_bytes=64 << 10)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("key"), str):
            events.append(event)
    return events


def latest(cache_dir: Path) -> dict[str, dict[str, Any]]:
    """key -> the last event logged for it."""
    return {event["key"]: event for event in log_events(cache_dir)}


def _log(cache_dir: Path, event: Mapping[str, Any]) -> None:
    line = json.dumps({"time": round(time.time(), 3), "pid": os.getpid(), **event}, sort_keys=True)
    # One write of one line in append mode: lines of concurrent workers do not interleave.
    with open(cache_dir / LOG_NAME, "a", encoding="utf-8") as file:
        file.write(line + "\n")


def _run(directory: Path) -> int:
    job = json_reader.read_file(directory / "job.json")
    key = job["key"]
    why = str(job.get("why", ""))[:500]  # why the engine's own package does not serve here
    from filelock import FileLock, Timeout

    from compiler.cache.local import EngineCache

    cache = EngineCache(directory.parent.parent)
    # Its own lock, not the entry's: putting the entry takes that one.
    lock = FileLock(str(directory.parent / f"{key}.lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:  # another process builds this entry: one build
        _log(cache.directory, {"key": key, "state": "skipped", "reason": "another process is building it"})
        return 0
    try:
        if cache.get(key) is not None:
            _log(cache.directory, {"key": key, "state": "skipped", "reason": "already built"})
            return 0
        _log(cache.directory, {"key": key, "state": "started", "why": why})
        start_time = time.perf_counter()
        try:
            built, note = _build(directory, job)
        except Exception as exc:  # the build's own failure is the log's news, never the caller's
            from compiler.backends.inductor.graph import short_error

            built, note = None, short_error(exc)
        seconds = round(time.perf_counter() - start_time, 2)
        if built is not None:
            try:
                meta = {"kind": "inductor-local-aot", "torch": job["torch"], "target": job["target"]}
                cache.put(key, built, meta)
            except Exception as exc:  # a cache that cannot take it: the build did not help
                built, note = None, f"built, but the engine cache did not take it: {exc}"
        if built is None:
            failed = {"key": key, "state": "failed", "seconds": seconds, "reason": note[:2000], "why": why}
            _log(cache.directory, failed)
            return 1
        _log(
            cache.directory, {"key": key, "state": "built", "seconds": seconds, "compiler": note, "why": why}
        )
        return 0
    finally:
        lock.release()
        shutil.rmtree(directory, ignore_errors=True)


def _build(directory: Path, job: Mapping[str, Any]) -> tuple[bytes | None, str]:
    import torch
    from safetensors.torch import load_file

    from compiler.backends.base import EngineIO
    from compiler.backends.inductor.aot import aot_from_program

    for module in job.get("op_modules", []):  # written by the load that started this build
        if not (isinstance(module, str) and re.fullmatch(r"[A-Za-z_][\w.]*", module)):
            raise ValueError(f"job: op module {module!r:.80} is not a module name")
        importlib.import_module(module)
    device = torch.device(job["device"])
    tensors = load_file(str(directory / "weights.safetensors"), device=str(device))
    weights = tuple(tensors[f"w{i}"] for i in range(len(tensors)))
    program = (directory / "program.pt2").read_bytes()
    io = EngineIO.from_dict(job["io"])
    return aot_from_program(
        program, io, weights, job["options"], device, job["precision"], frozen=bool(job["frozen"])
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 1:
        print("usage: python -m compiler.backends.inductor.native JOB_DIR", file=sys.stderr)
        return 2
    directory = Path(args[0])
    try:
        return _run(directory)
    except Exception as exc:  # the worker itself broke: said in the cache's log, then raised (worker.log)
        key = directory.name.split(".")[0]
        reason = f"{type(exc).__name__}: {exc}"
        _log(directory.parent.parent, {"key": key, "state": "failed", "reason": reason})
        raise


if __name__ == "__main__":
    raise SystemExit(main())
