"""The engine cache shared through an object store: a real S3 server (moto, authenticated) on 127.0.0.1.

What each test proves:
- read-through: an entry one worker built is read by another (verified), then kept on its own disk;
- one build per key across machines: concurrent workers (separate processes, separate local caches)
  build a key once; a worker killed while it holds the build lease is taken over, nothing half-made
  is ever read;
- integrity: a truncated blob in the store is a checksum failure, evicted there, rebuilt, published;
- bad input: an unreachable endpoint or refused credentials are a CacheStoreError at check time naming
  the URL and the variables to set, and only a warning at build time; a read-only bucket is read, not
  written, and named; a scheme without its fsspec driver names the package to install;
- a zoo setting ``s3://...`` stays a URL (it once became a local folder named ``s3:``).
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

from compiler.cache.entry import CacheWarning
from compiler.cache.local import EngineCache
from compiler.cache.store import CacheStoreError
from tests.fixtures.s3_server import BUCKET, MotoServer
from tests.fixtures.server_process import free_port, scoped_environ

REPO = Path(__file__).resolve().parents[3]
FIELDS = {
    "fingerprint": "fp-fleet",
    "backend": "onnxruntime",
    "library_version": "1.20.0",
    "engine_target": "cpu",
    "settings": {"precision": "fp32"},
}


def key(tag: str):
    return EngineCache.key(**{**FIELDS, "fingerprint": f"fp-{tag}"})


def url(name: str) -> str:
    return f"s3://{BUCKET}/{name}"


def test_entry_built_by_one_worker_is_read_through_by_another(s3_server: MotoServer, tmp_path: Path) -> None:
    k = key("read-through")
    first = EngineCache(url("rt"), local_dir=tmp_path / "a")
    assert first.backend == "s3" and first.location == url("rt")
    assert first.get_or_build(k, lambda: b"engine-bytes" * 100) == (b"engine-bytes" * 100, False)
    assert first.stats.remote_publishes == 1
    second = EngineCache(url("rt"), local_dir=tmp_path / "b")
    assert second.get_or_build(k, lambda: pytest.fail("built again")) == (b"engine-bytes" * 100, True)
    assert second.stats.remote_hits == 1 and second.stats.builds == 0
    assert (tmp_path / "b" / f"{k}.bin").exists()  # now hot on the second worker's disk
    third = EngineCache(url("rt"), local_dir=tmp_path / "b")
    assert third.get(k) == b"engine-bytes" * 100 and third.stats.remote_hits == 0  # from its disk
    objects = {
        o["Key"] for o in s3_server.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="rt/")["Contents"]
    }
    assert f"rt/entries/{k}.json" in objects and not any(o.startswith("rt/leases/") for o in objects)


def test_truncated_object_is_a_checksum_failure_evicted_and_rebuilt(
    s3_server: MotoServer, tmp_path: Path
) -> None:
    k = key("truncated")
    EngineCache(url("tr"), local_dir=tmp_path / "a").put(k, b"x" * 4096)
    s3 = s3_server.client("s3")
    blob = next(o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="tr/blobs/")["Contents"])
    s3.put_object(Bucket=BUCKET, Key=blob, Body=b"x" * 100)  # what a store that lies about sizes serves
    reader = EngineCache(url("tr"), local_dir=tmp_path / "b")
    with pytest.warns(CacheWarning, match="corrupt.*sha256|corrupt.*bytes"):
        data, hit = reader.get_or_build(k, lambda: b"y" * 4096)
    assert (data, hit) == (b"y" * 4096, False) and reader.stats.corrupt == 1
    # Evicted and published again: a third worker reads the rebuilt entry, verified.
    assert EngineCache(url("tr"), local_dir=tmp_path / "c").get(k) == b"y" * 4096
    # A publisher killed between its blob and its entry leaves a blob nobody names: a plain miss.
    s3.put_object(Bucket=BUCKET, Key=f"tr/blobs/{'ab' * 32}", Body=b"half")
    assert reader.get(key("never-published")) is None and reader.stats.corrupt == 1


def test_a_lost_publish_race_leaves_other_keys_blobs_alone(s3_server: MotoServer, tmp_path: Path) -> None:
    # Blobs are named by their bytes, so two keys whose engines are equal share one. A worker that
    # loses the race for key A with those bytes must not delete the blob key B's entry names.
    EngineCache(url("race"), local_dir=tmp_path / "b").put(key("race-b"), b"same engine" * 50)
    EngineCache(url("race"), local_dir=tmp_path / "a1").put(key("race-a"), b"first build" * 50)
    loser = EngineCache(url("race"), local_dir=tmp_path / "a2")
    loser.put(key("race-a"), b"same engine" * 50)  # a nondeterministic second build of A, published late
    assert loser.stats.remote_publishes == 0
    reader = EngineCache(url("race"), local_dir=tmp_path / "reader")
    with warnings.catch_warnings():
        warnings.simplefilter("error", CacheWarning)  # a missing blob would be a corrupt entry
        assert reader.get(key("race-b")) == b"same engine" * 50
        assert reader.get(key("race-a")) == b"first build" * 50  # the winner's, everywhere
    assert reader.stats.corrupt == 0


# The child loads compiler.cache alone (not compiler/__init__, which imports torch): a second per worker.
WORKER = """
import sys, json, time, types
_wall = time.time
time.time = lambda: _wall() + {skew}  # this worker's wall clock, off by the skew from everyone's
compiler = types.ModuleType("compiler")
compiler.__path__ = [{repo!r} + "/compiler"]
sys.modules["compiler"] = compiler
from compiler.cache.local import EngineCache
cache = EngineCache({url!r}, local_dir=sys.argv[1], lease_seconds={lease})
key = EngineCache.key(**json.loads(sys.argv[2]))
def build():
    print("building", flush=True)
    time.sleep(float(sys.argv[3]))
    return b"engine:" + sys.argv[4].encode() * 1000
data, hit = cache.get_or_build(key, build)
result = {{"builds": cache.stats.builds, "data": data[:12].decode(), "bytes": len(data)}}
print(json.dumps(result), flush=True)
"""


def _worker(
    tmp: Path, name: str, cache_url: str, fields: dict, sleep: float, lease: float = 30.0, skew: float = 0.0
):
    import json

    script = WORKER.format(repo=str(REPO), url=cache_url, lease=lease, skew=skew)
    return subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(script),
            str(tmp / name),
            json.dumps(fields),
            str(sleep),
            name,
        ],
        stdout=subprocess.PIPE,
        text=True,
    )


def test_two_machines_build_a_key_once_and_a_killed_builder_is_taken_over(
    s3_server: MotoServer, tmp_path: Path
) -> None:
    import json

    fields = {**FIELDS, "fingerprint": "fp-concurrent"}
    workers = [_worker(tmp_path, name, url("cc"), fields, 1.5) for name in ("w1", "w2")]
    results = [json.loads(w.communicate(timeout=60)[0].strip().splitlines()[-1]) for w in workers]
    assert sum(r["builds"] for r in results) == 1  # separate disks, one build in the fleet
    assert results[0]["data"] == results[1]["data"] and results[0]["bytes"] == results[1]["bytes"]

    # A builder killed while it holds the lease: the next worker waits out the silent lease, then builds.
    fields = {**FIELDS, "fingerprint": "fp-killed"}
    victim = _worker(tmp_path, "victim", url("cc"), fields, 60, lease=1.0)
    assert victim.stdout.readline().strip() == "building"
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=10)
    survivor = _worker(tmp_path, "survivor", url("cc"), fields, 0.1, lease=1.0)
    out = json.loads(survivor.communicate(timeout=60)[0].strip().splitlines()[-1])
    assert out == {"builds": 1, "data": "engine:survi", "bytes": 7 + 8 * 1000}


def test_workers_with_skewed_clocks_still_build_a_key_once(s3_server: MotoServer, tmp_path: Path) -> None:
    import json

    # A lease is judged by whether its content changes on the waiter's own monotonic clock, never by
    # comparing wall times: a builder a day ahead is not "stale" to a waiter a day behind, nor the
    # reverse, though the build outlasts the lease period several times over.
    fields = {**FIELDS, "fingerprint": "fp-skew"}
    workers = [
        _worker(tmp_path, name, url("skew-lease"), fields, 6.0, lease=2.0, skew=skew)
        for name, skew in (("ahead", 86400.0), ("behind", -86400.0))
    ]
    results = [json.loads(w.communicate(timeout=60)[0].strip().splitlines()[-1]) for w in workers]
    assert sum(r["builds"] for r in results) == 1
    assert results[0]["data"] == results[1]["data"]


def _free_port_containing_403() -> int:
    """A closed port whose number contains 403 (the CI run that found it was on 40353)."""
    import socket

    for port in range(40300, 40400):
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) != 0:
                return port
    pytest.skip("no closed port in 40300..40399")


def test_unreachable_store_is_a_check_error_and_a_build_time_warning(tmp_path: Path) -> None:
    # A dead endpoint whose port holds "403" is unreachable still, not "access refused" (a 403).
    for dead in (f"http://127.0.0.1:{_free_port_containing_403()}", f"http://127.0.0.1:{free_port()}"):
        with scoped_environ(
            {"AWS_ENDPOINT_URL": dead, "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}
        ):
            with pytest.raises(
                CacheStoreError, match=r"s3://kiln/down is unreachable.*AWS_ENDPOINT_URL"
            ) as err:
                EngineCache(url("down"), local_dir=tmp_path / "probe").remote.check()
            assert err.value.reason == "unreachable" and err.value.url == url("down")
    with scoped_environ({"AWS_ENDPOINT_URL": dead, "AWS_ACCESS_KEY_ID": "a", "AWS_SECRET_ACCESS_KEY": "b"}):
        cache = EngineCache(url("down"), local_dir=tmp_path / "local")
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            assert cache.get_or_build(key("down"), lambda: b"local") == (b"local", False)
        messages = [str(w.message) for w in seen if issubclass(w.category, CacheWarning)]
        assert len(messages) == 1 and "local cache" in messages[0] and "compile goes on" in messages[0]
        assert EngineCache(url("down"), local_dir=tmp_path / "local").get(key("down")) == b"local"


def test_wrong_credentials_and_read_only_bucket_are_named(tmp_path: Path) -> None:
    s3_server = MotoServer(tmp_path / "moto", auth=True).start()  # refuses unknown keys, as AWS does
    try:
        _credentials_cases(s3_server, tmp_path)
    finally:
        s3_server.stop()


def _credentials_cases(s3_server: MotoServer, tmp_path: Path) -> None:
    with scoped_environ(s3_server.env()):
        EngineCache(url("ro"), local_dir=tmp_path / "admin").put(key("ro"), b"published")
    with (
        scoped_environ(s3_server.env(("AKIAWRONGWRONGWRONG0", "not-the-secret"))),
        pytest.raises(
            CacheStoreError, match=r"s3://kiln/ro: the credentials were refused.*AWS_ACCESS_KEY_ID"
        ),
    ):
        EngineCache(url("ro"), local_dir=tmp_path / "wrong").remote.check()
    with scoped_environ(s3_server.env(s3_server.reader)):
        reader = EngineCache(url("ro"), local_dir=tmp_path / "reader")
        assert reader.remote.check() == "read-only" and "read-only" in reader.remote.write_problem
        with pytest.warns(CacheWarning, match="read-only for these credentials"):
            assert reader.get(key("ro")) == b"published"  # read-only use still reads, and says so
        fresh = EngineCache(url("ro"), local_dir=tmp_path / "reader")  # finds out at its first write
        with pytest.warns(CacheWarning, match="read-only for these credentials.*none is published"):
            assert fresh.get_or_build(key("ro-new"), lambda: b"mine") == (b"mine", False)
    keys = [o["Key"] for o in s3_server.client("s3").list_objects_v2(Bucket=BUCKET)["Contents"]]
    assert [k for k in keys if k.startswith("ro/entries/")] == [f"ro/entries/{key('ro')}.json"]


def test_scheme_without_driver_names_the_package_and_url_setting_stays_a_url(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib.util

    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here: gs:// has its driver")
    with pytest.raises(CacheStoreError, match="install the package 'gcsfs'"):
        EngineCache("gs://bucket/engines", local_dir=tmp_path)
    with pytest.raises(CacheStoreError, match="not a protocol fsspec knows"):
        EngineCache("nosuchscheme://bucket/engines", local_dir=tmp_path)

    from zoo.settings import ZooSettings

    monkeypatch.chdir(tmp_path)  # restored after: later tests resolve paths against the checkout
    assert ZooSettings(engine_cache="s3://kiln/engines").engine_cache_choice() == (
        "s3://kiln/engines",
        "settings.engine_cache",
    )
    assert not (tmp_path / "s3:").exists()


def test_an_empty_entry_reads_back_through_the_ranged_get(s3_server: MotoServer, tmp_path: Path) -> None:
    EngineCache(url("empty"), local_dir=tmp_path / "a").put(key("empty"), b"")
    reader = EngineCache(url("empty"), local_dir=tmp_path / "b")
    assert reader.get(key("empty")) == b"" and reader.stats.remote_hits == 1  # S3 answers 416 to a range


def test_file_url_shares_a_directory(tmp_path: Path) -> None:
    shared = (tmp_path / "shared").as_uri()
    EngineCache(shared, local_dir=tmp_path / "a").put(key("file"), b"on the shared disk")
    reader = EngineCache(shared, local_dir=tmp_path / "b")
    assert reader.backend == "file" and reader.get(key("file")) == b"on the shared disk"
    assert reader.stats.remote_hits == 1


def test_kiln_cache_ls_verify_gc_on_both_layers(s3_server: MotoServer, tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from flows.cli import app

    location = url("cli")
    with scoped_environ({"KILN_CACHE_LOCAL_DIR": str(tmp_path / "local")}):
        cache = EngineCache(location)
        cache.put(key("cli-a"), b"a" * 3000, meta={"partition": "p0"})
        cache.put(key("cli-b"), b"b" * 2000)
        runner = CliRunner()

        listed = runner.invoke(app, ["cache", "ls", location, "--json"])
        assert listed.exit_code == 0, listed.output
        rows = json.loads(listed.output)["entries"]
        assert sorted((r["backend"], r["bytes"]) for r in rows) == [
            ("local", 2000), ("local", 3000), ("s3", 2000), ("s3", 3000)
        ]  # fmt: skip

        s3 = s3_server.client("s3")
        record = json.loads(cache.remote.store.read(f"entries/{key('cli-a')}.json"))
        blob = f"cli/blobs/{record['sha256']}"
        s3.put_object(Bucket=BUCKET, Key=blob, Body=b"a" * 10)  # truncated on the store
        bad = runner.invoke(app, ["cache", "verify", location])
        assert bad.exit_code == 1 and "1 bad" in bad.output and "s3" in bad.output
        assert runner.invoke(app, ["cache", "verify", location, "--evict"]).exit_code == 1
        assert runner.invoke(app, ["cache", "verify", location]).exit_code == 0  # evicted: 3 good left

        gc = runner.invoke(app, ["cache", "gc", location, "--max-bytes", "2500", "--json"])
        assert gc.exit_code == 0, gc.output
        assert json.loads(gc.output)["removed"] == {"local": 1}  # the oldest local entry; s3 holds 2000
        assert runner.invoke(app, ["cache", "gc", location, "--older-than", "0s"]).exit_code == 0
        after = json.loads(runner.invoke(app, ["cache", "ls", location, "--json"]).output)["entries"]
        assert after == []

        assert runner.invoke(app, ["cache", "gc", location]).exit_code == 2  # nothing asked
        assert runner.invoke(app, ["cache", "gc", location, "--older-than", "soon"]).exit_code == 2
    with scoped_environ({"AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}"}):
        down = runner.invoke(app, ["cache", "ls", location])
        assert down.exit_code == 2 and "unreachable" in down.output


def test_gc_on_a_worker_whose_clock_runs_ahead_keeps_fresh_objects(
    s3_server: MotoServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time
    import types

    from compiler.cache import maintenance

    cache = EngineCache(url("skew"), local_dir=tmp_path / "local")
    cache.put(key("skew"), b"fresh" * 100)
    s3 = s3_server.client("s3")
    # A publisher between its two writes: its blob is named by no entry yet, and must survive.
    s3.put_object(Bucket=BUCKET, Key=f"skew/blobs/{'cd' * 32}", Body=b"in flight")
    # This worker's clock is two days ahead of the store's (and of every other worker's).
    ahead = types.SimpleNamespace(time=lambda: time.time() + 2 * 86400)
    monkeypatch.setattr(maintenance, "time", ahead)
    result = maintenance.collect_garbage(cache, older_than=86400)
    assert "s3" not in result.removed and result.orphan_blobs == 0
    keys = {o["Key"] for o in s3.list_objects_v2(Bucket=BUCKET, Prefix="skew/")["Contents"]}
    assert f"skew/entries/{key('skew')}.json" in keys and f"skew/blobs/{'cd' * 32}" in keys
    assert not any(k.startswith("skew/probes/") for k in keys)  # the clock probe is gone
    assert EngineCache(url("skew"), local_dir=tmp_path / "other").get(key("skew")) == b"fresh" * 100
    # Ages still count on the store's clock: an entry older than asked goes.
    time.sleep(2.1)
    assert maintenance.collect_garbage(cache, older_than=1).removed.get("s3") == 1


def test_zoo_check_names_the_url_and_the_variable(tmp_path: Path) -> None:
    import importlib.util

    import yaml
    from typer.testing import CliRunner

    from flows.cli import app

    def zoo(cache: str) -> str:
        path = tmp_path / f"zoo-{abs(hash(cache))}.yaml"
        models = [{"name": "mlp", "factory": "zoo.models:mlp_with_fallback"}]
        path.write_text(
            yaml.safe_dump({"settings": {"engine_cache": cache, "tracking": False}, "models": models})
        )
        return str(path)

    runner = CliRunner()
    dead = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}",
        "AWS_ACCESS_KEY_ID": "a",
        "AWS_SECRET_ACCESS_KEY": "b",
    }
    with scoped_environ({**dead, "KILN_CACHE_LOCAL_DIR": str(tmp_path / "local")}):
        result = runner.invoke(app, ["zoo", zoo("s3://kiln/engines"), "--check"])
    assert result.exit_code == 1
    assert "s3://kiln/engines is unreachable" in result.output and "AWS_ENDPOINT_URL" in result.output
    if importlib.util.find_spec("gcsfs") is None:
        result = runner.invoke(app, ["zoo", zoo("gs://kiln/engines")])
        assert result.exit_code == 2 and "gcsfs" in result.output  # before anything runs


def test_gc_on_s3_never_deletes_an_object_a_record_names_outside_its_blobs(
    s3_server: MotoServer, tmp_path: Path
) -> None:
    """The N14 attack on a real S3 store: a record whose ``sha256`` is a ``../`` path. ``kiln cache gc``
    removes the entry and never the object it names, whether the store reads the key literally
    (``blobs/../victim``) or as a path (``victim``)."""
    import json

    from typer.testing import CliRunner

    from flows.cli import app

    location, k = url("traversal"), key("traversal")
    s3 = s3_server.client("s3")
    victims = ["traversal/victim", "traversal/blobs/../victim", "victim"]
    with scoped_environ({"KILN_CACHE_LOCAL_DIR": str(tmp_path / "local")}):
        cache = EngineCache(location)
        cache.put(k, b"e" * 1000)
        for name in victims:
            s3.put_object(Bucket=BUCKET, Key=name, Body=b"not the cache's")
        record = json.loads(cache.remote.store.read(f"entries/{k}.json"))
        for named in ("../victim", "../../victim"):
            record["sha256"] = named
            s3.put_object(Bucket=BUCKET, Key=f"traversal/entries/{k}.json", Body=json.dumps(record).encode())
            gc = CliRunner().invoke(app, ["cache", "gc", location, "--older-than", "0s"])
            assert gc.exit_code == 0, gc.output
        for name in victims:
            assert s3.get_object(Bucket=BUCKET, Key=name)["Body"].read() == b"not the cache's", name
        left = s3.list_objects_v2(Bucket=BUCKET, Prefix="traversal/entries/").get("KeyCount", 0)
        assert left == 0  # the entry itself, the store's own object, went
