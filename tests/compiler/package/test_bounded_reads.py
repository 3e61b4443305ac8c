"""Bounded by construction (issue 42): with a verification key set nothing of an unsigned or foreign-
signed package is opened beyond its manifest and model.sig; JSON nested past the reader's bound, and
a weights header whose shape does not fit torch's sizes, are typed refusals, never RecursionError or
TypeError."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

import compiler
from compiler.errors import (
    PackageCorruptError,
    PackageJsonError,
    PackageSignatureError,
    RuntimeGraphBoundError,
)
from compiler.package.signing import Signer, sign_package

ROOT = Path(__file__).resolve().parents[3]
FORMAT1 = ROOT / "tests" / "fixtures" / "packages" / "mlp-format1-2026-11.kiln"
PUBLIC = "KILN_SIGNING_PUBLIC_KEY"
WEIGHTS = "weights.safetensors"

# Paths opened while _OPENED is being filled (an audit hook cannot be removed: it records only then).
_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], str | bytes | os.PathLike):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def _opened_in(package: Path, call) -> set[str]:
    """The package's files ``call()`` opened (by name inside it), whatever it raised."""
    global _OPENED
    _OPENED = []
    try:
        with pytest.raises(PackageCorruptError) as refusal:
            call()
    finally:
        opened, _OPENED = _OPENED, None
    root = str(package.resolve())
    names = {os.path.relpath(os.path.realpath(p), root) for p in opened}
    return refusal.value, {n for n in names if not n.startswith("..")}


@pytest.fixture(scope="module")
def unsigned(tmp_path_factory) -> Path:
    """A small format-2 package, saved without a key (never changed by tests)."""
    module = compiler.load(FORMAT1, allowed_modules=["zoo"])
    return compiler.save(module, tmp_path_factory.mktemp("bounded") / "m.kiln").path


def test_an_unsigned_package_is_refused_having_opened_only_its_manifest(
    unsigned, keys, tmp_path, monkeypatch, copy_package, reseal
):
    """A 3 GiB sparse weights file, listed at its size: with a key set it is never opened (it once was
    read whole, and allocated, before the refusal), nor is any other file beside the manifest."""
    huge = copy_package(unsigned, tmp_path / "huge.kiln")
    size = 3 * 2**30
    os.truncate(huge / WEIGHTS, size)  # sparse: no disk, but a read would read 3 GiB of zeros
    reseal(huge, **{WEIGHTS: (size, "0" * 64)})
    monkeypatch.setenv(PUBLIC, str(keys["release"].public))
    for call in (lambda: compiler.load(huge), lambda: compiler.read_manifest(huge)):
        refusal, opened = _opened_in(huge, call)
        assert isinstance(refusal, PackageSignatureError) and "is not signed" in str(refusal)
        assert opened <= {"manifest.json"}, opened

    # Signed, but by another key: only model.sig is read besides the manifest.
    foreign = copy_package(unsigned, tmp_path / "foreign.kiln")
    sign_package(foreign, Signer(keys["other"].private))
    refusal, opened = _opened_in(foreign, lambda: compiler.load(foreign))
    assert isinstance(refusal, PackageSignatureError) and "does not verify" in str(refusal)
    assert opened <= {"manifest.json", "model.sig"} and "model.sig" in opened, opened


def test_the_audit_hook_sees_a_load_open_the_package_files(unsigned):
    """The positive control: without a key, the same load opens the weights and the runtime graph."""
    global _OPENED
    _OPENED = []
    try:
        compiler.load(unsigned)
    finally:
        opened, _OPENED = _OPENED, None
    names = {os.path.basename(p) for p in opened if str(unsigned.resolve()) in os.path.realpath(p)}
    assert {WEIGHTS, "manifest.json", "program.pt2"} <= names, names


def test_a_deeply_nested_manifest_is_a_typed_refusal_after_the_signature(
    unsigned, keys, tmp_path, monkeypatch, copy_package
):
    deep = copy_package(unsigned, tmp_path / "deep.kiln")
    (deep / "manifest.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(PackageJsonError, match="100000 levels deep, more than the 64"):
        compiler.read_manifest(deep)
    monkeypatch.setenv(PUBLIC, str(keys["release"].public))
    with pytest.raises(PackageSignatureError, match="is not signed"):  # the refusal a key promises, first
        compiler.read_manifest(deep)


def test_a_deeply_nested_weights_header_is_a_typed_refusal(unsigned, tmp_path, copy_package, reseal):
    deep = copy_package(unsigned, tmp_path / "deep-weights.kiln")
    header = b"[" * 100_000 + b"]" * 100_000
    (deep / WEIGHTS).write_bytes(len(header).to_bytes(8, "little") + header)
    reseal(deep)
    with pytest.raises(PackageCorruptError, match="levels deep"):
        compiler.load(deep)


def test_a_zero_size_tensor_with_a_dimension_beyond_int64_is_refused(
    unsigned, tmp_path, copy_package, reseal
):
    """``[0, 2**63]`` holds no bytes, so the byte count agrees; torch cannot make the shape (TypeError)."""
    odd = copy_package(unsigned, tmp_path / "odd.kiln")
    raw = (odd / WEIGHTS).read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + length])
    end = max(info["data_offsets"][1] for name, info in header.items() if name != "__metadata__")
    header["zero"] = {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [end, end]}
    text = json.dumps(header).encode()
    (odd / WEIGHTS).write_bytes(len(text).to_bytes(8, "little") + text + raw[8 + length :])
    reseal(odd)
    with pytest.raises(PackageCorruptError, match=r"does not fit torch's 64-bit sizes"):
        compiler.load(odd)


def _with_nodes_before_output(path: Path, nodes: list[dict], reseal) -> None:
    """Add call nodes to the package's runtime graph just before its output (fx runs every node)."""
    graph = json.loads((path / "runtime_graph.json").read_text())
    entries = graph["graph"]["nodes"]
    output = entries.pop()
    entries.extend(nodes)
    entries.append(output)
    (path / "runtime_graph.json").write_text(json.dumps(graph, sort_keys=True, separators=(",", ":")))
    reseal(path)


def test_unbounded_integer_arithmetic_in_a_runtime_graph_is_refused_before_it_runs(
    unsigned, tmp_path, copy_package, reseal
):
    """``operator.pow(7, 10**8)`` then squarings passed every check and the first call never finished:
    the graph's integer operators now take and give integers within +-2**63, or refuse typed."""
    bomb = copy_package(unsigned, tmp_path / "bomb.kiln")
    graph = json.loads((bomb / "runtime_graph.json").read_text())
    first = len(graph["graph"]["nodes"]) - 1  # the first added node's index (the output moves after it)
    call = {"op": "call_function", "kwargs": {}}
    _with_nodes_before_output(
        bomb,
        [{**call, "name": "p0", "target": "operator.pow", "args": {"tuple": [7, 10**8]}}]
        + [
            {
                **call,
                "name": f"p{i}",
                "target": "operator.mul",
                "args": {"tuple": [{"node": first + i - 1}] * 2},
            }
            for i in range(1, 6)
        ],
        reseal,
    )
    x = torch.randn(4, 64)
    with pytest.raises(RuntimeGraphBoundError, match=r"operator\.pow\(7, 100000000\)"):
        compiler.load(bomb)(x)

    # The same arithmetic within the bound runs, and the model answers as before.
    fine = copy_package(unsigned, tmp_path / "fine.kiln")
    _with_nodes_before_output(
        fine,
        [
            {**call, "name": "p0", "target": "operator.pow", "args": {"tuple": [2, 62]}},
            {**call, "name": "p1", "target": "operator.floordiv", "args": {"tuple": [{"node": first}, 3]}},
        ],
        reseal,
    )
    torch.testing.assert_close(compiler.load(fine)(x), compiler.load(unsigned)(x))


def test_the_bounded_operators_compute_as_operator_does_within_the_bound():
    from compiler.partitioning.runtime_ops import PYTHON_OPERATORS

    pow_, mul, floordiv = (PYTHON_OPERATORS[f"operator.{n}"] for n in ("pow", "mul", "floordiv"))
    assert (pow_(2, 63), mul(-(2**31), 2**32), floordiv(7, 2), pow_(1, 10**9)) == (2**63, -(2**63), 3, 1)
    for refused in (lambda: pow_(2, 64), lambda: mul(2**62, 4), lambda: floordiv(1, 0)):
        with pytest.raises(RuntimeGraphBoundError):
            refused()
    t = torch.tensor([3.0])
    assert mul(t, 2).item() == 6.0  # tensors pass through to torch


@pytest.mark.parametrize("dtype", [["F32"], {"F32": 1}], ids=["list", "object"])
def test_a_weights_dtype_that_is_no_string_is_a_typed_refusal(dtype):
    """Found by the format fuzzer's weights-header mutations: an unhashable dtype was a TypeError."""
    from compiler.package.weights_file import parse_header

    text = json.dumps({"w": {"dtype": dtype, "shape": [1], "data_offsets": [0, 4]}}).encode()
    raw = len(text).to_bytes(8, "little") + text + b"\0" * 4
    with pytest.raises(ValueError, match="unknown dtype"):
        parse_header(raw, len(raw))
