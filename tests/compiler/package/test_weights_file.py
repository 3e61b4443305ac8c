"""The package's weights file read in one pass (compiler.package.weights_file): the same tensors as
safetensors' own reader, every byte checked before any is used, and a header that lies refused by name.

The device path (pinned staging, copies on a side stream) is tests/gpu/test_weights_file_gpu.py.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import torch

import compiler
from compiler.errors import PackageCorruptError
from compiler.package.check import checked_manifest
from compiler.package.digest import content_hash
from compiler.package.manifest import WEIGHTS, FileRecord, Manifest
from compiler.package.weights_file import parse_header, read_weights

ROOT = Path(__file__).resolve().parents[3]
FORMAT1 = ROOT / "tests" / "fixtures" / "packages" / "mlp-format1-2026-11.kiln"

TENSORS = {
    "a.weight": torch.randn(3, 5),
    "b.odd": torch.arange(7, dtype=torch.int8),
    "c.half": torch.randn(4, dtype=torch.float16),
    "d.scalar": torch.tensor(2.5, dtype=torch.float64),
    "e.empty": torch.zeros(0, 3),
    "f.mask": torch.tensor([True, False, True]),
    "g.bf16": torch.randn(2, 2).bfloat16(),
    "h.long": torch.arange(3, dtype=torch.int64),
}


def _raw(entries: list[tuple[str, str, list[int], bytes]], *, edit=None, trailing: bytes = b"") -> bytes:
    """A safetensors file written by hand, tensors in the order given (so a 2-byte tensor may follow a
    7-byte one), with ``edit`` applied to its header."""
    header, data = {}, b""
    for name, dtype, shape, payload in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(payload)]}
        data += payload
    if edit is not None:
        edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data + trailing


def _misaligned() -> tuple[bytes, dict[str, torch.Tensor]]:
    odd = torch.arange(7, dtype=torch.int8)
    half = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float16)
    floats = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    raw = _raw(
        [
            ("odd", "I8", [7], odd.numpy().tobytes()),
            ("half", "F16", [3], half.numpy().tobytes()),
            ("floats", "F32", [2, 2], floats.numpy().tobytes()),
        ]
    )
    return raw, {"odd": odd, "half": half, "floats": floats}


@pytest.fixture(scope="module")
def base_manifest() -> Manifest:
    return checked_manifest(FORMAT1, verify=False)


def _package(directory: Path, data: bytes, base: Manifest, listed: bytes | None = None) -> Manifest:
    """``data`` as the weights file of a package in ``directory`` whose manifest lists ``listed``'s
    checksum (by default ``data``'s own)."""
    directory.mkdir(exist_ok=True)
    (directory / WEIGHTS).write_bytes(data)
    listed = data if listed is None else listed
    return dataclasses.replace(
        base, files={WEIGHTS: FileRecord(hashlib.sha256(listed).hexdigest(), len(listed))}
    )


@pytest.mark.parametrize("chunk_bytes", [5, 64, 16 << 20])
def test_the_tensors_equal_safetensors_own_reading(tmp_path, base_manifest, chunk_bytes):
    data = safetensors.torch.save(TENSORS)
    manifest = _package(tmp_path, data, base_manifest)
    got = read_weights(tmp_path, WEIGHTS, manifest, torch.device("cpu"), chunk_bytes=chunk_bytes)
    want = safetensors.torch.load(data)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def chunked(data: bytes, chunk_bytes: int) -> FileRecord:
    """``data``'s file record with its chunks' digests, in chunks of ``chunk_bytes``."""
    pieces = range(0, len(data), chunk_bytes)
    digests = tuple(hashlib.sha256(data[i : i + chunk_bytes]).hexdigest() for i in pieces)
    return FileRecord(hashlib.sha256(data).hexdigest(), len(data), chunk_bytes, digests)


BIG = {**TENSORS, "z.big": torch.randn(100, 97)}  # 39 KB: ten 4 KiB chunks, the header in the first


@pytest.mark.parametrize("chunk_bytes, workers", [(4096, 1), (4096, 3), (5000, 4), (1 << 20, 2)])
def test_a_file_listed_in_chunks_is_read_chunk_by_chunk_on_threads(
    tmp_path, base_manifest, chunk_bytes, workers
):
    data = safetensors.torch.save(BIG)
    _package(tmp_path, data, base_manifest)
    manifest = dataclasses.replace(base_manifest, files={WEIGHTS: chunked(data, chunk_bytes)})
    got = read_weights(tmp_path, WEIGHTS, manifest, torch.device("cpu"), workers=workers)
    for name, tensor in safetensors.torch.load(data).items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_a_chunk_that_differs_is_refused_whatever_the_files_own_sha256_says(tmp_path, base_manifest):
    data = safetensors.torch.save(BIG)
    middle = bytearray(data)
    middle[len(data) // 2] ^= 1
    cases = {
        "a byte of a middle chunk": (bytes(middle), chunked(data, 4096)),
        "one byte more": (data + b"\0", chunked(data, 4096)),
        "one byte less": (data[:-1], chunked(data, 4096)),
        # The file's sha256 made to agree with the changed bytes, its chunks left as they were: the load
        # checks the chunks (and read_manifest as well, below).
        "chunks left stale": (
            bytes(middle),
            dataclasses.replace(chunked(data, 4096), sha256=hashlib.sha256(middle).hexdigest()),
        ),
    }
    for written, record in cases.values():
        _package(tmp_path, written, base_manifest)
        manifest = dataclasses.replace(base_manifest, files={WEIGHTS: record})
        for workers in (1, 3):
            with pytest.raises(PackageCorruptError, match="does not match its checksum"):
                read_weights(tmp_path, WEIGHTS, manifest, torch.device("cpu"), workers=workers)


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda r: r.update(chunk_bytes=1), "chunk size 1 outside"),
        (lambda r: r.update(chunk_bytes=None), "chunk size None outside"),
        (lambda r: r["chunks"].pop(), "9 chunk digests for"),
        (lambda r: r["chunks"].append(r["chunks"][0]), "11 chunk digests for"),
        (lambda r: r["chunks"].__setitem__(3, "../" + "0" * 61), "not a sha256"),
        (lambda r: r.update(chunk_bytes=2**40), "outside"),
    ],
)
def test_a_malformed_chunk_list_is_refused_when_the_manifest_is_read(base_manifest, edit, message):
    data = safetensors.torch.save(BIG)
    record = chunked(data, 4096).to_json()
    assert FileRecord.from_json(record) == chunked(data, 4096)  # the round trip itself
    edit(record)
    with pytest.raises(PackageCorruptError, match=message):
        FileRecord.from_json(record)


def test_a_saved_package_lists_its_weights_chunks_and_every_reader_checks_them(tmp_path, reseal):
    """A package whose weights file is over one chunk (4 MiB): saved with its chunks' digests, loaded
    through them in a fresh process; a change in one chunk, with the file's own sha256 recomputed, is
    refused by read_manifest and by the load alike."""
    import subprocess
    import sys

    from compiler.package.check import read_manifest

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1536), torch.nn.ReLU(), torch.nn.Linear(1536, 8)).eval()
    program = compiler.export(model, (torch.randn(2, 1024),))
    path = compiler.save(compiler.compile(program), tmp_path / "wide.kiln").path
    record = read_manifest(path).files[WEIGHTS]
    assert record.bytes > 4 << 20 and record.chunk_bytes == 4 << 20
    assert len(record.chunks) == -(-record.bytes // record.chunk_bytes)
    x = torch.randn(2, 1024)
    torch.save(x, tmp_path / "x.pt")
    code = (
        "import sys, torch, compiler; m = compiler.load(sys.argv[1]); "
        "torch.save(m(torch.load(sys.argv[2])), sys.argv[3])"
    )
    subprocess.run(
        [sys.executable, "-c", code, str(path), str(tmp_path / "x.pt"), str(tmp_path / "y.pt")], check=True
    )
    with torch.no_grad():
        assert torch.allclose(torch.load(tmp_path / "y.pt"), model(x), rtol=1e-4, atol=1e-5)
    blob = bytearray((path / WEIGHTS).read_bytes())
    blob[-100] ^= 1  # a weight of the last chunk
    (path / WEIGHTS).write_bytes(bytes(blob))
    reseal(path, **{WEIGHTS: (len(blob), hashlib.sha256(blob).hexdigest())})  # chunks left as they were
    with pytest.raises(PackageCorruptError, match=f"{WEIGHTS} does not match its checksum"):
        read_manifest(path)
    with pytest.raises(PackageCorruptError, match=f"{WEIGHTS} does not match its checksum"):
        compiler.load(path)


def test_a_tensor_after_an_odd_sized_one_is_still_aligned(tmp_path, base_manifest):
    raw, want = _misaligned()
    manifest = _package(tmp_path, raw, base_manifest)
    got = read_weights(tmp_path, WEIGHTS, manifest, torch.device("cpu"))
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name
        assert got[name].data_ptr() % 16 == 0, name


@pytest.mark.parametrize(
    "change, message",
    [
        ("flip", "does not match its checksum"),
        ("append", "does not match its checksum"),
        ("truncate", "does not match its checksum"),
    ],
)
def test_bytes_that_differ_from_the_listed_ones_are_refused(tmp_path, base_manifest, change, message):
    data = safetensors.torch.save(TENSORS)
    changed = {
        "flip": data[:-3] + bytes([data[-3] ^ 1]) + data[-2:],
        "append": data + b"\0",
        "truncate": data[:-1],
    }[change]
    manifest = _package(tmp_path, changed, base_manifest, listed=data)
    with pytest.raises(PackageCorruptError, match=message):
        read_weights(tmp_path, WEIGHTS, manifest, torch.device("cpu"), chunk_bytes=64)


def test_a_symlink_or_a_fifo_in_its_place_is_refused(tmp_path, base_manifest):
    data = safetensors.torch.save(TENSORS)
    manifest = _package(tmp_path / "real", data, base_manifest)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / WEIGHTS).symlink_to(tmp_path / "real" / WEIGHTS)
    with pytest.raises(PackageCorruptError, match="not a plain file"):
        read_weights(linked, WEIGHTS, manifest, torch.device("cpu"))
    piped = tmp_path / "piped"
    piped.mkdir()
    os.mkfifo(piped / WEIGHTS)  # opened without a writer: the read must not wait for one
    with pytest.raises(PackageCorruptError, match="not a plain file"):
        read_weights(piped, WEIGHTS, manifest, torch.device("cpu"))
    with pytest.raises(PackageCorruptError, match="not listed"):
        read_weights(tmp_path / "real", "other.safetensors", manifest, torch.device("cpu"))


def _set(name: str, key: str, value):
    def edit(header: dict) -> None:
        header[name][key] = value

    return edit


LIES = {
    "unknown dtype": (_set("half", "dtype", "F17"), "unknown dtype"),
    "size for shape": (_set("half", "shape", [4]), "bytes for shape"),
    "negative shape": (_set("half", "shape", [-3]), "non-negative integers"),
    "boolean shape": (_set("odd", "shape", [True] * 7), "non-negative integers"),
    "overlap": (_set("half", "data_offsets", [1, 7]), "does not start where"),
    "gap": (_set("floats", "data_offsets", [14, 30]), "does not start where"),
    "short of the end": (lambda h: h.pop("floats"), "its tensors end at byte"),
    "extra key": (_set("odd", "offset", 0), "expected dtype, shape and data_offsets"),
    "metadata": (lambda h: h.update(__metadata__={"n": 1}), "__metadata__"),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_a_header_that_lies_is_refused_by_name(tmp_path, base_manifest, lie):
    edit, message = LIES[lie]
    _, want = _misaligned()
    entries = [
        (n, {"odd": "I8", "half": "F16", "floats": "F32"}[n], list(t.shape), t.numpy().tobytes())
        for n, t in want.items()
    ]
    data = _raw(entries, edit=edit)
    manifest = _package(tmp_path, data, base_manifest)  # listed as it is: only the header lies
    with pytest.raises(
        PackageCorruptError, match=rf"{WEIGHTS} is not a safetensors file kiln reads: .*{message}"
    ):
        read_weights(tmp_path, WEIGHTS, manifest, torch.device("cpu"))


def test_headers_that_are_not_one_are_refused():
    data = b'{"a": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}'
    padded = data + b" " * (-len(data) % 8)
    good = len(padded).to_bytes(8, "little") + padded + b"x"
    assert [e.name for e in parse_header(good, len(good))] == ["a"]
    entry = b'{"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}'
    twice = b'{"a": ' + entry + b', "a": ' + entry + b"}"
    cases = {
        "shorter than": b"\x01\x02",
        "does not fit": (1 << 40).to_bytes(8, "little") + b"{}",
        "not JSON": (4).to_bytes(8, "little") + b"{{{{",
        "not UTF-8": (2).to_bytes(8, "little") + b"\xff\xfe",
        "not a JSON object": (2).to_bytes(8, "little") + b"[]",
        "names a tensor twice": len(twice).to_bytes(8, "little") + twice + b"xx",
    }
    for message, raw in cases.items():
        with pytest.raises(ValueError, match=message):
            parse_header(raw, len(raw))


def test_a_package_whose_weights_header_lies_does_not_load(tmp_path, compiled_zoo):
    """Through compiler.load, as an attacker with write access (no signing key) would try it: the
    weights file rewritten with overlapping tensors and the manifest resealed."""
    _, compiled = compiled_zoo["mlp_with_fallback"]
    path = compiler.save(compiled, tmp_path / "mlp.kiln").path
    loaded = compiler.load(path)
    assert sorted(loaded.weights) == sorted(compiled.weights)
    data = (path / WEIGHTS).read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    first = min((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    header[first]["data_offsets"] = [
        header[first]["data_offsets"][0] + 4,
        header[first]["data_offsets"][1] + 4,
    ]
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    (path / WEIGHTS).write_bytes(len(text).to_bytes(8, "little") + text + data[8 + length :])
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"][WEIGHTS] = {
        "sha256": hashlib.sha256((path / WEIGHTS).read_bytes()).hexdigest(),
        "bytes": (path / WEIGHTS).stat().st_size,
    }
    manifest["content_hash"] = content_hash(manifest)
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PackageCorruptError, match=rf"{WEIGHTS} is not a safetensors file kiln reads"):
        compiler.load(path)
    shutil.rmtree(path)
