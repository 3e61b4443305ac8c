"""``kiln cache``: list, verify and trim the engine cache, on this disk and on a fleet's object store.

Exit codes as everywhere: 0 ok, 1 failures found (a bad entry), 2 unusable input (a location that is
not a cache, a bad size or duration, a store that cannot be reached or refuses the credentials).
"""

from __future__ import annotations

import json
from datetime import UTC, datetime

import typer

from flows.cli.options import (
    Evict,
    JsonOut,
    Location,
    MaxBytes,
    OlderThan,
    bad_input,
)
from flows.render import EXIT_FAILED, EXIT_OK, console, shown

cache_app = typer.Typer(help="List, verify and trim the engine cache (local and object store).")


def _open(location: str | None):
    from compiler.cache.local import EngineCache
    from compiler.errors import CacheError
    from zoo.settings import ZooSettings

    chosen = location or ZooSettings().engine_cache_dir()
    try:
        return EngineCache(chosen)
    except CacheError as exc:
        raise bad_input(str(exc)) from None


def _when(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M") if epoch else "-"


@cache_app.command("ls")
def cache_ls(location: Location = None, as_json: JsonOut = False) -> None:
    """Entries of both layers: key, backend (local or the store), bytes, last use, what built it."""
    from compiler.cache import maintenance
    from compiler.errors import CacheError

    cache = _open(location)
    try:
        found = maintenance.entries(cache)
    except CacheError as exc:
        raise bad_input(str(exc)) from None
    if as_json:
        rows = [
            {
                "key": e.key,
                "backend": e.backend,
                "bytes": e.bytes,
                "last_used": _when(e.last_used),
                "engine_backend": (e.fields or {}).get("backend"),
                "partition": e.meta.get("partition"),
            }
            for e in found
        ]
        builds = list(_native_builds(cache).values())
        print(json.dumps({"location": cache.location, "entries": rows, "native_builds": builds}, indent=2))
        return
    from rich.table import Table

    table = Table(title=f"engine cache {cache.location} (local layer {cache.directory})")
    for column in ("key", "backend", "bytes", "last use (UTC)", "engine", "partition"):
        table.add_column(column, justify="right" if column == "bytes" else "left")
    for e in found:
        table.add_row(
            e.key[:16],
            e.backend,
            f"{e.bytes:,}",
            _when(e.last_used),
            shown((e.fields or {}).get("backend", "?"), 40),
            shown(e.meta.get("partition", ""), 200),
        )
    console.print(table)
    by_backend: dict[str, list[int]] = {}
    for e in found:
        by_backend.setdefault(e.backend, []).append(e.bytes)
    for backend, sizes in sorted(by_backend.items()):
        console.print(f"{backend}: {len(sizes)} entries, {sum(sizes):,} bytes")
    builds = _native_builds(cache)
    if builds:
        table = Table(title=f"native packages built on this machine ({cache.directory})")
        for column in ("key", "state", "when (UTC)", "seconds", "reason", "why built here"):
            table.add_column(column)
        for key, event in sorted(builds.items(), key=lambda item: item[1].get("time", 0)):
            when = event.get("time")
            table.add_row(
                shown(key[:16]),
                shown(event.get("state"), 40),
                _when(when) if isinstance(when, int | float) else "-",
                shown(event.get("seconds", ""), 20),
                shown(event.get("reason", event.get("compiler", "")), 300),
                shown(event.get("why", ""), 200),
            )
        console.print(table)


def _native_builds(cache) -> dict[str, dict]:
    """Key -> the last event of this machine's native builds (compiler.backends.inductor.native's log)."""
    from compiler.backends.inductor import native

    return native.latest(cache.directory)


@cache_app.command("verify")
def cache_verify(
    location: Location = None,
    evict: Evict = False,
    as_json: JsonOut = False,
) -> None:
    """Check every entry's checksums, on this disk and on the object store. Exit 1 if any is bad."""
    from compiler.cache import maintenance
    from compiler.errors import CacheError

    cache = _open(location)
    try:
        checked, bad = maintenance.verify_all(cache, evict=evict)
    except CacheError as exc:
        raise bad_input(str(exc)) from None
    if as_json:
        print(json.dumps({"checked": checked, "bad": [vars(b) for b in bad], "evicted": evict}, indent=2))
    else:
        for b in bad:
            console.print(f"[red]{b.backend} {b.key[:16]}[/red]: {shown(b.problem)}", soft_wrap=True)
        evicted = " (evicted)" if evict and bad else ""
        console.print(f"{cache.location}: {checked} entries checked, {len(bad)} bad{evicted}")
    raise typer.Exit(EXIT_FAILED if bad else EXIT_OK)


@cache_app.command("gc")
def cache_gc(
    location: Location = None,
    max_bytes: MaxBytes = None,
    older_than: OlderThan = None,
    as_json: JsonOut = False,
) -> None:
    """Remove old entries and the least recently used beyond a size, on both layers; blobs on the
    object store that no entry names go too."""
    from compiler.cache import maintenance
    from compiler.cache.entry import parse_size
    from compiler.errors import CacheError

    if max_bytes is None and older_than is None:
        raise bad_input("kiln cache gc needs --max-bytes and/or --older-than")
    try:
        limit = parse_size(max_bytes, "--max-bytes") if max_bytes is not None else None
        age = maintenance.parse_duration(older_than) if older_than is not None else None
    except CacheError as exc:
        raise bad_input(str(exc)) from None
    cache = _open(location)
    try:
        result = maintenance.collect_garbage(cache, max_bytes=limit, older_than=age)
    except CacheError as exc:
        raise bad_input(str(exc)) from None
    if as_json:
        print(json.dumps(vars(result), indent=2))
        return
    for backend in sorted(result.removed):
        console.print(
            f"{backend}: removed {result.removed[backend]} entries, {result.freed_bytes[backend]:,} bytes"
        )
    if result.orphan_blobs:
        console.print(f"removed {result.orphan_blobs} blobs no entry named")
    if not result.removed and not result.orphan_blobs:
        console.print(f"{cache.location}: nothing to remove")


def register_commands(app: typer.Typer) -> None:
    app.add_typer(cache_app, name="cache")
