"""What the engine-cache tests share: a fresh Python process of this checkout with its address space
bounded, for the tests that hand a hostile cache to a reader (a runaway read then fails in the child
instead of taking the machine), run as ``python ARGS`` from the repository root."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BoundedPython = Callable[..., subprocess.CompletedProcess]


@pytest.fixture
def bounded_python() -> BoundedPython:
    """``run(args, *, limit_bytes=1 GiB, timeout=30)``: ``python ARGS`` with ``RLIMIT_AS`` at
    ``limit_bytes``; the result's ``out`` is stdout and stderr together (the console writes to stderr)."""

    def run(
        args: list[str], *, limit_bytes: int = 1 << 30, timeout: float = 30
    ) -> subprocess.CompletedProcess:
        def limited() -> None:  # in the child, before Python starts
            resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))

        done = subprocess.run(
            [sys.executable, *args],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
            capture_output=True,
            text=True,
            timeout=timeout,
            preexec_fn=limited,
        )
        done.out = done.stdout + done.stderr
        return done

    return run
