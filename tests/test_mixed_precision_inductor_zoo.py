"""Mixed precision inside a partition on Inductor through `kiln zoo` (issue 46): one Hugging Face BERT
classifier (one layer x 64, random weights from a config), two entries of one zoo run, each missing its
tolerance as one partition, each repaired a layer at a time instead of raising the whole engine:

- bf16: its fewest ops kept in fp32 inside the bf16 engine (compiler.engine_build.float_ops);
- int8 (torchao's PT2E flow with the x86 quantizer, calibrated on recorded data): its fewest layers left
  out of quantization by the quantizer's own switch (compiler.quantization.torch_layers).

Both packages are read back in one fresh process and answer as their repaired engines did. (That a re-run
reuses the repair is the ONNX Runtime zoo test's, through the same code; what it needs of Inductor, a
quantized program's digest that is the same in every process, is tests/compiler/quantization's.)
"""

from __future__ import annotations

import re

import pytest

from tests.fixtures.mixed_precision import bert, eager_logits, record, relative, zoo

pytestmark = pytest.mark.slow  # a `kiln zoo` run of a BERT at bf16 and int8 on Inductor with layer searches

BF16_TOLERANCE = 1e-3  # bf16's rounding alone (8 bits of mantissa) misses it on this model
INT8_TOLERANCE = 0.02  # all-int8 misses it (rel L2 ~0.04), one layer in fp32 meets it
TINY = {  # one layer x 64: BertConfig fields
    "vocab_size": 512,
    "hidden_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "intermediate_size": 256,
    "max_position_embeddings": 64,
    "num_labels": 4,
}
COMMON = {
    "task": "sequence-classification",
    "backend": "inductor",
    "validation": {"data": "recorded.npz"},
    "on_accuracy_failure": "repair",
    "repair_seconds": 300,
}
INT8 = {
    **COMMON,
    "precision": "int8",
    "tolerances": {"rel_l2": INT8_TOLERANCE},
    "calibration": {"data": "recorded.npz", "samples": 8},  # validation reads the 8 after them
}
BF16 = {**COMMON, "precision": "bf16", "tolerances": {"rel_l2": BF16_TOLERANCE}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, mlflow_server, prefect_server) -> dict:
    root = tmp_path_factory.mktemp("inductor")
    model = bert(root / "bert", 3, **TINY)
    ids = record(root, model, 16, 2, 16, seed=0)
    settings = {"engine_cache": str(root / "engines"), "validation": {"samples": 8, "warmup": 0, "runs": 2}}
    return {
        "first": zoo(root, "first", {"bf16": BF16, "int8": INT8}, settings, server_env=prefect_server.env),
        "eager": eager_logits(model, ids),
    }


def test_bf16_keeps_the_fewest_ops_in_fp32_and_says_so(runs):
    package = runs["first"]["packages"]["bf16"]
    repair = package["repair"]
    assert repair["before"]["max_rel_l2"] > BF16_TOLERANCE  # all-bf16 missed: that is what repair was for
    assert repair["passed"] and repair["after"]["max_rel_l2"] <= BF16_TOLERANCE, repair["lines"]
    assert not repair["steps"], repair["lines"]  # the partition was not raised whole
    [search] = repair["searches"]
    assert search["precision"] == "bf16" and 0 < len(search["raised"]) < search["candidates"], search
    assert sorted(repair["float_layers"][search["partition"]]) == sorted(r["name"] for r in search["raised"])
    assert any(re.search(r": bf16 -> fp32, it added rel L2", line) for line in repair["lines"])
    kept = repair["kept"]
    assert kept["precision"] == "bf16" and kept["flops"] > 0.5, kept  # the GEMMs mostly still bf16
    assert package["precision"] == "bf16"
    # read back in a fresh process, it answers as validated
    assert relative(package["logits"], runs["eager"]) <= 3 * BF16_TOLERANCE


def test_int8_leaves_the_fewest_layers_out_of_quantization_and_stays_mostly_int8(runs):
    package = runs["first"]["packages"]["int8"]
    repair = package["repair"]
    assert repair["before"]["max_rel_l2"] > INT8_TOLERANCE  # all-int8 missed
    assert repair["passed"] and repair["after"]["max_rel_l2"] <= INT8_TOLERANCE, repair["lines"]
    assert not repair["steps"], repair["lines"]  # the partition was not raised whole
    [search] = repair["searches"]
    assert search["precision"] == "int8" and 0 < len(search["raised"]) < search["candidates"], search
    raised = [r["name"] for r in search["raised"]]
    assert sorted(repair["float_layers"][search["partition"]]) == sorted(raised)
    # each raised layer named as the user's model names it (its weight, under BertForSequenceClassification's
    # two modules: the encoder or the classifier head, which this 2-core AVX2 machine's search raised),
    # with its measured sensitivity
    for layer in search["raised"]:
        assert layer["weight"].startswith(("bert.", "classifier.")) and layer["rel_l2"] > 0, search["raised"]
    assert all(
        re.search(r": int8 -> fp32, (alone )?it added rel L2", line)
        for line in repair["lines"][: len(raised)]
    )
    kept = repair["kept"]
    assert kept["precision"] == "int8" and kept["weights"] > 0.5 and kept["flops"] > 0.5, kept
    assert repair["budget_seconds"] == 300 and repair["seconds"] > 0
    assert package["precision"] == "int8"
    # read back in a fresh process, it answers within the tolerance it was repaired to
    assert relative(package["logits"], runs["eager"]) <= INT8_TOLERANCE


def test_the_summary_warns_that_neither_model_is_all_at_its_precision(runs):
    summary = runs["first"]["summary"]
    for asked in ("bf16", "int8"):
        warned = [w for w in summary["warnings"] if f"asked for {asked}" in w]
        assert warned and re.search(r"\d+ layers? raised to fp32", warned[0]), summary["warnings"]
        assert "got mixed precision" in warned[0] and f"kept at {asked}" in warned[0], warned
        [row] = [m for m in summary["models"] if m["name"] == asked]
        assert re.match(
            rf"{asked}( x1)? \(\d+ layers? fp32, [\d.]+% of weights {asked}\)", row["precision"]
        ), row
