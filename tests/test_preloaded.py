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


def test_a_prefect_preloaded_server_forks_what_reads_the_same_to_prefect_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """``kiln zoo`` and ``kiln compile`` fork from a server that imported Prefect (preloaded.FLOW), whose
    settings are read at import: a command whose environment differs only where Prefect does not read is
    forked from the same server; one with another PREFECT_ value, or a folder with a settings file of
    Prefect's, gets a server that read what a new interpreter would (or none)."""
    log = tmp_path / "preload.log"
    monkeypatch.setenv("KILN_TEST_PRELOAD_LOG", str(log))
    code = (
        "import os, prefect.settings as p; s = p.get_current_settings(); "
        "print(s.api.url, s.client.max_retries, os.environ['KILN_TEST_MARK'])"
    )
    base = {k: v for k, v in os.environ.items() if k != "PREFECT_CLIENT_MAX_RETRIES"}
    base["PREFECT_API_URL"] = "http://127.0.0.1:1/api"

    def run(folder: str, **env: str) -> tuple[list[str], int]:
        (tmp_path / folder).mkdir(exist_ok=True)
        done = preloaded.run(
            [sys.executable, "-c", code],
            env={**base, **env},
            cwd=tmp_path / folder,
            capture_output=True,
            text=True,
            timeout=300,
            preload=preloaded.FLOW,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.cpu_seconds is not None  # forked
        lines = log.read_text().splitlines()
        return done.stdout.split(), sum("server prefect" in line for line in lines)

    first, servers = run("a", KILN_TEST_MARK="a")
    assert first == ["http://127.0.0.1:1/api", "5", "a"]  # Prefect's default
    # another folder, another variable Prefect never reads: the same server
    assert run("b", KILN_TEST_MARK="b") == (["http://127.0.0.1:1/api", "5", "b"], servers)
    # another API URL: a server of its own, which read it
    moved, more = run("b", KILN_TEST_MARK="c", PREFECT_API_URL="http://127.0.0.1:2/api")
    assert moved == ["http://127.0.0.1:2/api", "5", "c"] and more == servers + 1
    # the same environment in a folder whose prefect.toml sets what the environment leaves to it
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "prefect.toml").write_text("[client]\nmax_retries = 7\n")
    configured, last = run("d", KILN_TEST_MARK="d", PREFECT_API_URL="http://127.0.0.1:2/api")
    assert configured == ["http://127.0.0.1:2/api", "7", "d"] and last == more + 1
