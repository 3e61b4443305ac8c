"""Chunk digests: the sha256 of each fixed-size piece of a large package file, beside the file's own.

A file's sha256 is one sequential stream: 0.68 s of OPT-350m's 765 MB weights on the H200's host, the
largest part of what a trusted load of it costs (benchmarks/results/cold_start_zoo_h200_fp16_final.json).
With a digest per piece, recorded in the manifest (so covered by its content hash and
signature), a load checks the pieces on several threads at once, each piece before any of its bytes is
used, and the file is still exactly the bytes that were checked. The file's own sha256 stays in the
manifest: what older kilns check. Chunks are 4 MiB, larger for files of over 1,024 of them (a manifest
lists at most about that many per file), so that the example zoo's packages (8-10 MB of weights) are
read this way too.
"""

from __future__ import annotations

import hashlib
import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

CHUNK_BYTES = 4 << 20  # a file larger than this lists its chunks' digests
MAX_CHUNKS = 1024  # per file, where chunks of CHUNK_BYTES would be more: larger chunks
MIN_CHUNK_BYTES = 4096  # a manifest's chunk size is held to these bounds: no million-piece lists
MAX_CHUNK_BYTES = 1 << 30
MAX_WORKERS = 8  # hashing is memory-bound well before this many threads


def workers(chunks: int) -> int:
    """Threads to check ``chunks`` pieces on: this process's cores, at most MAX_WORKERS."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(chunks, cores, MAX_WORKERS))


def _piece(data: memoryview, index: int, chunk_bytes: int) -> memoryview:
    return data[index * chunk_bytes : (index + 1) * chunk_bytes]


def chunk_bytes_for(size: int) -> int:
    """The chunk size a file of ``size`` bytes is listed in: CHUNK_BYTES, or the power of two that
    keeps it within MAX_CHUNKS chunks."""
    return max(CHUNK_BYTES, 1 << max(0, math.ceil(size / MAX_CHUNKS) - 1).bit_length())


def _digests(view: memoryview, step: int, pool: ThreadPoolExecutor) -> list[str]:
    count = math.ceil(len(view) / step)
    return list(pool.map(lambda i: hashlib.sha256(_piece(view, i, step)).hexdigest(), range(count)))


def file_digests(data: bytes | memoryview) -> tuple[str, int | None, tuple[str, ...]]:
    """(the sha256 of ``data``, its chunk size and its chunks' sha256s: None and none where it fits in
    one chunk), the chunks hashed beside the whole (hashlib releases the GIL)."""
    view = memoryview(data).cast("B")
    if len(view) <= CHUNK_BYTES:
        return hashlib.sha256(view).hexdigest(), None, ()
    step = chunk_bytes_for(len(view))
    with ThreadPoolExecutor(
        workers(math.ceil(len(view) / step)) + 1, thread_name_prefix="kiln-digest"
    ) as pool:
        whole = pool.submit(lambda: hashlib.sha256(view).hexdigest())
        pieces = tuple(_digests(view, step, pool))  # beside the whole, which is waited for after
        return whole.result(), step, pieces


def matches(data: bytes | memoryview, chunk_bytes: int, chunks: Sequence[str]) -> bool:
    """Whether ``data`` has exactly the listed chunks (length included), checked on several threads."""
    view = memoryview(data).cast("B")
    if len(chunks) != math.ceil(len(view) / chunk_bytes):
        return False
    with ThreadPoolExecutor(workers(len(chunks)), thread_name_prefix="kiln-digest") as pool:
        return _digests(view, chunk_bytes, pool) == list(chunks)


def malformed(size: int, chunk_bytes: int | None, chunks: Sequence[str]) -> str | None:
    """What is wrong with a file record's chunk list (None: nothing, or no list)."""
    if chunk_bytes is None and not chunks:
        return None
    if chunk_bytes is None or not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        return f"chunk size {chunk_bytes!r} outside {MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES} bytes"
    if len(chunks) != math.ceil(size / chunk_bytes):
        return f"{len(chunks)} chunk digests for {size} bytes in chunks of {chunk_bytes}"
    return None
