"""Automatic accuracy repair: the partition that loses precision is found, raised and recorded."""

from __future__ import annotations

import json

import pytest
import torch

import compiler
from benchmarks.accuracy_repair import overflow_case
from compiler.accuracy.repair import RepairRecord
from compiler.errors import AccuracyError

HOT = 2
FP16 = compiler.Tolerances.for_precision("fp16")


@pytest.fixture(scope="module")
def case():
    return overflow_case(width=32, blocks=4, hot=HOT)


def _compile(program, cache, **settings):
    return compiler.compile(
        program, cache=cache, precision="fp16", split_modules=("OverflowBlock",), **settings
    )


def test_the_overflowing_block_alone_is_raised_to_fp32_and_only_it_is_rebuilt(case, tmp_path):
    model, program = case
    cache = compiler.EngineCache(tmp_path)
    compiled = _compile(program, cache)
    assert compiler.validate(model, compiled, warmup=0, runs=1).failures(FP16)  # fp16 overflow: inf
    result = compiler.repair(model, compiled, FP16, cache=cache)
    record = result.record
    assert record.passed and record.rounds == 1 and record.engines_built == 1
    [step] = record.steps
    assert (step.partition, step.precision_before, step.precision_after) == (f"engine_{HOT}", "fp16", "fp32")
    assert step.rel_l2_before == float("inf") and step.rel_l2_after < 1e-5
    assert record.lines()[0].startswith(f"engine_{HOT}: fp16 -> fp32, its rel L2 inf -> ")
    assert record.before.max_rel_l2 == float("inf") and record.after.max_rel_l2 < 2e-2
    repaired = result.compiled
    assert repaired.plan.options.partition_precision == {f"engine_{HOT}": "fp32"}
    names = [p.name for p in compiled.plan.partitions]
    changed = [
        n for n in names if compiled.dedup.instance(n).fingerprint != repaired.dedup.instance(n).fingerprint
    ]
    assert changed == [f"engine_{HOT}"]
    assert repaired.report.accuracy_repair["steps"][0]["partition"] == f"engine_{HOT}"
    assert f"accuracy repair: engine_{HOT} fp16 -> fp32" in repaired.report.summary()
    text = json.dumps(record.to_dict(), allow_nan=False)  # strict JSON: inf is written as "inf"
    again = RepairRecord.from_dict(json.loads(text))
    assert again.to_dict() == record.to_dict() and again.steps[0].rel_l2_before == float("inf")
    x = torch.randn(5, 32)
    assert torch.allclose(repaired(x), model(x), rtol=5e-2, atol=5e-2)


def test_on_accuracy_failure_error_fails_and_repair_repairs(case, tmp_path):
    model, program = case
    strict = _compile(program, tmp_path)  # the library default: "error"
    with pytest.raises(
        AccuracyError, match=r"max relative L2 inf > tolerance 2\.0e-02 \(tolerances\.rel_l2\)"
    ) as err:
        compiler.ensure_accuracy(model, strict, compiler.Tolerances(), warmup=0, runs=1, cache=tmp_path)
    assert err.value.failures and all(reason.startswith("accuracy:") for reason in err.value.failures)
    lenient = _compile(program, tmp_path, on_accuracy_failure="repair")
    repaired, report = compiler.ensure_accuracy(
        model, lenient, compiler.Tolerances(min_top1_agreement=0.99), warmup=0, runs=1, cache=tmp_path
    )
    assert report.failures(FP16) == [] and report.min_top1_agreement >= 0.99
    assert repaired.plan.options.partition_precision == {f"engine_{HOT}": "fp32"}
    # the repaired options are the recipe: compiling with them needs no repair and builds nothing new
    again = compiler.compile(program, repaired.plan.options, cache=tmp_path)
    assert again.report.engines_built == 0
    assert not compiler.validate(model, again, warmup=0, runs=1).failures(FP16)


def test_the_ladder_goes_fp16_to_fp32_to_torch_and_stops_when_the_tolerances_hold(case, tmp_path):
    model, program = case
    compiled = _compile(program, tmp_path, partition_precision={f"engine_{HOT}": "fp32"})
    tight = compiler.Tolerances(rel_l2=1e-6)  # no fp16 engine meets this
    result = compiler.repair(model, compiled, tight, cache=tmp_path, per_round=10)
    moves = {
        (s.partition, s.precision_before, s.precision_after) for s in result.record.steps if s.round == 1
    }
    assert (f"engine_{HOT}", "fp32", "torch") in moves and ("engine_0", "fp16", "fp32") in moves
    assert result.record.passed and result.record.after.max_rel_l2 <= 1e-6
    assert all(s.rel_l2_after <= s.rel_l2_before for s in result.record.steps)


def test_an_fp32_compile_is_not_repaired_and_a_passing_one_is_left_alone(case, tmp_path):
    model, program = case
    fp32 = compiler.compile(program, cache=tmp_path, split_modules=("OverflowBlock",))
    result = compiler.repair(model, fp32, compiler.Tolerances(rel_l2=1e-12), cache=tmp_path)
    assert result.compiled is fp32 and not result.record.steps and not result.record.passed
    assert "lowering bug" in result.record.note and fp32.report.accuracy_repair is None
    fine = compiler.repair(model, fp32, compiler.Tolerances.for_precision("fp32"), cache=tmp_path)
    assert fine.compiled is fp32 and fine.record.passed and not fine.record.steps
    lenient = compiler.compile(
        program, cache=tmp_path, split_modules=("OverflowBlock",), on_accuracy_failure="repair"
    )
    with pytest.raises(AccuracyError, match=r"tolerances\.rel_l2\); repair: not repaired: .* is fp32"):
        compiler.ensure_accuracy(model, lenient, compiler.Tolerances(rel_l2=1e-12), warmup=0, runs=1)


def test_a_repaired_package_keeps_its_precisions_and_its_record(case, tmp_path):
    model, program = case
    result = compiler.repair(model, _compile(program, tmp_path), FP16, cache=tmp_path)
    compiler.save(result.compiled, tmp_path / "repaired.kiln")
    loaded = compiler.load(tmp_path / "repaired.kiln")
    assert loaded.plan.options.partition_precision == {f"engine_{HOT}": "fp32"}
    assert loaded.report.accuracy_repair["steps"][0]["partition"] == f"engine_{HOT}"
    assert not compiler.validate(model, loaded, warmup=0, runs=1).failures(FP16)


def test_a_package_read_back_from_disk_is_repaired_as_the_compiled_module_is(case, tmp_path):
    """A load runs from the package's runtime graph, which has no shapes or dtypes; repairing it needs
    them (fingerprints, lowering): the plan is replayed on the package's program for that."""
    model, program = case
    cache = compiler.EngineCache(tmp_path / "cache")
    compiler.save(_compile(program, cache), tmp_path / "fp16.kiln")
    loaded = compiler.load(tmp_path / "fp16.kiln")
    assert not loaded.plan.described  # what a load runs: the runtime graph alone
    result = compiler.repair(model, loaded, FP16, cache=cache)
    assert result.record.passed and result.record.engines_built == 1  # the raised block alone
    assert result.compiled.plan.options.partition_precision == {f"engine_{HOT}": "fp32"}
    x = torch.randn(5, 32)
    assert torch.allclose(result.compiled(x), model(x), rtol=5e-2, atol=5e-2)
