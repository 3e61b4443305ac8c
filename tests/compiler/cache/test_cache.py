"""The engine cache on real files, with real second processes for the locking and the unwritable-disk cases.

What each group proves:
- keys: stable across runs (golden digest), canonical (settings order is irrelevant), sensitive to each field,
  and explainable (`diff_keys` names the field that differs);
- integrity: a truncated, tampered or half-written entry is never returned, it is deleted and counted;
- bound: least-recently-used entries go first, the entry just written never does;
- concurrency: two processes (and two threads) asking for one key build it once and share the bytes;
  a lock left by a killed process does not block;
- degradation: on a read-only filesystem (EROFS, real read-only bind mount) and a full one (ENOSPC, real
  64 KiB tmpfs) the compile still gets correct bytes, with a warning and `write_errors` counted. Those two
  run in a private mount namespace (`unshare -m`), because root ignores chmod; they skip where that is
  not permitted.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path

import platformdirs
import pytest

from compiler.cache.entry import CacheKey, CacheWarning
from compiler.cache.local import EngineCache, resolve_cache
from compiler.cache.paths import choose
from compiler.errors import CacheError

REPO = Path(__file__).resolve().parents[3]
FIELDS = {
    "fingerprint": "fp-abc",
    "backend": "onnxruntime",
    "library_version": "1.20.0",
    "engine_target": "cpu",
    "settings": {"precision": "fp32", "strip_weights": False, "opt_level": 3},
}


def make_key(**changes: object) -> CacheKey:
    return EngineCache.key(**{**FIELDS, **changes})


def child_script(code: str) -> str:
    """Source for a fresh Python process that imports kiln from this checkout."""
    return f"import sys, json, os, time, warnings\nsys.path.insert(0, {str(REPO)!r})\n" + textwrap.dedent(
        code
    )


# ---- keys -------------------------------------------------------------------------------------------------
def test_key_is_stable_canonical_and_keeps_its_fields() -> None:
    key = make_key()
    reordered = EngineCache.key(
        settings={"opt_level": 3, "strip_weights": False, "precision": "fp32"},
        engine_target="cpu",
        library_version="1.20.0",
        backend="onnxruntime",
        fingerprint="fp-abc",
    )
    assert key == reordered
    # Golden: the key format is part of the on-disk contract; a change here invalidates every user's cache.
    canonical = (
        '{"backend":"onnxruntime","fingerprint":"fp-abc","library_version":"1.20.0",'
        '"settings":{"opt_level":3,"precision":"fp32","strip_weights":false},"target_device":"cpu"}'
    )
    assert key == hashlib.sha256(canonical.encode()).hexdigest()
    assert key.fields == json.loads(canonical)
    assert pickle.loads(pickle.dumps(key)).fields == key.fields  # survives the trip to a worker process
    assert EngineCache.key(**{**FIELDS, "settings": {"shape": (1, 2)}}) == EngineCache.key(
        **{**FIELDS, "settings": {"shape": [1, 2]}}
    )


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"fingerprint": "fp-other"}, "fingerprint"),
        ({"backend": "tensorrt"}, "backend"),
        ({"library_version": "1.21.0"}, "library_version"),
        ({"engine_target": "sm_90"}, "target_device"),  # hashed under its first name
        ({"settings": {**FIELDS["settings"], "precision": "fp16"}}, "settings.precision"),
        ({"settings": {**FIELDS["settings"], "workspace": 1}}, "settings.workspace"),
    ],
)
def test_key_changes_with_every_field_and_diff_names_it(tmp_path: Path, change: dict, field: str) -> None:
    base, other = make_key(), make_key(**change)
    assert base != other
    cache = EngineCache(tmp_path)
    assert list(cache.diff_keys(base, other)) == [field]
    # Also from the stored metadata alone, as a user would inspect two plain hex keys from a report.
    cache.put(base, b"a")
    cache.put(other, b"b")
    assert list(cache.diff_keys(str(base), str(other))) == [field]
    assert cache.describe(str(other))["fields"] == other.fields


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"fingerprint": ""}, "fingerprint"),
        ({"backend": None}, "backend"),
        ({"settings": {"x": object()}}, "settings"),
        ({"settings": {"x": float("nan")}}, "settings"),
        ({"settings": ["not", "a", "mapping"]}, "settings"),
    ],
)
def test_key_rejects_bad_fields(change: dict, named: str) -> None:
    with pytest.raises(CacheError, match=named):
        make_key(**change)


def test_bad_keys_data_and_meta_are_typed_errors(tmp_path: Path) -> None:
    cache = EngineCache(tmp_path)
    for bad in ("../../etc/passwd", "ABC", "a" * 63, 7):
        with pytest.raises(CacheError, match="64 lowercase hex"):
            cache.get(bad)  # also keeps keys from naming files outside the cache
    with pytest.raises(CacheError, match="must be bytes"):
        cache.put(make_key(), "text")
    with pytest.raises(CacheError, match="must be bytes"):
        cache.get_or_build(make_key(), lambda: 42)
    with pytest.raises(CacheError, match="meta"):
        cache.put(make_key(), b"x", meta={"f": object()})
    assert cache.get(make_key()) is None  # nothing half-stored by the failed calls


# ---- round trip, metadata, memory layer -------------------------------------------------------------------
def test_put_get_round_trip_with_inspectable_metadata(tmp_path: Path) -> None:
    key, payload = make_key(), os.urandom(5000)
    writer = EngineCache(tmp_path)
    assert writer.get(key) is None
    writer.put(key, payload, meta={"partition": "p0"})
    reader = EngineCache(tmp_path)  # a fresh instance: nothing in memory, must come from disk
    assert reader.get(key) == payload
    assert reader.stats.to_dict() == {
        "hits": 1, "misses": 0, "builds": 0, "corrupt": 0, "evictions": 0, "write_errors": 0,
        "remote_hits": 0, "remote_publishes": 0, "remote_errors": 0,
    }  # fmt: skip
    record = json.loads((tmp_path / f"{key}.json").read_text())
    assert record["fields"] == key.fields
    assert record["sha256"] == hashlib.sha256((tmp_path / f"{key}.bin").read_bytes()).hexdigest()
    assert record["bytes"] == record["raw_bytes"] == 5000
    assert record["format_version"] == 1 and record["created"] and record["meta"] == {"partition": "p0"}
    [entry] = reader.entries()
    assert (entry.key, entry.bytes, entry.meta, entry.fields) == (key, 5000, {"partition": "p0"}, key.fields)
    assert reader.total_bytes() == 5000
    assert not list(tmp_path.glob(".*.tmp"))  # no temp files left behind
    assert reader.clear() == 1
    assert reader.get(key) is None and reader.entries() == [] and reader.total_bytes() == 0


def test_get_or_build_builds_once_then_hits(tmp_path: Path) -> None:
    calls = []
    cache = EngineCache(tmp_path)

    def build() -> bytes:
        calls.append(1)
        return b"engine"

    assert cache.get_or_build(make_key(), build) == (b"engine", False)
    assert cache.get_or_build(make_key(), build) == (b"engine", True)
    assert EngineCache(tmp_path).get_or_build(make_key(), build) == (b"engine", True)  # next "compile"
    assert len(calls) == 1
    assert cache.stats.to_dict() == {
        "hits": 1, "misses": 1, "builds": 1, "corrupt": 0, "evictions": 0, "write_errors": 0,
        "remote_hits": 0, "remote_publishes": 0, "remote_errors": 0,
    }  # fmt: skip


def test_memory_layer_never_reads_an_entry_from_disk_twice(tmp_path: Path) -> None:
    key = make_key()
    EngineCache(tmp_path).put(key, b"good engine")
    cache = EngineCache(tmp_path)
    assert cache.get(key) == b"good engine"  # first read: disk, verified
    (tmp_path / f"{key}.bin").write_bytes(b"evil engine")  # changed behind the cache's back
    assert cache.get(key) == b"good engine"  # served from memory: the disk was not read again
    assert cache.stats.corrupt == 0
    with pytest.warns(CacheWarning, match="corrupt"):
        assert EngineCache(tmp_path).get(key) is None  # a new process does read the disk, and refuses it


# ---- integrity --------------------------------------------------------------------------------------------
def _truncate(d: Path, key: str) -> None:
    p = d / f"{key}.bin"
    p.write_bytes(p.read_bytes()[:-10])


def _flip(d: Path, key: str) -> None:
    p = d / f"{key}.bin"
    raw = bytearray(p.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    p.write_bytes(bytes(raw))


def _drop_meta(d: Path, key: str) -> None:  # what a crash between payload and metadata leaves
    (d / f"{key}.json").unlink()


def _drop_payload(d: Path, key: str) -> None:
    (d / f"{key}.bin").unlink()


def _garble_meta(d: Path, key: str) -> None:
    (d / f"{key}.json").write_text("{not json")


def _lie_about_checksum(d: Path, key: str) -> None:
    p = d / f"{key}.json"
    record = json.loads(p.read_text())
    record["sha256"] = "0" * 64
    p.write_text(json.dumps(record))


@pytest.mark.parametrize(
    "damage", [_truncate, _flip, _drop_meta, _drop_payload, _garble_meta, _lie_about_checksum]
)
@pytest.mark.parametrize("compression", [None, "zlib"])
def test_damaged_entry_is_a_miss_evicted_and_counted(tmp_path: Path, damage, compression) -> None:
    key, payload = make_key(), os.urandom(2000) + bytes(2000)
    EngineCache(tmp_path, compression=compression).put(key, payload)
    damage(tmp_path, key)
    cache = EngineCache(tmp_path)
    with pytest.warns(CacheWarning, match=f"{key}.*corrupt"):
        assert cache.get(key) is None
    assert not (tmp_path / f"{key}.bin").exists() and not (tmp_path / f"{key}.json").exists()
    assert (cache.stats.corrupt, cache.stats.misses, cache.stats.hits) == (1, 1, 0)
    assert cache.get_or_build(key, lambda: payload) == (payload, False)  # rebuilt, and good again
    assert EngineCache(tmp_path).get(key) == payload


def test_compressed_entries_are_smaller_and_readable_by_any_instance(tmp_path: Path) -> None:
    key, payload = make_key(), bytes(100_000)
    EngineCache(tmp_path, compression="lzma").put(key, payload)
    assert (tmp_path / f"{key}.bin").stat().st_size < 1000
    assert EngineCache(tmp_path).describe(key)["compression"] == "lzma"
    assert EngineCache(tmp_path).get(key) == payload  # the metadata, not the reader's setting, decides
    with pytest.raises(CacheError, match="compression"):
        EngineCache(tmp_path, compression="zstd-9000")


# ---- LRU bound --------------------------------------------------------------------------------------------
def test_lru_eviction_keeps_the_most_recently_used(tmp_path: Path) -> None:
    a, b, c, d = (make_key(fingerprint=f"fp-{n}") for n in "abcd")
    cache = EngineCache(tmp_path, max_bytes=3500)
    for key in (a, b, c):
        cache.put(key, os.urandom(1000))
        time.sleep(0.02)  # distinct last-used times even on coarse-mtime filesystems
    assert EngineCache(tmp_path).get(a) is not None  # a is now the most recently used; b is the oldest
    time.sleep(0.02)
    cache.put(d, os.urandom(1000))
    on_disk = {e.key for e in cache.entries()}
    assert on_disk == {a, c, d}
    assert cache.stats.evictions == 1
    assert cache.total_bytes() == 3000 <= cache.max_bytes


def test_entry_larger_than_the_bound_is_still_returned_and_kept(tmp_path: Path) -> None:
    small, big = make_key(fingerprint="small"), make_key(fingerprint="big")
    cache = EngineCache(tmp_path, max_bytes=100)
    cache.put(small, b"x" * 50)
    payload = os.urandom(1000)
    assert cache.get_or_build(big, lambda: payload) == (payload, False)  # the compile gets its engine
    assert [e.key for e in cache.entries()] == [big]  # never evicts the one just written; evicts the rest
    assert EngineCache(tmp_path, max_bytes=100).get(big) == payload


# ---- configuration ----------------------------------------------------------------------------------------
def test_directory_that_is_a_file_or_under_a_file_is_an_error(tmp_path: Path) -> None:
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(CacheError, match=str(afile)):
        EngineCache(afile)
    with pytest.raises(CacheError, match=f"under {afile}"):
        EngineCache(afile / "engines")


@pytest.mark.parametrize("bad", [0, -5, 1.5, "10G", True])
def test_bad_max_bytes_is_an_error(tmp_path: Path, bad: object) -> None:
    with pytest.raises(CacheError, match="max_bytes"):
        EngineCache(tmp_path, max_bytes=bad)


def test_env_vars_choose_directory_and_bound(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "from-env"))
    monkeypatch.setenv("KILN_CACHE_MAX_BYTES", "2M")
    cache = EngineCache()
    assert cache.directory == tmp_path / "from-env" and cache.max_bytes == 2 * 1024**2
    cache.put(make_key(), b"e")
    assert (tmp_path / "from-env" / f"{make_key()}.bin").exists()
    assert EngineCache(tmp_path / "arg").directory == tmp_path / "arg"  # the argument wins over the env
    monkeypatch.setenv("KILN_CACHE_MAX_BYTES", "lots")
    with pytest.raises(CacheError, match="KILN_CACHE_MAX_BYTES='lots'"):
        EngineCache()


def test_default_directory_is_the_platform_user_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KILN_CACHE_DIR", raising=False)
    monkeypatch.delenv("KILN_CACHE_MAX_BYTES", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # keep the test out of the real ~/.cache
    cache = EngineCache()
    assert cache.directory == Path(platformdirs.user_cache_dir("kiln")) / "engines"
    assert cache.directory.is_relative_to(tmp_path) and cache.directory.is_dir()
    assert cache.max_bytes == 10 * 1024**3


def test_one_decision_reads_every_cache_setting_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """compiler.cache.paths.choose decides for every entry point: None (or True) is the default cache,
    False none, a directory or URL that cache; a zoo run's default is its project's folder."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "env"))
    assert choose(None) == choose(True) == (str(tmp_path / "env"), "$KILN_CACHE_DIR")
    assert choose(False, named="settings.engine_cache") == (None, "disabled by settings.engine_cache: false")
    assert choose("s3://bucket/prefix") == ("s3://bucket/prefix", "cache")
    assert choose(tmp_path / "mine") == (str(tmp_path / "mine"), "cache")
    assert resolve_cache(None).directory == tmp_path / "env" and resolve_cache(False) is None
    given = EngineCache(tmp_path / "given")
    assert resolve_cache(given) is given
    monkeypatch.delenv("KILN_CACHE_DIR")
    monkeypatch.chdir(tmp_path)
    assert choose(None, project=True) == (str(tmp_path / ".kiln" / "engine-cache"), "default")


def test_build_engine_reads_cache_none_as_the_default_like_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch

    import compiler

    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "default"))
    program = compiler.export(torch.nn.Linear(4, 2).eval(), (torch.randn(2, 4),))
    plan = compiler.partition(program)
    unique = compiler.dedup(plan)
    (fingerprint,) = unique.fingerprints
    assert not compiler.build_engine(plan, unique, fingerprint, cache=False).cache_hit
    assert not (tmp_path / "default").exists()  # False: no cache at all
    compiler.build_engine(plan, unique, fingerprint)  # None: the default cache, as compile() reads it
    assert len(EngineCache().entries()) == 1
    assert compiler.compile(program, cache=None).report.cache_hits == 1
    # cache=False is no cache all the way down: compile hands build_engine False, not the None its own
    # resolution gives (which build_engine reads as the default cache, holding this very engine).
    assert compiler.compile(program, cache=False).report.cache_hits == 0


# ---- concurrency ------------------------------------------------------------------------------------------
RACE_CHILD = """
    import hashlib
    from compiler.cache.local import EngineCache
    cache_dir, key, marker, ready, go = sys.argv[1:6]
    cache = EngineCache(cache_dir)
    open(ready, "w").close()
    while not os.path.exists(go):
        time.sleep(0.005)
    def build():
        with open(marker, "a") as f:
            f.write(f"{os.getpid()}\\n")
        time.sleep(1.0)  # a slow build: the other process arrives while it runs
        return b"engine-" + os.urandom(32)  # unique per build: equal bytes prove one build was shared
    start = time.time()
    data, hit = cache.get_or_build(key, build)
    sha = hashlib.sha256(data).hexdigest()
    print(json.dumps({"sha": sha, "hit": hit, "start": start, "end": time.time()}))
"""


def test_two_processes_racing_on_one_key_build_it_once(tmp_path: Path) -> None:
    key, marker, go = str(make_key()), tmp_path / "builds.txt", tmp_path / "go"
    script = child_script(RACE_CHILD)
    readies = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path / "cache"), key, str(marker), str(r), str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in readies
    ]
    deadline = time.time() + 60
    while not all(r.exists() for r in readies):
        assert time.time() < deadline, "children did not start"
        time.sleep(0.01)
    go.touch()
    results = []
    for proc in procs:
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert len(marker.read_text().splitlines()) == 1  # exactly one build
    assert results[0]["sha"] == results[1]["sha"]
    assert sorted(r["hit"] for r in results) == [False, True]
    # The race really happened: both asked before the builder finished.
    assert max(r["start"] for r in results) < min(r["end"] for r in results)


def test_two_threads_racing_on_one_key_build_it_once(tmp_path: Path) -> None:
    cache, key, builds = EngineCache(tmp_path), make_key(), []

    def build() -> bytes:
        builds.append(threading.get_ident())
        time.sleep(0.3)
        return os.urandom(64)

    results: list[tuple[bytes, bool]] = []
    threads = [
        threading.Thread(target=lambda: results.append(cache.get_or_build(key, build))) for _ in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(builds) == 1
    assert results[0][0] == results[1][0] and sorted(hit for _, hit in results) == [False, True]


LOCK_HOLDER = """
    from filelock import FileLock
    lock = FileLock(sys.argv[1])
    lock.acquire()
    print("locked", flush=True)
    time.sleep(600)
"""


def test_lock_of_a_killed_process_does_not_block(tmp_path: Path) -> None:
    cache, key = EngineCache(tmp_path, lock_timeout=0.3), make_key()
    script = child_script(LOCK_HOLDER)
    holder = subprocess.Popen(
        [sys.executable, "-c", script, str(cache.lock_path(key))], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        # While a live process holds the lock, a bounded wait gives up, warns, and still builds correctly.
        with pytest.warns(CacheWarning, match="waited 0.3s"):
            assert cache.get_or_build(key, lambda: b"one") == (b"one", False)
    finally:
        holder.send_signal(signal.SIGKILL)  # a crash: no release, the lock file stays
        holder.wait(10)
    assert cache.lock_path(key).exists()
    other = make_key(fingerprint="other")
    shutil.copy(cache.lock_path(key), cache.lock_path(other))  # a leftover lock file that nobody holds
    patient = EngineCache(tmp_path)  # waits forever if it must; here it must not
    start = time.monotonic()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)
        assert patient.get_or_build(other, lambda: b"two") == (b"two", False)
        patient.put(key, b"three")
    assert time.monotonic() - start < 5
    assert EngineCache(tmp_path).get(key) == b"three"


def test_half_entry_of_a_writer_holding_the_lock_is_left_alone(tmp_path: Path) -> None:
    cache, key = EngineCache(tmp_path), make_key()
    holder = subprocess.Popen(
        [sys.executable, "-c", child_script(LOCK_HOLDER), str(cache.lock_path(key))],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        (tmp_path / f"{key}.bin").write_bytes(b"payload, metadata not written yet")  # a put in progress
        with warnings.catch_warnings():
            warnings.simplefilter("error", CacheWarning)
            assert cache.get(key) is None  # a miss, but not "corrupt": the writer may finish any moment
        assert (tmp_path / f"{key}.bin").exists() and cache.stats.corrupt == 0
    finally:
        holder.send_signal(signal.SIGKILL)  # the writer died mid-put: now it is a half entry for good
        holder.wait(10)
    with pytest.warns(CacheWarning, match="metadata missing"):
        assert cache.get(key) is None
    assert not (tmp_path / f"{key}.bin").exists() and cache.stats.corrupt == 1


# ---- unwritable disks (real ones, in a private mount namespace) --------------------------------------------
def _namespace_or_skip() -> list[str]:
    if shutil.which("unshare"):
        probe = subprocess.run(
            ["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt"],
            capture_output=True,
            check=False,
        )
        if probe.returncode == 0:
            return ["unshare", "-m"]
    pytest.skip(
        "needs `unshare -m` and mount permission (CAP_SYS_ADMIN) to build a read-only/full filesystem"
    )


UNWRITABLE_CHILD = """
    from compiler.cache.entry import CacheWarning
    from compiler.cache.local import EngineCache
    cache_dir, existing, new, built_key, size, damaged = sys.argv[1:7]
    big = int(size)
    payload = bytes(range(256)) * (big // 256)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        cache = EngineCache(cache_dir)
        got_existing = cache.get(existing)
        got_damaged = cache.get(damaged)
        cache.put(new, payload)
        after_put = cache.get(new)
        built, hit = cache.get_or_build(built_key, lambda: payload[::-1])
    print(json.dumps({
        "existing": got_existing.hex() if got_existing else None,
        "damaged_is_miss": got_damaged is None,
        "after_put_ok": after_put == payload,
        "built_ok": built == payload[::-1], "hit": hit,
        "stats": cache.stats.to_dict(),
        "warnings": [str(w.message) for w in caught if issubclass(w.category, CacheWarning)],
        "files": sorted(os.listdir(cache_dir)),
    }))
"""


def run_unwritable(setup: str, args: list[str]) -> dict:
    """UNWRITABLE_CHILD after `setup` (mount commands) in a private mount namespace, gone when it exits."""
    ns = _namespace_or_skip()
    cmd = f'{setup} && exec "$0" -c "$@"'
    proc = subprocess.run(
        [*ns, "sh", "-c", cmd, sys.executable, child_script(UNWRITABLE_CHILD), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_read_only_filesystem_degrades_to_memory(tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    existing, new, built = make_key(fingerprint="old"), make_key(fingerprint="new"), make_key(fingerprint="b")
    damaged = make_key(fingerprint="damaged")
    EngineCache(cache_dir).put(existing, b"\x01\x02")
    EngineCache(cache_dir).put(damaged, b"good")
    (cache_dir / f"{damaged}.bin").write_bytes(b"evil")
    before = sorted(os.listdir(cache_dir))
    d = shlex.quote(str(cache_dir))
    result = run_unwritable(
        f"mount --bind {d} {d} && mount -o remount,ro,bind {d}",
        [str(cache_dir), existing, new, built, "4096", damaged],
    )
    assert result["existing"] == "0102"  # reads still work on a read-only disk
    assert result["damaged_is_miss"]  # and a bad entry is still refused, though it cannot be deleted
    assert result["after_put_ok"] and result["built_ok"] and result["hit"] is False
    assert result["stats"]["write_errors"] == 2 and result["stats"]["corrupt"] == 1
    assert any(str(cache_dir) in w and "EROFS" in w for w in result["warnings"]), result["warnings"]
    assert any(damaged in w and "not deletable" in w for w in result["warnings"]), result["warnings"]
    assert result["files"] == before  # nothing was written
    assert sorted(os.listdir(cache_dir)) == before


@pytest.mark.parametrize(
    "size",
    [
        200 * 1024,  # the payload write itself runs out of space
        64 * 1024,  # the payload fits exactly, then its metadata does not: the payload must be removed
    ],
)
def test_full_disk_degrades_to_memory_and_leaves_no_half_entry(tmp_path: Path, size: int) -> None:
    cache_dir = tmp_path / "cache"
    cache_dir.mkdir()
    existing, new, built = make_key(fingerprint="old"), make_key(fingerprint="new"), make_key(fingerprint="b")
    d = shlex.quote(str(cache_dir))
    result = run_unwritable(
        f"mount -t tmpfs -o size=64k,mode=0700 tmpfs {d}",  # tmpfs is 1777 by default: refused as shared
        [str(cache_dir), existing, new, built, str(size), make_key(fingerprint="absent")],
    )
    assert result["existing"] is None
    assert result["after_put_ok"] and result["built_ok"] and result["hit"] is False
    assert result["damaged_is_miss"]
    assert result["stats"]["write_errors"] == 2 and result["stats"]["corrupt"] == 0
    assert any(str(cache_dir) in w and "ENOSPC" in w for w in result["warnings"]), result["warnings"]
    assert result["files"] == ["locks"]  # no payload without metadata, no temp file
