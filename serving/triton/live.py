"""Releases that go live: a running Triton server follows ``kiln release`` / ``kiln rollback``.

:class:`TritonRelease` is the serving target ``registry.release`` takes (``live=``). Its steps run
inside the release's all-or-nothing list, after the tags and before the aliases move:

1. stage: the new champion's folder (and ``previous``'s) in the repository, downloaded and verified
   (``repository.stage_version``); undo removes the folders this step created;
2. go live: ``config.pbtxt`` now names the new champion, the server is told to load the model (it
   loads the new version, then unloads the old; requests keep being answered), and the new version
   must be READY. If the server refuses (a package that fails verification in the backend, a
   timeout), the old ``config.pbtxt`` is put back and the step fails: the aliases never move and the
   server still serves what it had. Undo (a later step failed) puts the old config back and loads it;
3. after the aliases moved: folders of versions that are neither champion nor previous are removed.

The repository lock (one writer per model of a repository, refused rather than queued) is held for
the whole release, beside the registry's own lock.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from typing import Any

from serving.triton.control import DEFAULT_LOAD_TIMEOUT_S, DEFAULT_TIMEOUT_S, TritonControl
from serving.triton.errors import RepositoryError, ServerRefusedError
from serving.triton.repository import (
    ServingSettings,
    check_repository,
    config_for,
    prune,
    read_config,
    repository_lock,
    served_version,
    stage_version,
    triton_model_name,
    write_config,
)

Step = tuple[str, Any, Any]


class TritonRelease:
    """Keep a Triton server on ``repository`` serving the champion of ``kiln.<model>.<engine_target>``."""

    def __init__(
        self,
        url: str,
        repository: str | os.PathLike,
        model: str,
        engine_target: str = "cpu",
        *,
        tracking_uri: str | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        load_timeout: float = DEFAULT_LOAD_TIMEOUT_S,
        allowed_modules: Sequence[str] | None = None,
    ):
        from registry.models import registered_model_name

        self.control = TritonControl(url, timeout=timeout, load_timeout=load_timeout)
        self.repository = check_repository(repository, write=True)
        self.model = model
        self.name = triton_model_name(model)
        self.model_dir = self.repository / self.name
        self.registered = registered_model_name(model, engine_target)
        self.tracking_uri = tracking_uri
        self.allowed_modules = allowed_modules
        # Seconds per step of the last release or rollback: "stage" (download, verify, write) and
        # "load" (the server's load call: the new version's stub started, loaded and warmed up).
        self.timings: dict[str, float] = {}

    def check(self) -> None:
        """Before anything is measured or moved: the model's folder is kiln's, for this registered
        model, and the server answers (ServerUnavailableError naming the timeout otherwise)."""
        settings = ServingSettings.read(self.model_dir)
        if settings.registered_model != self.registered:
            raise RepositoryError(
                f"{self.model_dir} serves {settings.registered_model}, not {self.registered}; name the "
                "repository that serves this model and target"
            )
        self.control.live()

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        with repository_lock(self.repository, self.name):
            yield

    def steps(self, champion: str, previous: str | None) -> tuple[list[Step], list[Step]]:
        """(before the alias moves, after them) for a release or rollback leaving these aliases."""
        from registry import config

        keep = [str(champion)] + ([str(previous)] if previous and str(previous) != str(champion) else [])
        state: dict[str, Any] = {"created": [], "config": None}

        def stage() -> None:
            started = time.perf_counter()
            mlclient = config.client(self.tracking_uri)
            for version in keep:
                _, created = stage_version(
                    mlclient,
                    self.model_dir,
                    self.model,
                    self.registered,
                    version,
                    allowed_modules=self.allowed_modules,
                )
                if created:
                    state["created"].append(version)
            self.timings["stage"] = round(time.perf_counter() - started, 3)

        def unstage() -> None:
            for version in state["created"]:
                shutil.rmtree(self.model_dir / version, ignore_errors=True)

        def go_live() -> None:
            state["config"] = read_config(self.model_dir)
            write_config(self.model_dir, config_for(self.model_dir, keep[0]))
            try:
                started = time.perf_counter()
                self.control.load(self.name)
                self.timings["load"] = round(time.perf_counter() - started, 3)
                if not self.control.version_ready(self.name, keep[0]):
                    raise ServerRefusedError(
                        f"Triton at {self.control.url} loaded {self.name} but version {keep[0]} is not ready"
                    )
            except BaseException as exc:
                # The server kept what it had; so does the repository. A folder the server refused goes
                # too (unless it is what is being served), so a later release downloads and verifies it
                # afresh; a server that did not answer refused nothing, and the folder (previous's, kept
                # for a rollback) stays.
                write_config(self.model_dir, state["config"])
                if isinstance(exc, ServerRefusedError) and keep[0] != served_version(state["config"]):
                    shutil.rmtree(self.model_dir / keep[0], ignore_errors=True)
                raise

        def back() -> None:
            write_config(self.model_dir, state["config"])
            self.control.load(self.name)

        before: list[Step] = [
            (f"stage {self.registered} version(s) {', '.join(keep)} in {self.model_dir}", stage, unstage),
            (f"Triton at {self.control.url} serves {self.name} version {keep[0]}", go_live, back),
        ]
        after: list[Step] = [
            (
                f"remove versions other than {', '.join(keep)} from {self.model_dir}",
                lambda: prune(self.model_dir, keep),
                lambda: None,
            ),
        ]
        return before, after

    def to_dict(self) -> dict[str, str]:
        return {"url": self.control.url, "repository": str(self.repository), "model": self.name}


def triton_release(live: dict[str, Any] | None) -> TritonRelease | None:
    """A :class:`TritonRelease` from its arguments as plain data (what crosses a Prefect task), or None."""
    return TritonRelease(**live) if live else None
