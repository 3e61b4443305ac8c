"""The suite's fork server (tests/fixtures/preloaded.py) gives a forked command what a new interpreter
with the command's environment would see, where the preload read that environment too."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.fixtures import preloaded


def test_a_forked_command_finds_its_own_temporary_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """The preload asked tempfile for the temporary folder while importing (a library does), and tempfile
    keeps the answer: a command with another TMPDIR (tests/test_user_path.py gives its processes their
    own, to see what torch leaves there) is still forked, and finds its own folder."""
    log = tmp_path / "preload.log"
    monkeypatch.setenv("KILN_TEST_PRELOAD_LOG", str(log))
    folder = tmp_path / "tmp"
    folder.mkdir()
    code = "import os, tempfile; print(tempfile.gettempdir(), os.environ['TMPDIR'], tempfile.mkdtemp())"
    done = preloaded.run(
        [sys.executable, "-c", code],
        env={**os.environ, "TMPDIR": str(folder)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    found, given, made = done.stdout.split()
    assert found == given == str(folder) and Path(made).parent == folder, done.stdout
    assert any(" forked " in line for line in log.read_text().splitlines()), log.read_text()
