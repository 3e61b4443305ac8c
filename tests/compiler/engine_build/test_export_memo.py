"""One ONNX export per partition structure and process (compiler.engine_build.export_memo): quantizing,
the layer search and repair lower an int8 partition in fp32 again and again; what they get must be
byte for byte what a fresh export gives, with each plan's own weights. With ``$KILN_EXPORT_CACHE`` the
graphs are kept on disk for other processes: whole files only, a private folder only."""

import hashlib
import os

import onnx
import pytest

import compiler
from compiler.cache.paths import EXPORT_CACHE_ENV
from compiler.engine_build import export_memo
from compiler.engine_build.lower import lower_float
from compiler.errors import CacheError
from zoo.models import mlp_with_fallback


def _plan(seed: int):
    case = mlp_with_fallback(seed=seed)
    program = compiler.export(case.model, case.args, dynamic_shapes=case.dynamic_shapes)
    plan = compiler.partition(program)
    return plan, plan.partitions[0]


@pytest.fixture(autouse=True)
def _fresh_memo(monkeypatch):
    monkeypatch.delenv(EXPORT_CACHE_ENV, raising=False)  # the suite's shared folder: this process only
    export_memo.clear()
    yield
    export_memo.clear()


def test_a_kept_export_gives_the_bytes_of_a_fresh_one_with_each_plans_own_weights():
    plan, part = _plan(seed=0)
    first = lower_float(plan, part, "fp32").onnx
    again = lower_float(plan, part, "fp32").onnx
    kept = list(export_memo._graphs)
    assert again == first and len(kept) == 1
    export_memo.clear()
    assert lower_float(plan, part, "fp32").onnx == first  # the kept copy is what exporting gives

    # Same structure, other weights: the same kept graph, this plan's own initializers in it.
    other, other_part = _plan(seed=1)
    shared = lower_float(other, other_part, "fp32").onnx
    assert list(export_memo._graphs) == kept and shared != first
    export_memo.clear()
    assert lower_float(other, other_part, "fp32").onnx == shared


def test_another_precision_is_another_export():
    plan, part = _plan(seed=0)
    lower_float(plan, part, "fp32")
    half = onnx.load_from_string(lower_float(plan, part, "fp16").onnx)
    assert len(export_memo._graphs) == 2
    weights = [i for i in half.graph.initializer if i.name.startswith("w")]
    assert weights and all(i.data_type == onnx.TensorProto.FLOAT16 for i in weights)


def _counting(export):
    calls = []

    def counted():
        calls.append(1)
        return export()

    return counted, calls


def test_a_graph_kept_on_disk_serves_another_process_and_a_damaged_one_is_exported_again(
    tmp_path, monkeypatch
):
    plan, part = _plan(seed=0)
    fresh = lower_float(plan, part, "fp32").onnx  # no folder: this process only
    [(key, blob)] = export_memo._graphs.items()
    export_memo.clear()
    monkeypatch.setenv(EXPORT_CACHE_ENV, str(tmp_path / "exports"))

    export, calls = _counting(lambda: onnx.load_from_string(blob))
    assert export_memo.exported(key, export).SerializeToString() == blob and len(calls) == 1
    [kept] = (tmp_path / "exports").iterdir()
    assert (tmp_path / "exports").stat().st_mode & 0o077 == 0  # private, as the engine cache
    export_memo.clear()  # what another process starts with
    assert export_memo.exported(key, export).SerializeToString() == blob and len(calls) == 1
    export_memo.clear()
    assert lower_float(plan, part, "fp32").onnx == fresh  # read back from disk, byte for byte

    # A byte flipped in the graph (or a torn file): exported again, the file replaced by a whole one.
    data = bytearray(kept.read_bytes())
    data[-10] ^= 0xFF
    kept.write_bytes(bytes(data))
    export_memo.clear()
    assert export_memo.exported(key, export).SerializeToString() == blob and len(calls) == 2
    export_memo.clear()
    assert export_memo.exported(key, export).SerializeToString() == blob and len(calls) == 2

    # A link in its place (to a FIFO, which would block a plain read): not followed, replaced.
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    kept.unlink()
    kept.symlink_to(fifo)
    export_memo.clear()
    assert export_memo.exported(key, export).SerializeToString() == blob and len(calls) == 3
    assert kept.is_file() and not kept.is_symlink() and fifo.exists()


def test_the_disk_key_holds_kiln_code_so_an_edit_is_a_new_export(tmp_path, monkeypatch):
    code = export_memo.code_version()
    assert len(code) == 64 and code == export_memo.code_version()
    assert export_memo.disk_name("k", code) != export_memo.disk_name("k", code[::-1])
    assert export_memo.disk_name("k", code) != export_memo.disk_name("j", code)
    monkeypatch.setenv(EXPORT_CACHE_ENV, str(tmp_path))
    assert export_memo._disk_path("k") == tmp_path / export_memo.disk_name("k", code)


def test_a_folder_others_can_write_is_refused_by_name(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv(EXPORT_CACHE_ENV, str(shared))
    plan, part = _plan(seed=0)
    with pytest.raises(CacheError, match=f"export cache directory {shared} .*writable by others"):
        lower_float(plan, part, "fp32")
    assert not any(shared.iterdir())
    # A file where the folder should be: named, not a warning per export.
    monkeypatch.setenv(EXPORT_CACHE_ENV, str(tmp_path / "a-file" / "exports"))
    (tmp_path / "a-file").write_text("not a folder")
    export_memo.clear()
    with pytest.raises(CacheError, match=r"is under .*a-file, which is a file"):
        lower_float(plan, part, "fp32")


def test_a_kept_file_rewritten_with_its_hash_recomputed_is_exported_again(tmp_path, monkeypatch):
    """Garbage, or another partition's graph, with the sha256 in the file made to match: not a graph of
    this partition (it does not decode, or names other inputs), so exported again and replaced."""
    monkeypatch.setenv(EXPORT_CACHE_ENV, str(tmp_path / "exports"))
    plan, part = _plan(seed=0)
    fresh = lower_float(plan, part, "fp32").onnx
    [kept] = (tmp_path / "exports").iterdir()
    other = onnx.helper.make_model(
        onnx.helper.make_graph(
            [onnx.helper.make_node("Identity", ["a"], ["b"])],
            "other",
            [onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [1])],
            [onnx.helper.make_tensor_value_info("b", onnx.TensorProto.FLOAT, [1])],
        )
    ).SerializeToString()
    for body in (b"\x08\xff\xff not a protobuf" * 8, other):
        kept.write_bytes(export_memo._MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
        export_memo.clear()
        assert lower_float(plan, part, "fp32").onnx == fresh
        assert export_memo._read_kept(kept) not in (None, body)  # replaced by the partition's graph
    # The partition's own graph, with its inputs and outputs: used as it is, not written again.
    before = kept.stat().st_mtime_ns, kept.stat().st_ino
    export_memo.clear()
    assert lower_float(plan, part, "fp32").onnx == fresh
    assert (kept.stat().st_mtime_ns, kept.stat().st_ino) == before
