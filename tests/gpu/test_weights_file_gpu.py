"""The package's weights file read straight to the GPU (compiler.package.weights_file): chunks hashed
and copied behind the hash on a side stream give the tensors safetensors' own reader gives, wherever a
chunk boundary falls (the header's included), and nothing of a file that differs is used.

    python3 -m pytest -q tests/gpu/test_weights_file_gpu.py
"""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import safetensors.torch
import torch

from compiler.errors import PackageCorruptError
from compiler.package.check import checked_manifest
from compiler.package.manifest import WEIGHTS, FileRecord
from compiler.package.weights_file import read_weights
from tests.compiler.package.test_weights_file import BIG, FORMAT1, TENSORS, chunked

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]


def _manifest(data: bytes):
    record = FileRecord(hashlib.sha256(data).hexdigest(), len(data))
    return dataclasses.replace(checked_manifest(FORMAT1, verify=False), files={WEIGHTS: record})


@pytest.mark.parametrize("chunk_bytes", [3, 8, 64, 1000, 16 << 20])
def test_the_tensors_on_the_gpu_equal_safetensors_own_reading(tmp_path, chunk_bytes):
    big = {"z.big": torch.randn(1000, 257)} if chunk_bytes >= 64 else {}  # 1 MB in 3-byte chunks: 23 s
    tensors = {**TENSORS, **big}
    data = safetensors.torch.save(tensors)
    (tmp_path / WEIGHTS).write_bytes(data)
    got = read_weights(tmp_path, WEIGHTS, _manifest(data), torch.device("cuda"), chunk_bytes=chunk_bytes)
    for name, want in safetensors.torch.load(data).items():
        assert got[name].device.type == "cuda", name
        assert got[name].numel() == 0 or got[name].data_ptr() % 16 == 0, name
        assert torch.equal(got[name].cpu(), want), name


def test_a_changed_byte_on_the_way_to_the_gpu_is_refused(tmp_path):
    data = safetensors.torch.save(TENSORS)
    changed = bytearray(data)
    changed[-5] ^= 0x40
    (tmp_path / WEIGHTS).write_bytes(bytes(changed))
    with pytest.raises(PackageCorruptError, match="does not match its checksum"):
        read_weights(tmp_path, WEIGHTS, _manifest(data), torch.device("cuda"), chunk_bytes=16)


@pytest.mark.parametrize("chunk_bytes, workers", [(4096, 1), (4096, 3), (5000, 8), (64, 2)])
def test_a_file_listed_in_chunks_reaches_the_gpu_chunk_by_chunk(tmp_path, chunk_bytes, workers):
    """Chunk digests: each worker reads, checks and copies chunks of its own through its staging buffers
    and stream; the header is read back from the device."""
    data = safetensors.torch.save(BIG)
    (tmp_path / WEIGHTS).write_bytes(data)
    manifest = dataclasses.replace(_manifest(data), files={WEIGHTS: chunked(data, chunk_bytes)})
    got = read_weights(tmp_path, WEIGHTS, manifest, torch.device("cuda"), workers=workers)
    for name, want in safetensors.torch.load(data).items():
        assert got[name].device.type == "cuda", name
        assert torch.equal(got[name].cpu(), want), name
    changed = bytearray(data)
    changed[len(data) // 2] ^= 0x40
    (tmp_path / WEIGHTS).write_bytes(bytes(changed))
    with pytest.raises(PackageCorruptError, match="does not match its checksum"):
        read_weights(tmp_path, WEIGHTS, manifest, torch.device("cuda"), workers=workers)
