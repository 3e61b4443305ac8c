"""The engine cache as an attacker who can rewrite its entries and records (and recompute the hashes)
would leave it: maintenance and reads touch only the cache's own files (issue #31, item 3).

- N14: a record naming ``sha256: ../../victim`` on a ``file://`` store, or a ``blobs`` folder that is
  a link out of the store, never makes ``kiln cache gc`` / ``verify --evict`` delete outside the store;
- N15: a ``<key>.bin`` that is a link to ``/dev/zero`` or a FIFO is refused with the reason by
  ``kiln cache verify`` and ``EngineCache.get`` (then rebuilt), without reading it or blocking. These run
  in a child process under a memory limit and a timeout: without the check one eats memory until
  MemoryError, the other never returns;
- N16: a small compressed entry is never inflated past the size its record declares, and a declared
  size beyond what the entry can expand to is refused before anything is inflated;
- a cache directory that others can write (or that another user owns) is refused, naming the fix.
"""

from __future__ import annotations

import json
import os
import stat
import textwrap
import tracemalloc
import warnings
import zlib
from pathlib import Path

import pytest
from typer.testing import CliRunner

from compiler.cache.entry import CacheWarning
from compiler.cache.local import EngineCache
from compiler.errors import CacheError
from flows.cli import app

ROOT = Path(__file__).resolve().parents[3]
FIELDS = {
    "fingerprint": "fp-attack",
    "backend": "onnxruntime",
    "library_version": "1.20.0",
    "engine_target": "cpu",
    "settings": {},
}
ENGINE = b"engine bytes " * 100


def key(tag: str = "a"):
    return EngineCache.key(**{**FIELDS, "fingerprint": f"fp-{tag}"})


# ---- N14: deletion outside the cache ------------------------------------------------------------------
def _store_with_entry(tmp_path: Path) -> tuple[str, Path, EngineCache]:
    store = tmp_path / "store"
    url = store.as_uri()
    cache = EngineCache(url, local_dir=tmp_path / "local")
    cache.put(key(), ENGINE)
    return url, store, cache


def _record_naming_a_victim(tmp_path: Path) -> tuple[str, Path, Path]:
    url, store, _ = _store_with_entry(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("not the cache's")
    record_path = store / "entries" / f"{key()}.json"
    record = json.loads(record_path.read_text())
    record["sha256"] = "../../victim"  # store/blobs/../../victim is tmp_path/victim
    record_path.write_text(json.dumps(record))
    return url, record_path, victim


def test_gc_never_deletes_a_file_a_record_names_outside_the_store(tmp_path: Path) -> None:
    url, record_path, victim = _record_naming_a_victim(tmp_path)
    gc = CliRunner().invoke(
        app, ["cache", "gc", url, "--older-than", "0s"], env={"KILN_CACHE_LOCAL_DIR": str(tmp_path / "local")}
    )
    assert gc.exit_code == 0, gc.output
    assert victim.read_text() == "not the cache's"
    assert not record_path.exists()  # the entry itself, the store's own file, is gone


def test_verify_names_the_bad_blob_name_and_evicts_only_the_entry(tmp_path: Path) -> None:
    url, record_path, victim = _record_naming_a_victim(tmp_path)
    verified = CliRunner().invoke(
        app, ["cache", "verify", url, "--evict"], env={"KILN_CACHE_LOCAL_DIR": str(tmp_path / "local")}
    )
    said = " ".join(verified.output.split())  # rich wraps the summary at the terminal's width
    assert verified.exit_code == 1 and "1 bad" in said, verified.output
    assert "'../../victim'" in verified.output  # the reason names what the record said
    assert victim.read_text() == "not the cache's" and not record_path.exists()


def test_gc_never_follows_a_blobs_folder_that_links_out_of_the_store(tmp_path: Path) -> None:
    url, store, _ = _store_with_entry(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    named_like_a_blob = elsewhere / ("b" * 64)
    named_like_a_blob.write_text("someone else's")
    for blob in (store / "blobs").iterdir():
        blob.unlink()
    (store / "blobs").rmdir()
    (store / "blobs").symlink_to(elsewhere)
    result = CliRunner().invoke(
        app, ["cache", "gc", url, "--older-than", "0s"], env={"KILN_CACHE_LOCAL_DIR": str(tmp_path / "local")}
    )
    assert named_like_a_blob.read_text() == "someone else's", result.output


# ---- N15: special files instead of entries ------------------------------------------------------------
def _replace_payload(directory: Path, make) -> str:
    k = key()
    EngineCache(directory).put(k, ENGINE)
    (directory / f"{k}.bin").unlink()
    make(directory / f"{k}.bin")
    return str(k)


GET_CHILD = """
    import sys, warnings
    from compiler.cache.local import EngineCache
    directory, key = sys.argv[1:3]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert EngineCache(directory).get(key) is None
    print(" | ".join(str(w.message) for w in caught))
    data, hit = EngineCache(directory).get_or_build(key, lambda: b"rebuilt")
    assert (data, hit) == (b"rebuilt", False)
    assert EngineCache(directory).get(key) == b"rebuilt"
"""


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda p: p.symlink_to("/dev/zero"), "symbolic link"),
        (lambda p: os.mkfifo(p), "FIFO"),
    ],
    ids=["dev-zero-link", "fifo"],
)
def test_special_payload_is_refused_with_the_reason_never_read(
    tmp_path: Path, make, kind: str, bounded_python
) -> None:
    directory = tmp_path / "cache"
    k = _replace_payload(directory, make)
    verify = bounded_python(["-m", "flows.cli", "cache", "verify", str(directory)])
    assert verify.returncode == 1 and "1 bad" in verify.out and kind in verify.out, verify.out[-3000:]
    listed = bounded_python(["-m", "flows.cli", "cache", "ls", str(directory), "--json"])
    assert listed.returncode == 0, listed.stderr[-2000:]
    got = bounded_python(["-c", textwrap.dedent(GET_CHILD), str(directory), k])
    assert got.returncode == 0, got.stderr[-2000:]
    assert "corrupt" in got.stdout and kind in got.stdout, got.stdout
    assert Path("/dev/zero").exists()  # the link went, not what it named


def test_special_record_file_is_refused_without_blocking(tmp_path: Path, bounded_python) -> None:
    directory = tmp_path / "cache"
    k = key()
    EngineCache(directory).put(k, ENGINE)
    (directory / f"{k}.json").unlink()
    os.mkfifo(directory / f"{k}.json")
    listed = bounded_python(["-m", "flows.cli", "cache", "ls", str(directory)])
    assert listed.returncode == 0, listed.stderr[-2000:]
    verify = bounded_python(["-m", "flows.cli", "cache", "verify", str(directory)])
    assert verify.returncode == 1 and "FIFO" in verify.out, verify.out[-3000:]


# ---- N16: decompression bounded by the record -----------------------------------------------------------
@pytest.fixture(scope="module")
def bomb() -> bytes:
    """64 MiB of zeros, deflated to about 64 KiB."""
    packer = zlib.compressobj(9)
    block = bytes(1 << 20)
    return b"".join(packer.compress(block) for _ in range(64)) + packer.flush()


def _plant(directory: Path, stored: bytes, raw_bytes: int) -> str:
    import hashlib

    k = key("bomb")
    EngineCache(directory).put(k, ENGINE)
    (directory / f"{k}.bin").write_bytes(stored)
    record_path = directory / f"{k}.json"
    record = json.loads(record_path.read_text())
    record.update(
        compression="zlib", bytes=len(stored), sha256=hashlib.sha256(stored).hexdigest(), raw_bytes=raw_bytes
    )
    record_path.write_text(json.dumps(record))
    return str(k)


@pytest.mark.parametrize(
    ("raw_bytes", "reason"), [(1000, "past"), (4_200_000_000, "expand")], ids=["small-record", "huge-record"]
)
def test_compressed_entry_is_never_inflated_past_its_bound(
    tmp_path: Path, bomb: bytes, raw_bytes: int, reason: str
) -> None:
    k = _plant(tmp_path, bomb, raw_bytes)
    cache = EngineCache(tmp_path)
    tracemalloc.start()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert cache.get(k) is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"reading a {len(bomb)}-byte entry allocated {peak / 2**20:.0f} MiB"
    problems = [str(w.message) for w in caught if issubclass(w.category, CacheWarning)]
    assert len(problems) == 1 and "corrupt" in problems[0] and reason in problems[0], problems
    assert not (tmp_path / f"{k}.bin").exists()  # evicted: rebuilt when next needed


def test_an_entry_compressing_past_the_bound_is_stored_as_is_so_reads_take_it_back(tmp_path: Path) -> None:
    data = bytes(65 << 20)  # zlib: about 1000 to 1, past the 256x (and 64 MiB) a read inflates
    EngineCache(tmp_path, compression="zlib").put(key("zeros"), data)
    assert EngineCache(tmp_path).describe(key("zeros"))["compression"] is None
    assert EngineCache(tmp_path).get(key("zeros")) == data


# ---- a directory others can write ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o1777], ids=["world", "group", "sticky-world"])
def test_directory_others_can_write_is_refused_with_the_fix(tmp_path: Path, mode: int) -> None:
    directory = tmp_path / "shared"
    EngineCache(directory).put(key(), ENGINE)
    directory.chmod(mode)
    with pytest.raises(CacheError, match=r"writable by others.*chmod go-w"):
        EngineCache(directory)
    listed = CliRunner().invoke(app, ["cache", "ls", str(directory)])
    assert listed.exit_code == 2 and "writable by others" in listed.output
    assert (directory / f"{key()}.bin").exists()  # refused: nothing read, nothing deleted
    directory.chmod(0o700)
    assert EngineCache(directory).get(key()) == ENGINE


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_directory_another_user_owns_is_refused(tmp_path: Path) -> None:
    directory = tmp_path / "theirs"
    directory.mkdir(mode=0o700)
    os.chown(directory, 65534, 65534)
    with pytest.raises(CacheError, match="owned by uid 65534"):
        EngineCache(directory)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700


def test_the_local_layer_of_an_object_store_cache_is_checked_too(tmp_path: Path) -> None:
    local = tmp_path / "local"
    local.mkdir()
    local.chmod(0o777)
    with pytest.raises(CacheError, match="writable by others"):
        EngineCache((tmp_path / "store").as_uri(), local_dir=local)


@pytest.mark.parametrize("folder", ["locks", "native-builds", "timing"])
def test_a_folder_in_the_cache_others_can_write_is_refused_with_the_fix(tmp_path: Path, folder: str) -> None:
    """The folders kiln keeps in a cache (locks, native-build jobs, TensorRT's timing cache) were used
    as found, whatever their mode: one others can write is refused as the directory itself is."""
    directory = tmp_path / "cache"
    EngineCache(directory).put(key(), ENGINE)
    (directory / folder).mkdir(exist_ok=True)
    (directory / folder).chmod(0o777)
    with pytest.raises(CacheError, match=rf"\({folder}\) .* is writable by others.*chmod go-w"):
        EngineCache(directory)
    listed = CliRunner().invoke(app, ["cache", "ls", str(directory)])
    assert listed.exit_code == 2 and "writable by others" in listed.output
    (directory / folder).chmod(0o700)
    assert EngineCache(directory).get(key()) == ENGINE


def test_a_workspace_others_can_write_is_refused_before_any_model(tmp_path: Path) -> None:
    from zoo.errors import ZooConfigError
    from zoo.preflight import check_workspace

    check_workspace(tmp_path / "made")  # made here: private, fine
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    with pytest.raises(ZooConfigError, match=r"settings.workspace .* writable by others.*chmod go-w"):
        check_workspace(shared)


# ---- what a cache holds reaches the terminal as text, never as terminal control ------------------------
def test_cache_ls_shows_the_native_build_log_with_control_characters_escaped(
    tmp_path: Path, bounded_python
) -> None:
    """native-builds.log is written by the cache's users: clear screen, window title, a link and a fake
    line in it are shown as escapes (``\\x1b``), never sent to the terminal as they are."""
    directory = tmp_path / "cache"
    EngineCache(directory).put(key(), ENGINE)
    hostile = {
        "key": "a" * 64,
        "state": "built\x1b[2J\x1b[H",
        "time": 1.0,
        "reason": "\x1b]0;owned\x07\x1b]8;;https://evil.example/\x07click\x1b]8;;\x07",
        "why": "ok\r\nkiln: all entries verified \u202eexe.txt",
    }
    (directory / "native-builds.log").write_text(json.dumps(hostile) + "\n")
    listed = bounded_python(["-m", "flows.cli", "cache", "ls", str(directory)])
    assert listed.returncode == 0, listed.out[-2000:]
    assert not any(c in listed.out for c in "\x1b\x07\r\u202e"), repr(listed.out[-2000:])
    assert "built\\x1b[2J\\x1b[H" in listed.out and "\\u202e" in listed.out  # shown, as escapes
    assert not any(line.lstrip().startswith("kiln: all entries") for line in listed.out.splitlines())
