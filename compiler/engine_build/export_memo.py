"""The ONNX export of a partition, kept for the rest of the process, keyed by what the exporter traces.

``torch.onnx.export`` of one partition is the most expensive step of an int8 compile on ONNX Runtime:
the quantizer lowers each int8 partition in fp32 at partitioning, the layer search lowers it again, and
accuracy repair (also a repair reused from the engine cache) quantizes it once more with its float
layers, each an identical export (~5 s for a BERT 4 x 256 on 2 cores). Weights are graph inputs until
after the export (:func:`compiler.engine_build.lower.lower_float`), so the exported graph depends on
the traced graph and the types and shapes of its inputs, never on weight values: that is the key.
The graph is the fingerprint's own structure (:func:`compiler.partitioning.fingerprint.structure`: ops,
arguments, shapes with their dimension names and ranges, dtypes, input kinds), which engine dedup
already trusts to decide that two partitions lower to one engine graph. What is kept is the exported
graph without weights (small); each use gets its own copy to put its weights into.

Where ``$KILN_EXPORT_CACHE`` names a folder (:func:`compiler.cache.paths.export_cache_dir`), the graphs
are also kept there for other processes: the same structures exported again by every `kiln zoo` run of
a CI suite or a developer's loop (``torch.onnx.export`` was 14% of the test suite's CPU). On disk the key
also holds kiln's compile library (:func:`code_version`: an edit to it is a new key) and onnxscript's
version; a file is used only when its sha256 (written beside the graph) matches, else exported again and
replaced. The folder is trusted input like the engine cache (docs/security.md): private to its user.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from importlib import metadata
from pathlib import Path

import onnx
import torch
from google.protobuf.message import DecodeError

from compiler.atomic import write_bytes_atomic
from compiler.cache.files import EntryFileError, read_own_file
from compiler.cache.paths import EXPORT_CACHE_ENV, check_private, export_cache_dir, resolve_directory
from compiler.partitioning.fingerprint import structure

_log = logging.getLogger(__name__)
# A kept graph on disk: this line, the sha256 of the graph's bytes and a newline, then the graph.
_MAGIC = b"kiln-onnx-export-1\n"

# A few partitions' graphs: one compile's int8 partitions are lowered again within minutes of each other.
KEEP = 8
# A kept graph has no weights: far below this; a larger file is not one kiln wrote.
MAX_BYTES = 256 << 20

_graphs: OrderedDict[str, bytes] = OrderedDict()
_lock = threading.Lock()


def export_key(
    graph: torch.fx.Graph,
    kinds: Sequence[str],
    symbols: Mapping[str, tuple[str, int, int, int]],
    traced: Mapping[str, object],
    weights: Mapping[str, torch.Tensor],
) -> str:
    """sha256 of what the exporter sees: the partition's structure, ``traced`` (precision, ops kept in
    fp32, input and output names and types, dynamic shapes) and each weight input's dtype and shape."""
    payload = {
        "structure": structure(graph, tuple(kinds), symbols),
        "traced": {k: repr(v) for k, v in sorted(traced.items())},
        "weights": [[name, str(t.dtype), list(t.shape)] for name, t in weights.items()],
        "torch": torch.__version__,
        "onnx": onnx.__version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def exported(
    key: str,
    export: Callable[[], onnx.ModelProto],
    names: tuple[Sequence[str], Sequence[str]] | None = None,
) -> onnx.ModelProto:
    """A fresh copy of the exported graph under ``key``, exporting it with ``export`` the first time
    (in this process, or in any process sharing ``$KILN_EXPORT_CACHE``). Two threads or processes
    missing at once both export (the same graph); a failed export keeps nothing. ``names``: the graph's
    input and output names, which a kept graph must have (else it is exported again)."""
    with _lock:
        blob = _graphs.get(key)
        if blob is not None:
            _graphs.move_to_end(key)
    if blob is not None:
        return onnx.load_from_string(blob)
    path = _disk_path(key)
    kept = _from_disk(path, names) if path is not None else None
    if kept is not None:
        blob, model = kept
    else:
        model = export()
        blob = model.SerializeToString()
        if path is not None:
            _keep(path, blob)
    with _lock:
        _graphs[key] = blob
        while len(_graphs) > KEEP:
            _graphs.popitem(last=False)
    return model


@functools.cache
def code_version() -> str:
    """sha256 of kiln's compile library (every ``compiler/**/*.py``, by path and bytes) and onnxscript's
    version: what else decides the graph an export gives, beside the key's torch and onnx."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256(_version("onnxscript").encode())
    for source in sorted(root.rglob("*.py")):
        digest.update(source.relative_to(root).as_posix().encode() + b"\0" + source.read_bytes())
    return digest.hexdigest()


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def _disk_path(key: str) -> Path | None:
    """Where the graph under ``key`` is kept across processes, or None (no ``$KILN_EXPORT_CACHE``).
    A folder another user could write, or a file where the folder should be, is refused (CacheError
    naming the fix)."""
    folder = export_cache_dir()
    if folder is None:
        return None
    resolve_directory(folder)  # a file in its place (or above it): CacheError naming it
    check_private(
        folder,
        what="export cache directory",
        why="its graphs are built into engines",
        other=f"point {EXPORT_CACHE_ENV} at a directory of your own, or unset it",
    )
    return folder / disk_name(key, code_version())


def disk_name(key: str, code: str) -> str:
    """The file name of the graph under ``key`` exported by kiln's compile library ``code``."""
    return hashlib.sha256(f"{key}:{code}".encode()).hexdigest() + ".onnx"


def _read_kept(path: Path) -> bytes | None:
    """The graph kept at ``path`` if it is whole (its sha256 matches), else None (exported again). Read
    as the engine cache reads its files: a regular file only, at most :data:`MAX_BYTES`."""
    try:
        data = read_own_file(path, MAX_BYTES)
    except (OSError, EntryFileError) as exc:  # a link, FIFO, folder, a file too large
        _log.warning("kept ONNX export unreadable, exporting the partition again: %s", exc)
        return None
    if data is None:
        return None
    head = len(_MAGIC) + 65
    digest, blob = data[len(_MAGIC) : head - 1], data[head:]
    if data[: len(_MAGIC)] != _MAGIC or hashlib.sha256(blob).hexdigest().encode() != digest:
        _log.warning("kept ONNX export %s is damaged; exporting the partition again", path)
        return None
    return blob


def _from_disk(
    path: Path, names: tuple[Sequence[str], Sequence[str]] | None
) -> tuple[bytes, onnx.ModelProto] | None:
    """The graph kept at ``path``, decoded, if it is whole, decodes and has ``names``; else None (a bad
    file, exported again and replaced, as a bad engine cache entry is rebuilt)."""
    blob = _read_kept(path)
    if blob is None:
        return None
    try:
        model = onnx.load_from_string(blob)
    except DecodeError as exc:
        _log.warning("kept ONNX export %s does not decode (%s); exporting the partition again", path, exc)
        return None
    found = ([i.name for i in model.graph.input], [o.name for o in model.graph.output])
    if names is not None and found != (list(names[0]), list(names[1])):
        _log.warning("kept ONNX export %s has other inputs or outputs; exporting the partition again", path)
        return None
    return blob, model


def _keep(path: Path, blob: bytes) -> None:
    """Write the graph for other processes; a folder that cannot take it costs only the next export."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        write_bytes_atomic(path, _MAGIC + hashlib.sha256(blob).hexdigest().encode() + b"\n" + blob)
    except OSError as exc:
        _log.warning("could not keep the ONNX export in %s: %s", path.parent, exc)


def clear() -> None:
    """Forget every graph this process keeps (tests that count exports); ``$KILN_EXPORT_CACHE`` stays."""
    with _lock:
        _graphs.clear()
