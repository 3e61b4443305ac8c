"""Validation on a Hugging Face datasets folder, run through the model's own tokenizer."""

from __future__ import annotations

import pytest

pytest.importorskip("datasets")

import datasets
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import compiler
from compiler.errors import ValidationDataError
from compiler.inputs.hf_data import dataset_data

WORDS = ["the", "a", "cat", "dog", "sat", "on", "mat", "ran", "fast", "slow", "big", "small"]
# The compiled BERT takes 4..64 tokens: row 3 is too long, row 4 too short.
TEXTS = ["the cat sat on the mat", "a dog ran fast", "the big cat sat", " ".join(["dog"] * 80), "a small mat"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(WORDS)}}
    model = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    model.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=model, pad_token="[PAD]", unk_token="[UNK]")


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    from zoo.models import tiny_bert

    case = tiny_bert()  # seq 4..64
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    return case, compiler.compile(program, cache=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "reviews"
    datasets.Dataset.from_dict({"text": TEXTS, "label": [0, 1, 0, 1, 0]}).save_to_disk(str(path))
    return path


def test_rows_are_tokenized_by_the_models_tokenizer_and_long_ones_skipped(bert, folder, tokenizer):
    case, compiled = bert
    data = dataset_data(folder, "text", tokenizer, compiled.input_specs)
    assert len(data) == 3 and data.source.startswith(f"{folder}[text] sha256:")
    long, short = data.skipped  # outside the compiled 4..64 tokens: skipped, never truncated or padded
    assert long.startswith("row 3: ") and "shape (1, 80) is outside the spec" in long
    assert short.startswith("row 4: ") and "shape (1, 3)" in short
    report = compiler.validate(case.model, compiled, data=data, warmup=0, runs=1)
    assert report.samples == 3 and report.skipped == [long, short] and report.data_source == data.source
    assert not report.failures(compiler.Tolerances.for_precision("fp32"))
    batched = dataset_data(folder, "text", tokenizer, compiled.input_specs, batch_size=2, limit=3)
    assert [tuple(s[0].shape) for s in batched.samples] == [
        (2, 6),
        (1, 4),
    ]  # padded within a batch (4 -> min)


def test_a_missing_column_or_folder_is_a_typed_error_naming_them(bert, folder, tokenizer, tmp_path):
    _, compiled = bert
    with pytest.raises(ValidationDataError, match=r"reviews: the dataset has no column 'sentence'; .*'text'"):
        dataset_data(folder, "sentence", tokenizer, compiled.input_specs)
    with pytest.raises(ValidationDataError, match="datasets folder not found"):
        dataset_data(tmp_path / "absent", "text", tokenizer, compiled.input_specs)
    (tmp_path / "not-a-dataset").mkdir()
    with pytest.raises(ValidationDataError, match="not a readable datasets folder"):
        dataset_data(tmp_path / "not-a-dataset", "text", tokenizer, compiled.input_specs)
    with pytest.raises(ValidationDataError, match="the processor failed on column 'label'"):
        dataset_data(folder, "label", tokenizer, compiled.input_specs)
