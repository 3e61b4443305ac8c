"""Fuzz the engine cache's records and entries as an attacker who can rewrite them (and recompute the
hashes) would, in this fresh process, under an audit hook; report each round.

Run by tests/compiler/cache/test_fuzz_cache.py as ``python cache_fuzz_probe.py CONFIG RESULTS`` (this file).
CONFIG gives a scratch folder, a seed and a time budget. Each round writes one clean entry to a fresh
cache, either a local one (``<key>.bin``/``.json``) or a ``file://`` store read through an empty local
layer (``blobs/<sha256>``, ``entries/<key>.json``), applies one to three mutations (every field of the
record in turn first, then random ones): a field dropped, retyped, huge, negative, a path-like string; the
payload truncated, extended, emptied, recompressed or replaced by a compression bomb with ``bytes`` and
``sha256`` recomputed; a file replaced by a link (to a file outside the cache, to ``/dev/zero``), a FIFO,
a folder or a hard link; a store folder replaced by a link out of the store. Then it reads the entry
(``EngineCache.get``), lists, verifies (sometimes evicting) and collects garbage. A round's outcome:
``same`` (the original engine bytes), ``refused`` (a miss or a KilnError), or a failure: ``different``
bytes, ``crashed`` (any other exception), ``hung`` (over its alarm), or violations: a file opened, listed,
written or deleted outside the cache's folder (``sys.addaudithook``, in the spirit of
tests/compiler/package/untrusted_probe.py's
Watch) other than Python's own reads, or any change to the files kept outside
the cache (contents, times, names). A positive control proves the hook sees a violation.
"""

from __future__ import annotations

import hashlib
import json
import lzma
import os
import random
import re
import shutil
import signal
import sys
import time
import traceback
import warnings
import zlib
from pathlib import Path
from typing import Any

HUGE = [10**30, 2**63, 2**64 + 1, -1, 1.5, True, float("inf"), float("nan")]
FIELDS = ["format_version", "key", "fields", "bytes", "raw_bytes", "sha256", "compression", "created", "meta"]
FIELD_HOWS = ["drop", "retype", "huge", "path", "null"]
WHOLE_RECORD = ["list", "string", "number", "null", "not-json", "empty", "deep", "too-large"]
PAYLOAD = ["truncate", "extend", "empty", "recompress", "bomb", "bomb-lzma"]
FILE_KINDS = ["link-outside", "link-dev-zero", "fifo", "folder", "hardlink-outside", "dangling-link"]
STORE_FOLDERS = ["blobs-link-outside", "entries-link-outside"]
WRITES = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


class Hung(BaseException):  # not an Exception: kiln's own handlers must not swallow it
    pass


# ---------------------------------------------------------------- the watch


class Watch:
    """Records what a round does outside the cache: reads outside the cache and Python's own folders,
    and any write, delete, rename, link or time change outside the cache."""

    MODIFY = {"os.remove", "os.rmdir", "os.rename", "os.link", "os.symlink", "shutil.rmtree", "os.truncate",
              "os.chmod", "os.chown", "os.utime", "os.mkdir", "shutil.move", "shutil.copyfile"}  # fmt: skip
    NO_FOLLOW = {"os.remove", "os.rmdir", "os.rename", "os.link", "os.symlink", "shutil.rmtree", "os.utime"}
    LIST = {"os.listdir", "os.scandir"}
    TWO_PATHS = {"os.rename", "os.link", "shutil.move", "shutil.copyfile"}

    def __init__(self, cache_root: str, readable: list[str]):
        self.cache_root = os.path.realpath(cache_root)
        self.readable = [os.path.realpath(r) for r in readable]
        self.active = False
        self.violations: list[str] = []

    @staticmethod
    def _inside(path: str, roots: list[str]) -> bool:
        return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)

    @staticmethod
    def _resolve(path: Any, follow: bool) -> str | None:
        if isinstance(path, int) or path is None:
            return None  # an open descriptor
        path = os.fsdecode(path) if isinstance(path, bytes | os.PathLike) else path
        if not isinstance(path, str):
            return None
        path = os.path.abspath(path)
        if follow:
            return os.path.realpath(path)
        return os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))

    def __call__(self, event: str, args: tuple) -> None:
        if not self.active:
            return
        if event == "open" and args:
            flags = args[2] if len(args) > 2 and isinstance(args[2], int) else 0
            where = self._resolve(args[0], follow=not flags & os.O_NOFOLLOW)
            if where is None:
                return
            roots = [self.cache_root] if flags & WRITES else [self.cache_root, *self.readable]
            if not self._inside(where, roots):
                self.violations.append(f"open {where} flags={flags:o}")
        elif event in self.LIST and args:
            where = self._resolve(args[0], follow=True)
            if where is not None and not self._inside(where, [self.cache_root, *self.readable]):
                self.violations.append(f"{event} {where}")
        elif event in self.MODIFY and args:
            names = args[:2] if event in self.TWO_PATHS else args[:1]
            for name in names:
                where = self._resolve(name, follow=event not in self.NO_FOLLOW)
                if where is not None and not self._inside(where, [self.cache_root]):
                    self.violations.append(f"{event} {where}")


def snapshot(folder: Path) -> dict[str, Any]:
    """Names, kinds, contents and times of everything under ``folder`` (links not followed)."""
    found = {}
    for path in sorted(folder.rglob("*")):
        info = path.lstat()
        plain = path.is_file() and not path.is_symlink()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if plain else ""
        found[str(path)] = [info.st_mode, info.st_size, info.st_mtime_ns, digest]
    return found


# ---------------------------------------------------------------- staging


def _retyped(value: Any) -> Any:
    if isinstance(value, bool):
        return "true"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return {"0": value}
    if isinstance(value, dict):
        return list(value.items())
    return {"x": 1}


class Round:
    """One fresh cache holding one clean entry, and the mutations applied to it."""

    def __init__(self, base: Path, layer: str, codec: str | None, key: str, engine: bytes, template: Path):
        from compiler.cache.local import EngineCache

        self.base, self.layer, self.key = base, layer, key
        self.local = base / "local"
        if not template.exists():  # written once by the cache itself, then copied for each round
            if layer == "local":
                EngineCache(template / "local", compression=codec).put(key, engine, meta={"partition": "p0"})
            else:
                url = (template / "store").as_uri()
                writer = EngineCache(url, local_dir=template / "writer", compression=codec)
                writer.put(key, engine, meta={"partition": "p0"})
                shutil.rmtree(template / "writer")
        shutil.copytree(template, base, symlinks=True)
        if layer == "local":
            self.record_path = self.local / f"{key}.json"
            self.store = None
        else:
            self.store = base / "store"
            self.record_path = self.store / "entries" / f"{key}.json"
        self.record = json.loads(self.record_path.read_text())

    @property
    def payload_path(self) -> Path:
        if self.store is None:
            return self.local / f"{self.key}.bin"
        sha = self.record.get("sha256") if isinstance(self.record, dict) else None
        named = isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)
        return self.store / "blobs" / (sha if named else "x")

    def reader(self):
        from compiler.cache.local import EngineCache

        if self.store is None:
            return EngineCache(self.local)
        return EngineCache(self.store.as_uri(), local_dir=self.local)

    def write_record(self, text: str | None = None) -> None:
        if not _plain(self.record_path):
            return  # replaced by something else already
        self.record_path.write_text(json.dumps(self.record) if text is None else text)

    def reseal(self, stored: bytes) -> None:
        """Put new payload bytes in place and recompute the record's ``bytes`` and ``sha256``."""
        if not isinstance(self.record, dict):
            return
        old = self.payload_path
        self.record.update(bytes=len(stored), sha256=hashlib.sha256(stored).hexdigest())
        if _plain(old) and self.store is not None:
            old.unlink()
        self.payload_path.parent.mkdir(parents=True, exist_ok=True)
        path = self.payload_path
        if _plain(path) or (not os.path.lexists(path) and _inside(path.parent, self.base)):
            path.write_bytes(stored)
        self.write_record()


def _inside(path: Path, folder: Path) -> bool:
    return os.path.realpath(path).startswith(os.path.realpath(folder) + "/")


def _plain(path: Path) -> bool:
    """A regular file of the cache's own: the staging never writes through a link or a hard link."""
    own = _inside(path, path.parents[2])  # the round's folder, or the cache folder holding it
    return own and path.is_file() and not path.is_symlink() and path.stat().st_nlink == 1


def path_like(outside: Path, rng: random.Random) -> Any:
    return rng.choice(
        [
            "../../outside/victim",
            "../../../outside/victim",
            str(outside / "victim"),
            "blobs/../../outside/victim",
            "..",
            ".",
            "",
            "/",
            "b" * 64,
            "B" * 64,
            "0" * 64,
            hashlib.sha256((outside / "victim").read_bytes()).hexdigest(),
            "../" * 20 + "etc/passwd",
            "x" * 5000,
            "a\x00b",
        ]
    )


def mutate(rnd: Round, what: tuple, outside: Path, bombs: dict[str, bytes], rng: random.Random) -> None:
    kind = what[0]
    if kind == "field":
        _, field, how = what
        record = rnd.record
        if not isinstance(record, dict):
            return
        if how == "drop":
            record.pop(field, None)
        elif how == "retype":
            record[field] = _retyped(record.get(field))
        elif how == "huge":
            record[field] = rng.choice(HUGE)
        elif how == "path":
            record[field] = path_like(outside, rng)
        elif how == "null":
            record[field] = None
        rnd.write_record()
    elif kind == "record":
        texts = {
            "list": "[1, 2]",
            "string": '"record"',
            "number": "1e999",
            "null": "null",
            "not-json": "{not json",
            "empty": "",
            "deep": "[" * 100_000 + "]" * 100_000,
            "too-large": " " * (5 << 20) + "{}",
        }
        rnd.record = None
        rnd.write_record(texts[what[1]])
    elif kind == "payload":
        path = rnd.payload_path
        if not _plain(path):
            return
        stored = path.read_bytes()
        how = what[1]
        if how == "truncate":
            rnd.reseal(stored[: rng.randrange(max(len(stored), 1))])
        elif how == "extend":
            rnd.reseal(stored + os.urandom(rng.choice([1, 100, 5000])))
        elif how == "empty":
            rnd.reseal(b"")
        elif how == "recompress" and isinstance(rnd.record, dict):
            codec = rng.choice(["zlib", "lzma", None])
            raw = _raw(stored, rnd.record.get("compression"))
            if raw is not None:
                rnd.record["compression"] = codec
                rnd.reseal({"zlib": zlib.compress, "lzma": lzma.compress, None: bytes}[codec](raw))
        elif how in ("bomb", "bomb-lzma") and isinstance(rnd.record, dict):
            rnd.record["compression"] = "zlib" if how == "bomb" else "lzma"
            rnd.reseal(bombs[how])
    elif kind == "file":
        _, which, how = what
        path = rnd.record_path if which == "record" else rnd.payload_path
        if path.is_symlink() or path.exists():
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        if how == "link-outside":
            path.symlink_to(outside / "victim")
        elif how == "link-dev-zero":
            path.symlink_to("/dev/zero")
        elif how == "fifo":
            os.mkfifo(path)
        elif how == "folder":
            path.mkdir()
            (path / "inside").write_text("x")
        elif how == "hardlink-outside":
            os.link(outside / "victim", path)
        elif how == "dangling-link":
            path.symlink_to(outside / "does-not-exist")
    elif kind == "store" and rnd.store is not None:
        folder = rnd.store / ("blobs" if what[1] == "blobs-link-outside" else "entries")
        if not folder.is_symlink():
            shutil.rmtree(folder, ignore_errors=True)
            folder.symlink_to(outside / "store-folder")


def _raw(stored: bytes, codec: Any) -> bytes | None:
    try:
        return {"zlib": zlib.decompress, "lzma": lzma.decompress, None: bytes}[codec](stored)
    except Exception:
        return None


def sweep() -> list[tuple]:
    """Every single mutation once: each field of the record each way, each whole-record and payload
    mutation, each file kind for the record and the payload, each store folder."""
    cases: list[tuple] = [("field", f, h) for f in FIELDS for h in FIELD_HOWS]
    cases += [("record", w) for w in WHOLE_RECORD] + [("payload", p) for p in PAYLOAD]
    cases += [("file", which, k) for which in ("record", "payload") for k in FILE_KINDS]
    cases += [("store", s) for s in STORE_FOLDERS]
    return cases


# ---------------------------------------------------------------- running


def operate(rnd: Round, engine: bytes, rng: random.Random) -> dict[str, Any]:
    """Read, list, verify, collect garbage: the outcome of one round."""
    from compiler.cache import maintenance
    from compiler.errors import KilnError

    result: dict[str, Any] = {}
    try:
        cache = rnd.reader()
        data = cache.get(rnd.key)
        result["outcome"] = "same" if data == engine else "refused" if data is None else "different"
        maintenance.entries(cache)
        maintenance.verify_all(cache, evict=rng.random() < 0.5)
        if rng.random() < 0.5:
            maintenance.collect_garbage(cache, older_than=0.0)
        else:
            maintenance.collect_garbage(cache, max_bytes=1)
    except KilnError as exc:
        result.setdefault("outcome", "refused")
        result["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    except Hung:
        result.update(outcome="hung")
    except BaseException as exc:  # an untyped failure: the test reports it
        result.update(
            outcome="crashed",
            error=f"{type(exc).__name__}: {exc}"[:300],
            trace=traceback.format_exc()[-1500:],
        )
    return result


def run(config: dict, results_path: Path) -> None:
    import compiler.cache.maintenance  # noqa: F401  (imported before the hook: not the round's doing)
    from compiler.cache.local import EngineCache

    rng = random.Random(config["seed"])
    scratch = Path(config["scratch"])
    cache_root, outside = scratch / "cache", scratch / "outside"
    cache_root.mkdir(mode=0o700)
    outside.mkdir()
    (outside / "victim").write_text("not the cache's")
    (outside / ("b" * 64)).write_text("named like a blob")
    (outside / "store-folder").mkdir()
    engine = os.urandom(2000) + bytes(3000)
    key = str(EngineCache.key(fingerprint="fuzz", backend="onnxruntime", library_version="1",
                              engine_target="cpu", settings={"opt": 3}))  # fmt: skip
    # What following a link out would find: a good copy of the entry, so a read outside is not refused.
    templates = scratch / "templates"
    clean = Round(scratch / "clean", "store", None, key, engine, templates / "store-None")
    shutil.copy(clean.record_path, outside / f"{key}.json")
    shutil.copy(clean.payload_path, outside / "store-folder" / clean.record["sha256"])
    shutil.copy(clean.record_path, outside / "store-folder" / f"{key}.json")
    zeros = bytes(8 << 20)
    bombs = {"bomb": zlib.compress(zeros, 9), "bomb-lzma": lzma.compress(zeros, preset=1)}
    operate(clean, engine, rng)  # warm: imports and first-use probes are not a round's doing

    readable = [sys.prefix, sys.base_prefix, sys.exec_prefix, config["root"], "/dev/null", "/dev/urandom",
                "/proc/self", "/etc/localtime", "/usr/share/zoneinfo"]  # fmt: skip
    watch = Watch(str(cache_root), readable)
    sys.addaudithook(watch)

    def alarm(signum, frame):
        raise Hung()

    signal.signal(signal.SIGALRM, alarm)
    planned = sweep()
    rounds: list[dict] = []
    started = time.monotonic()
    while len(rounds) < config["max_rounds"]:
        n, elapsed = len(rounds), time.monotonic() - started
        # The sweep always runs whole (within a hard bound); random rounds fill the time left.
        if elapsed > config["seconds"] * (1.5 if n < 2 * len(planned) else 1.0):
            break
        if n < 2 * len(planned):  # the sweep: each mutation on each layer (a store folder: the store)
            whats = [planned[n // 2]]
            layer = "store" if whats[0][0] == "store" else ("local", "store")[n % 2]
        else:
            whats = [rng.choice(planned) for _ in range(rng.randint(1, 3))]
            layer = rng.choice(["local", "store"])
        codec = rng.choice([None, "zlib", "lzma"])
        base = cache_root / f"r{n}"
        rnd = Round(base, layer, codec, key, engine, templates / f"{layer}-{codec}")
        for what in whats:
            mutate(rnd, what, outside, bombs, rng)
        before = snapshot(outside)
        began = time.monotonic()
        watch.violations, watch.active = [], True
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            signal.setitimer(signal.ITIMER_REAL, config.get("alarm", 3.0))
            try:
                result = operate(rnd, engine, rng)
            finally:
                signal.setitimer(signal.ITIMER_REAL, 0)
        watch.active = False
        after = snapshot(outside)
        changed = [name for name in before.keys() | after.keys() if before.get(name) != after.get(name)]
        result.update(
            layer=layer,
            codec=codec,
            mutations=[list(w) for w in whats],
            violations=list(watch.violations) + [f"changed outside the cache: {c}" for c in changed],
            warnings=[str(w.message)[:200] for w in caught][:3],
            seconds=round(time.monotonic() - began, 3),
        )
        rounds.append(result)  # its folder stays: deleting folders costs more than a round here

    # The positive control: what the rule forbids, done on purpose, must be seen.
    watch.violations, watch.active = [], True
    (outside / "victim").read_bytes()
    os.utime(outside / "victim")
    watch.active = False
    control = list(watch.violations)
    results_path.write_text(json.dumps({"rounds": rounds, "control": control, "sweep": len(planned)}))


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
