"""What the package tests share: a signing key pair or two, and what an attacker with write access to a
package (and no signing key) can do to it: copy it and make its checksums and content hash agree again
after an edit. The probes beside these tests (untrusted_probe.py, fuzz_probe.py) run in fresh processes
without pytest and keep their own resealing, which takes any mutated data."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from compiler.package.digest import content_hash
from compiler.package.manifest import MANIFEST_FILE, FileRecord
from tests.fixtures.signing_keys import ec_key_pair


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Two EC key pairs: ``release`` (what the pipeline signs with) and ``other`` (anyone else's)."""
    root = tmp_path_factory.mktemp("keys")
    return {"release": ec_key_pair(root, "release"), "other": ec_key_pair(root, "other")}


def _copy_package(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst))


def _reseal(
    path: Path, edit: Callable[[dict], Any] | None = None, **files: tuple[int, str]
) -> dict[str, Any]:
    """Edit the manifest (``edit``), then make every listed file's checksum (``files``: rel -> (bytes,
    sha256) to claim instead of the file's own) and the content hash agree again. Returns the manifest
    data written."""
    data = json.loads((path / MANIFEST_FILE).read_text())
    if edit is not None:
        edit(data)
    for rel, record in data["files"].items():
        file = path / rel
        if rel in files:  # the claim is of the file's sha256 and size: its chunk digests stay as they were
            size, sha = files[rel]
            record.update(sha256=sha, bytes=size)
        elif file.is_file() and not file.is_symlink():  # its digests, chunks' included, as a save writes them
            record.clear()
            record.update(FileRecord.of(file.read_bytes()).to_json())
    data["content_hash"] = content_hash(data)
    (path / MANIFEST_FILE).write_text(json.dumps(data))
    return data


@pytest.fixture(scope="session")
def copy_package() -> Callable[[Path, Path], Path]:
    """``copy_package(src, dst)``: a copy of the package at ``src`` (to tamper with) at ``dst``."""
    return _copy_package


@pytest.fixture(scope="session")
def reseal() -> Callable[..., dict[str, Any]]:
    """``reseal(path, edit=None, **files)``: see :func:`_reseal`."""
    return _reseal
