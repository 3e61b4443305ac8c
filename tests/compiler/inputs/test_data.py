"""Validation on the user's recorded inputs: safetensors / npz files, skipped samples, typed errors."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import compiler
from compiler.errors import ValidationDataError
from compiler.inputs.data import validation_data
from compiler.inputs.specs import InputSpec

SPECS = (
    InputSpec("input_ids", "int64", (1, 2), (2, 8), (4, 16), {0: "batch", 1: "seq"}, (0, 99)),
    InputSpec("mask", "float32", (1, 2), (2, 8), (4, 16), {0: "batch", 1: "seq"}),
)


def _arrays(samples: int = 3, batch: int = 2, seq: int = 8) -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.randint(0, 100, (samples, batch, seq)),
        "mask": torch.ones(samples, batch, seq),
    }


def test_a_safetensors_file_gives_one_sample_per_leading_index_and_names_its_digest(tmp_path):
    path = tmp_path / "data.safetensors"
    save_file(_arrays(), str(path))
    data = validation_data(SPECS, path)
    assert len(data) == 3 and [tuple(t.shape) for t in data.samples[0]] == [(2, 8), (2, 8)]
    assert data.source == f"{path} sha256:{hashlib.sha256(path.read_bytes()).hexdigest()}"
    assert data.digest == hashlib.sha256(path.read_bytes()).hexdigest() and data.skipped == ()


def test_npz_and_mappings_read_the_same(tmp_path):
    arrays = _arrays()
    np.savez(tmp_path / "data.npz", **{k: v.numpy() for k, v in arrays.items()})
    from_npz = validation_data(SPECS, tmp_path / "data.npz")
    from_mapping = validation_data(SPECS, arrays)
    assert from_mapping.source.startswith("<mapping> sha256:")
    assert all(torch.equal(a, b) for a, b in zip(from_npz.samples[1], from_mapping.samples[1], strict=True))


def test_groups_outside_the_compiled_ranges_are_skipped_and_reported_never_clipped():
    arrays = {f"short/{k}": v for k, v in _arrays(samples=3).items()}
    arrays |= {f"long/{k}": v for k, v in _arrays(samples=2, seq=32).items()}  # seq 32 > max 16
    data = validation_data(SPECS, arrays)
    assert len(data) == 3 and all(t.shape == (2, 8) for sample in data.samples for t in sample)
    [skipped] = data.skipped
    assert skipped.startswith("group 'long' (2 samples): input 'input_ids': shape (2, 32) is outside")


def test_every_sample_outside_the_ranges_is_an_error_naming_the_reason():
    with pytest.raises(ValidationDataError, match=r"<mapping>: none of its samples .*\(3 samples\).*outside"):
        validation_data(SPECS, _arrays(seq=32))


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        ({**_arrays(), "extra": torch.ones(3, 2)}, r"field\(s\) \['extra'\] name no model input"),
        ({"input_ids": _arrays()["input_ids"]}, r"no field for model input\(s\) \['mask'\]"),
        (
            {**_arrays(), "input_ids": torch.zeros(3, 2, 8, dtype=torch.int32)},
            "'input_ids' has dtype int32; .* int64",
        ),
        ({**_arrays(), "mask": torch.ones(2, 8)}, "'mask' has rank 2 .* leading sample axis"),
        ({**_arrays(), "mask": torch.ones(2, 2, 8)}, "disagree on the number of samples"),
        (_arrays(samples=0), "the file holds no samples"),
        ({"g/input_ids": _arrays()["input_ids"]}, r"no field for model input\(s\) \['g/mask'\]"),
    ],
)
def test_bad_data_is_a_typed_error_naming_the_field(arrays, match):
    with pytest.raises(ValidationDataError, match=match):
        validation_data(SPECS, arrays)


def test_nan_in_recorded_inputs_is_refused_with_the_file_and_field(tmp_path):
    arrays = _arrays()
    arrays["mask"][1, 0, 3] = float("nan")
    path = tmp_path / "nan.safetensors"
    save_file(arrays, str(path))
    with pytest.raises(ValidationDataError, match=rf"{path}: field 'mask' holds NaN \(sample 1"):
        validation_data(SPECS, path)


def test_missing_unreadable_and_empty_files_are_typed_errors(tmp_path):
    with pytest.raises(ValidationDataError, match="not found"):
        validation_data(SPECS, tmp_path / "absent.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ValidationDataError, match=r"junk\.safetensors: cannot read"):
        validation_data(SPECS, tmp_path / "junk.safetensors")
    (tmp_path / "data.csv").write_text("1,2")
    with pytest.raises(ValidationDataError, match=r"data.csv: validation data must be one of"):
        validation_data(SPECS, tmp_path / "data.csv")
    np.savez(tmp_path / "empty.npz")
    with pytest.raises(ValidationDataError, match=r"empty\.npz: the file holds no arrays"):
        validation_data(SPECS, tmp_path / "empty.npz")
    np.savez(tmp_path / "objects.npz", input_ids=np.array([{"a": 1}], dtype=object))
    with pytest.raises(ValidationDataError, match=r"objects\.npz: cannot read"):
        validation_data(SPECS, tmp_path / "objects.npz")


def test_validate_on_recorded_data_reports_what_it_used_and_skipped(tmp_path):
    from zoo.models import mlp_with_fallback

    case = mlp_with_fallback()
    program = compiler.export(case.model, case.args, dynamic_shapes=case.dynamic_shapes)
    compiled = compiler.compile(program, cache=tmp_path)
    [spec] = compiled.input_specs
    path = tmp_path / "recorded.safetensors"
    inside = torch.randn(5, 3, 64)
    save_file({spec.name: inside}, str(path))
    report = compiler.validate(case.model, compiled, data=path, warmup=0, runs=1)
    assert report.data_source.startswith(f"{path} sha256:") and report.samples == 5
    assert report.shapes == [[[3, 64]]] * 5 and report.failures(compiler.Tolerances(rel_l2=1e-4)) == []
    too_big = {spec.name: torch.randn(2, 64, 64)}  # batch 64 > max 32
    with pytest.raises(ValidationDataError, match="batch"):
        compiler.validate(case.model, compiled, data=too_big, warmup=0, runs=1)


def _npz_claiming(path, shape: tuple[int, ...]) -> None:
    """An npz whose one member's npy header claims ``shape`` (float32) but holds 16 bytes: a bomb's
    header, without writing gigabytes."""
    import io
    import zipfile

    from numpy.lib import format as npy

    header = io.BytesIO()
    npy.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": shape})
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("mask.npy", header.getvalue() + bytes(16))


def test_data_that_expands_past_the_bound_is_refused_before_decompressing(tmp_path, monkeypatch):
    # An npy header claiming 4 GiB (the default bound is 1 GiB): refused from the header alone.
    claims = tmp_path / "claims.npz"
    _npz_claiming(claims, (1 << 30,))
    with pytest.raises(ValidationDataError, match=r"claims\.npz: its arrays take 4096\.0 MiB.*KILN_DATA_MAX"):
        validation_data(SPECS, claims)
    # A real deflate bomb: 32 MiB of zeros in a ~32 KB archive, over a bound of 8 MiB (the zip headers).
    bomb = tmp_path / "bomb.npz"
    np.savez_compressed(
        bomb, input_ids=np.zeros((1 << 22, 1, 1), np.int64), mask=np.zeros((1, 1, 1), np.float32)
    )
    assert bomb.stat().st_size < 1 << 20
    monkeypatch.setenv("KILN_DATA_MAX_BYTES", "8M")
    with pytest.raises(ValidationDataError, match=r"bomb\.npz: its arrays take 32\.0 MiB.*over the 8\.0 MiB"):
        validation_data(SPECS, bomb)
    # safetensors: the header's shapes count too.
    path = tmp_path / "big.safetensors"
    save_file({"input_ids": torch.zeros(1 << 21, 1, 1, dtype=torch.int64)}, str(path))
    with pytest.raises(ValidationDataError, match=r"big\.safetensors: its arrays take 16\.0 MiB"):
        validation_data(SPECS, path)
    monkeypatch.setenv("KILN_DATA_MAX_BYTES", "a lot")
    with pytest.raises(ValidationDataError, match="KILN_DATA_MAX_BYTES='a lot' is not a positive size"):
        validation_data(SPECS, bomb)


def test_special_files_are_refused_never_read(tmp_path):
    import os
    import signal

    fifo = tmp_path / "fifo.npz"
    os.mkfifo(fifo)
    zero = tmp_path / "zero.safetensors"
    zero.symlink_to("/dev/zero")

    def hung(signum, frame):
        raise TimeoutError("reading a special file blocked")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)  # before the check, opening the FIFO blocked forever
    try:
        with pytest.raises(ValidationDataError, match=r"fifo\.npz' is a FIFO"):
            validation_data(SPECS, fifo)
        with pytest.raises(ValidationDataError, match=r"zero\.safetensors' is a character device"):
            validation_data(SPECS, zero)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_fields_the_model_does_not_take_are_named_with_the_option_that_leaves_them_out():
    """A BERT tokenizer's output recorded for a model compiled without token_type_ids: refused, never
    silently ignored; listed in ``ignore_fields``, those fields are left out (every group's)."""
    arrays = {**_arrays(), "token_type_ids": torch.zeros(3, 2, 8, dtype=torch.int64)}
    with pytest.raises(
        ValidationDataError,
        match=r"field\(s\) \['token_type_ids'\] name no model input; .* or list them in "
        r"validation\.ignore_fields: \['token_type_ids'\]",
    ):
        validation_data(SPECS, arrays, ignore_option="validation.ignore_fields")
    kept = validation_data(SPECS, arrays, ignore_fields=["token_type_ids"])
    assert len(kept) == 3 and torch.equal(kept.samples[0][0], arrays["input_ids"][0])
    grouped = {f"{group}/{k}": v for group in ("a", "b") for k, v in arrays.items()}
    assert len(validation_data(SPECS, grouped, ignore_fields=["token_type_ids"])) == 6

    # An ignore list must mean something: a field the data lacks, or one the model needs, is named.
    with pytest.raises(
        ValidationDataError, match=r"ignore_fields lists \['typo'\], which the data does not hold"
    ):
        validation_data(SPECS, arrays, ignore_fields=["token_type_ids", "typo"])
    with pytest.raises(ValidationDataError, match=r"ignore_fields lists model input\(s\) \['mask'\]"):
        validation_data(SPECS, arrays, ignore_fields=["token_type_ids", "mask"])
