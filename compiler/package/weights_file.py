"""The package's weights file, read once: hashed, checked and put on the load's device in one pass.

``safetensors.torch.load`` wants the whole file as bytes: read, then hashed, then decoded into host
tensors, then each copied to the device, four passes one after the other (1.15 s for GPT-2's 652 MB on
the 2-core CPU here; the weights stage was 1.2 s of a 1.9 s GPT-2 load on the H200,
benchmarks/results/cold_start_default_h200.json). Here the file is read in chunks into (pinned)
buffers; each chunk is hashed on a thread of its own, and its copy to the device is queued on a side
stream, while the next one is read: reads and copies hide behind the hash (0.46 s here,
``benchmarks/probes/probe_weights_read.py``). The tensors are views of the one buffer (copied once more
only where their offset is not 16-byte aligned). Where the manifest lists the file's chunk digests
(compiler.package.chunks: every file over 4 MiB since they exist), the single sha256 stream that bounds
that pipeline is gone too: several threads each read, check and copy chunks of their own.

Checked as ``read_verified`` checks a file (listed, plain, its length and sha256 the manifest's), and
nothing is used before the whole file's digest (or every chunk's) matched: a package that passed its
checks is exactly the bytes that were checked. The safetensors header is then held to what the
format's own reader requires (known dtypes, sizes that match shapes, offsets that tile the data
exactly, no duplicate names), so a header that lies is a :class:`PackageCorruptError`, as
safetensors' own error was.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import torch

from compiler import json_reader
from compiler.errors import PackageCorruptError
from compiler.package import chunks
from compiler.package.check import checksum_error, open_listed
from compiler.package.manifest import FileRecord, Manifest

CHUNK_BYTES = 16 << 20  # read (and, without chunk digests, hashed) this much at a time
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
ALIGNMENT = 16  # bytes: what vectorized kernels assume of a tensor's start

_DTYPES = {
    name: dtype
    for name, dtype in {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "BOOL": torch.bool,
        "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
        "F8_E5M2": getattr(torch, "float8_e5m2", None),
        "U16": getattr(torch, "uint16", None),
        "U32": getattr(torch, "uint32", None),
        "U64": getattr(torch, "uint64", None),
        "C64": torch.complex64,
    }.items()
    if dtype is not None
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a safetensors file: where its bytes are, counted from the start of the file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


def read_weights(
    path: Path,
    rel: str,
    manifest: Manifest,
    target: torch.device,
    *,
    chunk_bytes: int = CHUNK_BYTES,
    workers: int | None = None,
) -> dict[str, torch.Tensor]:
    """The tensors of the package's safetensors file ``rel`` on ``target``, its bytes checked first:
    where the manifest lists the file's chunk digests, chunk by chunk on ``workers`` threads (by default
    :func:`compiler.package.chunks.workers`); else against its sha256, read ``chunk_bytes`` at a time."""
    record = manifest.files.get(rel)
    size = record.bytes if record is not None else 0
    with open_listed(path, rel, manifest) as file:
        if record.chunks:  # each piece checked on one of several threads, the file's sha256 not needed
            buffer = _read_chunks(file, record, target, workers or chunks.workers(len(record.chunks)))
            if buffer is None:
                raise checksum_error(path, rel, manifest)
            return _tensors(path, rel, buffer, _head(buffer, size) if target.type == "cuda" else None, size)
        if target.type == "cuda":
            buffer, head, digest = _read_to_device(file, size, target, chunk_bytes)
        else:
            buffer, digest = _read_to_host(file, size, chunk_bytes)
            head = None
        if file.read(1):  # longer than listed
            raise checksum_error(path, rel, manifest)
    if digest != record.sha256:
        raise checksum_error(path, rel, manifest)
    return _tensors(path, rel, buffer, head, size)


def _tensors(
    path: Path, rel: str, buffer: torch.Tensor, head: bytes | None, size: int
) -> dict[str, torch.Tensor]:
    """The checked file's tensors, views of ``buffer``; ``head``: its header's bytes (None: read from
    ``buffer``, on the host)."""
    if head is None:  # the header is read where it lies
        head = _writable(buffer, size) if size else b""
    try:
        entries = parse_header(head, size)
    except ValueError as exc:
        raise PackageCorruptError(f"{path}: {rel} is not a safetensors file kiln reads: {exc}") from exc
    return {entry.name: _view(buffer, entry) for entry in entries}


def _head(buffer: torch.Tensor, size: int) -> bytes:
    """The header's bytes of a checked file on the device (its length first), copied back."""
    if size < 8:
        return bytes(buffer.cpu().numpy())
    length = int.from_bytes(bytes(buffer[:8].cpu().numpy()), "little")
    return bytes(buffer[: min(8 + length, 8 + MAX_HEADER_BYTES, size)].cpu().numpy())


def _pread_into(fd: int, view: memoryview, offset: int) -> bool:
    """Fill ``view`` from ``fd`` at ``offset`` (os.preadv releases the GIL); False: the file ended."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if not got:
            return False
        done += got
    return True


def parse_header(head: bytes | memoryview, size: int) -> list[TensorEntry]:
    """The tensors a safetensors file of ``size`` bytes names in its header (``head``: at least the
    file's first 8 + header-length bytes); ValueError naming what is wrong."""
    if size < 8 or len(head) < 8:
        raise ValueError(f"{size} bytes, shorter than its 8-byte header length")
    length = int.from_bytes(head[:8], "little")
    if length > MAX_HEADER_BYTES or 8 + length > size or len(head) < 8 + length:
        raise ValueError(f"a header of {length} bytes does not fit the file's {size}")

    def unique(pairs: list[tuple[str, object]]) -> dict:
        names = [name for name, _ in pairs]
        if len(names) != len(set(names)):
            raise ValueError(f"its header names a tensor twice ({sorted(names)[:3]}...)")
        return dict(pairs)

    header = json_reader.loads(
        bytes(head[8 : 8 + length]), "its header", max_bytes=MAX_HEADER_BYTES, object_pairs_hook=unique
    )
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ValueError("its __metadata__ is not an object of strings")
    data_start, entries = 8 + length, []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"tensor {name!r:.80}: expected dtype, shape and data_offsets")
        name_of_dtype = info["dtype"] if isinstance(info["dtype"], str) else None  # a list: unhashable
        dtype, shape, offsets = _DTYPES.get(name_of_dtype), info["shape"], info["data_offsets"]
        if dtype is None:
            raise ValueError(f"tensor {name!r:.80}: unknown dtype {info['dtype']!r:.20}")
        if not _ints(shape) or not _ints(offsets) or len(offsets) != 2:
            raise ValueError(f"tensor {name!r:.80}: shape and data_offsets must be non-negative integers")
        if math.prod(max(d, 1) for d in shape) >= 2**63:
            # torch's sizes and strides are int64: a zero-size tensor would pass the byte count below
            # with any other dimension, and fail later as an untyped TypeError.
            raise ValueError(f"tensor {name!r:.80}: shape {shape} does not fit torch's 64-bit sizes")
        begin, end = offsets
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name!r:.80}: {end - begin} bytes for shape {shape} of {info['dtype']}")
        entries.append(TensorEntry(name, dtype, tuple(shape), data_start + begin, data_start + end))
    entries.sort(key=lambda e: (e.start, e.end))
    position = data_start
    for entry in entries:  # the data is tiled exactly: no overlap, no gap, nothing after
        if entry.start != position:
            raise ValueError(f"tensor {entry.name!r:.80} does not start where the one before it ends")
        position = entry.end
    if position != size:
        raise ValueError(f"its tensors end at byte {position}, the file at {size}")
    return entries


def _ints(values: object) -> bool:
    return isinstance(values, list) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values
    )


def _writable(tensor: torch.Tensor, count: int) -> memoryview:
    """The first ``count`` bytes of a host uint8 tensor, as a buffer files read into and hashes read."""
    return memoryview((ctypes.c_char * count).from_address(tensor.data_ptr())).cast("B")


def _read_into(file: BinaryIO, view: memoryview) -> None:
    done = 0
    while done < len(view):
        got = file.readinto(view[done:])
        if not got:
            raise EOFError
        done += got


class _Hasher:
    """sha256 over chunks in order, on its own thread: the next chunk is read while this one is hashed
    (file reads and hashlib both release the GIL)."""

    def __init__(self) -> None:
        self._digest = hashlib.sha256()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="kiln-sha256")
        self._pending: dict[int, Future] = {}

    def add(self, key: int, chunk: memoryview) -> None:
        self._pending[key] = self._thread.submit(self._digest.update, chunk)

    def done_with(self, key: int) -> None:
        """Wait until the chunk added under ``key`` is hashed (its buffer may then be read into again)."""
        pending = self._pending.pop(key, None)
        if pending is not None:
            pending.result()

    def hexdigest(self) -> str:
        self.close()
        return self._digest.hexdigest()

    def close(self) -> None:
        """Wait for every chunk added: none may be read after its buffer is freed (a read that failed)."""
        self._thread.shutdown(wait=True)
        self._pending.clear()

    def __enter__(self) -> _Hasher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _read_to_host(file: BinaryIO, size: int, chunk_bytes: int) -> tuple[torch.Tensor, str]:
    buffer = torch.empty(size, dtype=torch.uint8)
    view = _writable(buffer, size) if size else memoryview(b"")
    with _Hasher() as hasher:
        for index, offset in enumerate(range(0, size, chunk_bytes)):
            chunk = view[offset : offset + chunk_bytes]
            try:
                _read_into(file, chunk)
            except EOFError:
                return buffer, "short"
            hasher.add(index, chunk)
        return buffer, hasher.hexdigest()


def _read_to_device(
    file: BinaryIO, size: int, target: torch.device, chunk_bytes: int
) -> tuple[torch.Tensor, bytes, str]:
    """(the file on ``target``, its first bytes up to the end of the header, its sha256). Pinned staging
    buffers in turn: one is read while the one before is hashed and the one before that copied."""
    buffer = torch.empty(size, dtype=torch.uint8, device=target)
    stream = torch.cuda.Stream(target)
    # The buffer's memory may have been freed by work still queued on this thread's stream: after it.
    stream.wait_stream(torch.cuda.current_stream(target))
    slots = 3
    staging = [
        torch.empty(min(chunk_bytes, max(size, 1)), dtype=torch.uint8, pin_memory=True) for _ in range(slots)
    ]
    copied: list[torch.cuda.Event | None] = [None] * slots
    head, wanted, sized = bytearray(), 8, False
    with _Hasher() as hasher:
        try:
            for index, offset in enumerate(range(0, size, chunk_bytes)):
                slot, count = index % slots, min(chunk_bytes, size - offset)
                hasher.done_with(index - slots)  # the slot's previous chunk is hashed ...
                if copied[slot] is not None:
                    copied[slot].synchronize()  # ... and on the device: the slot is free
                chunk = _writable(staging[slot], count)
                try:
                    _read_into(file, chunk)
                except EOFError:
                    return buffer, bytes(head), "short"
                hasher.add(index, chunk)
                # The header's bytes (its length first), kept apart before the slot is read into again.
                while len(head) < min(wanted, offset + count):
                    head += chunk[len(head) - offset : wanted - offset]
                    if not sized and len(head) == 8:
                        sized, wanted = (
                            True,
                            min(8 + int.from_bytes(head, "little"), 8 + MAX_HEADER_BYTES, size),
                        )
                with torch.cuda.stream(stream):
                    buffer[offset : offset + count].copy_(staging[slot][:count], non_blocking=True)
                    copied[slot] = stream.record_event()
        finally:
            stream.synchronize()
        return buffer, bytes(head), hasher.hexdigest()


def _read_chunks(
    file: BinaryIO, record: FileRecord, target: torch.device, workers: int
) -> torch.Tensor | None:
    """The file's bytes in ``target``'s memory, each chunk checked against its listed sha256; None
    where one differs (or the file is shorter or longer than listed). Worker ``w`` reads, hashes and
    copies chunks w, w + workers, ..., at most CHUNK_BYTES at a time: on the device through two pinned
    staging buffers of its own, each copy on its own stream while it reads the next piece. Nothing is
    used before every chunk matched (the tensors are made by the caller, after)."""
    size, step, fd = record.bytes, record.chunk_bytes, file.fileno()
    piece = min(step, CHUNK_BYTES, max(size, 1))
    cuda = target.type == "cuda"
    buffer = torch.empty(size, dtype=torch.uint8, device=target)
    host = None if cuda or not size else _writable(buffer, size)
    allocated = torch.cuda.current_stream(target) if cuda else None

    def check(first: int) -> bool:
        stream = staging = None
        if cuda:
            stream = torch.cuda.Stream(target)
            stream.wait_stream(allocated)  # the buffer's memory may have been freed by queued work: after it
            staging = [torch.empty(piece, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        copied: list[torch.cuda.Event | None] = [None, None]
        turn = 0
        try:
            for index in range(first, len(record.chunks), workers):
                digest = hashlib.sha256()
                for offset in range(index * step, min((index + 1) * step, size), piece):
                    count = min(piece, size - offset)
                    if staging is None:
                        view = host[offset : offset + count]
                    else:
                        slot, turn = turn % 2, turn + 1
                        if copied[slot] is not None:
                            copied[slot].synchronize()  # its last copy is done: it may be read into
                        view = _writable(staging[slot], count)
                    if not _pread_into(fd, view, offset):
                        return False
                    digest.update(view)
                    if staging is not None:
                        with torch.cuda.stream(stream):
                            buffer[offset : offset + count].copy_(staging[slot][:count], non_blocking=True)
                            copied[slot] = stream.record_event()
                if digest.hexdigest() != record.chunks[index]:
                    return False
            return True
        finally:
            if stream is not None:
                stream.synchronize()

    with ThreadPoolExecutor(workers, thread_name_prefix="kiln-chunks") as pool:
        checked = list(pool.map(check, range(workers)))
    return buffer if all(checked) and not os.pread(fd, 1, size) else None


def _view(buffer: torch.Tensor, entry: TensorEntry) -> torch.Tensor:
    data = buffer[entry.start : entry.end]
    if entry.start % ALIGNMENT:  # a view would start unaligned (after an odd-sized tensor): its own copy
        data = data.clone()
    return data.view(entry.dtype).view(entry.shape)
