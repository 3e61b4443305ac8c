"""One validation policy: tolerances as a value object, reasons for failing, one latency measurement."""

from __future__ import annotations

import json
import math

import pytest
import torch

import compiler
from compiler.errors import ToleranceError
from compiler.validation.report import Latency, OutputAccuracy, Tolerances, ValidationReport
from compiler.validation.validate import compare_tensors, measure_latency, top1_agreement


def _report(*outputs: OutputAccuracy, eager_ms: float = 1.0, compiled_ms: float = 1.0) -> ValidationReport:
    return ValidationReport(
        list(outputs),
        [[[2, 3]]],
        Latency(eager_ms, eager_ms, 5),
        Latency(compiled_ms, compiled_ms, 5),
        "fp16",
    )


def test_precision_defaults_fill_only_what_is_unset():
    assert Tolerances.for_precision("fp32").rel_l2 == 1e-4
    assert Tolerances.for_precision("fp16").rel_l2 == 2e-2
    assert Tolerances.for_precision("bf16").rel_l2 == 5e-2
    assert Tolerances(max_abs=0.5).resolved("fp16") == Tolerances(rel_l2=2e-2, max_abs=0.5)
    assert Tolerances(rel_l2=1e-3).resolved("fp16").rel_l2 == 1e-3
    assert Tolerances.for_precision("int8").rel_l2 == 1e-1
    with pytest.raises(ToleranceError, match="int4"):
        Tolerances.for_precision("int4")


def test_a_tolerance_name_that_does_not_exist_is_refused():
    with pytest.raises(ToleranceError, match=r"unknown tolerance name\(s\) \['rel_12'\].*rel_l2"):
        Tolerances.from_dict({"rel_12": 1e-3})
    with pytest.raises(TypeError):
        Tolerances(rel_12=1e-3)  # type: ignore[call-arg]


def test_tolerances_refuse_values_they_cannot_take_and_round_trip():
    with pytest.raises(ToleranceError, match="min_top1_agreement"):
        Tolerances(min_top1_agreement=1.5)
    with pytest.raises(ToleranceError, match="rel_l2"):
        Tolerances(rel_l2=-1)
    with pytest.raises(ToleranceError, match="max_abs"):
        Tolerances(max_abs="0.1")  # type: ignore[arg-type]
    tolerances = Tolerances(rel_l2=1e-3, min_cosine=0.99, max_latency_ratio=2, min_top1_agreement=0.99)
    assert Tolerances.from_dict(json.loads(json.dumps(tolerances.to_dict()))) == tolerances
    assert Tolerances.from_dict(None) == Tolerances()


def test_a_failing_report_says_which_metric_by_how_much_and_what_to_change():
    report = _report(OutputAccuracy("output_0", 0.4, 3.1e-2, 0.9995), compiled_ms=3.0)
    assert report.failures(Tolerances()) == []  # nothing gated
    reasons = report.failures(Tolerances(rel_l2=1e-4, max_latency_ratio=2.0))
    assert reasons[0] == "accuracy: max relative L2 3.1e-02 > tolerance 1.0e-04 (tolerances.rel_l2)"
    assert (
        reasons[1].startswith("latency: compiled/eager median 3.00x")
        and "(tolerances.max_latency_ratio)" in reasons[1]
    )
    assert report.failures(Tolerances(rel_l2=5e-2, max_abs=0.5, min_cosine=0.999)) == []
    [cosine] = report.failures(Tolerances(min_cosine=0.99999))
    assert "min cosine 0.9995 < tolerance 1 (tolerances.min_cosine)" in cosine
    assert report.passed(Tolerances(rel_l2=5e-2)) and not report.passed()  # fp16 default: 2e-2


def test_the_worst_of_several_outputs_is_named():
    report = _report(OutputAccuracy("output_0", 0.1, 1e-5, 1.0), OutputAccuracy("output_1", 9.0, 0.2, 0.98))
    [reason] = report.failures(Tolerances(rel_l2=1e-3))
    assert "on output_1" in reason


def test_non_finite_errors_never_pass():
    # fp16 overflow: inf in the engine, nan after a normalisation; eager is finite.
    row = compare_tensors(
        "output_0",
        torch.tensor([[4.0, 3, 2, 1], [4.0, 3, 2, 1]]),
        torch.tensor([[4.0, 3, 2, 1], [math.nan] * 4]),
    )
    assert row.rel_l2 == math.inf and row.max_abs == math.inf and math.isnan(row.cosine)
    assert row.top1_agreement == 0.5  # nan is never the argmax
    report = _report(row)
    assert len(report.failures(Tolerances(rel_l2=1.0, min_cosine=0.0, min_top1_agreement=0.9))) == 3
    same_nan = compare_tensors("o", torch.tensor([math.nan, 1.0]), torch.tensor([math.nan, 1.0]))
    assert same_nan.rel_l2 == 0.0 and same_nan.cosine == 1.0


def test_top1_agreement_gates_classification_and_per_token_logits():
    logits = torch.tensor([[3.0, 1.0], [0.0, 2.0], [5.0, 4.0], [1.0, 0.0]])
    flipped = logits.clone()
    flipped[2] = torch.tensor([4.0, 5.0])
    assert top1_agreement(logits, flipped) == 0.75
    tokens = torch.randn(2, 5, 11)
    assert top1_agreement(tokens, tokens) == 1.0
    assert top1_agreement(torch.randn(4), torch.randn(4)) is None  # no class axis
    report = _report(compare_tensors("output_0", logits, flipped))
    [reason] = report.failures(Tolerances(min_top1_agreement=0.99))
    assert reason == "accuracy: min top-1 agreement 0.75 < tolerance 0.99 (tolerances.min_top1_agreement)"
    no_axis = _report(OutputAccuracy("output_0", 0.0, 0.0, 1.0))
    assert "no output has a class axis" in no_axis.failures(Tolerances(min_top1_agreement=0.5))[0]


def test_measure_latency_interleaves_and_counts_runs():
    calls = []
    timed = measure_latency(
        {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=2, runs=6
    )
    assert set(timed) == {"a", "b"} and timed["a"].runs == 6 and timed["b"].runs == 6
    assert timed["a"].median_ms >= 0 and timed["a"].p95_ms >= timed["a"].median_ms
    measured = calls[4:]  # after the warmup rounds
    assert len(measured) == 12
    # one call of each per round, the order rotating: neither always runs first
    assert all(set(measured[i : i + 2]) == {"a", "b"} for i in range(0, 12, 2))
    assert {measured[i] for i in range(0, 12, 2)} == {"a", "b"}
    with pytest.raises(ValueError):
        measure_latency({"a": lambda: None}, warmup=0, runs=0)


def test_a_real_report_round_trips_through_json(tmp_path):
    from zoo.models import mlp_with_fallback

    case = mlp_with_fallback()
    program = compiler.export(case.model, case.args, dynamic_shapes=case.dynamic_shapes)
    compiled = compiler.compile(program, cache=tmp_path)
    report = compiler.validate(case.model, compiled, samples=2, warmup=0, runs=2)
    assert report.data_source == "random" and report.samples == 2 and report.eager.runs == 2
    again = ValidationReport.from_dict(json.loads(json.dumps(report.to_dict())))
    assert again == report and again.max_rel_l2 == report.max_rel_l2
    assert report.failures(Tolerances.for_precision("fp32")) == []
    assert report.outputs[0].top1_agreement == 1.0  # [batch, 16] outputs: a class axis
