"""Per-partition precision and the per-partition comparison (each engine vs its PyTorch submodule)."""

from __future__ import annotations

import json

import pytest
import torch

import compiler
from compiler.accuracy.compare import PartitionComparison, compare_partitions
from compiler.errors import PartitionError
from compiler.inputs.data import random_data
from zoo.models import mlp_with_fallback


@pytest.fixture(scope="module")
def mlp():
    case = mlp_with_fallback()
    return case, compiler.export(case.model, case.args, dynamic_shapes=case.dynamic_shapes)


def test_each_engine_is_compared_with_its_own_submodule(mlp, tmp_path):
    _case, program = mlp
    compiled = compiler.compile(program, cache=tmp_path, precision="fp16")
    data = random_data(compiled.input_specs, 2)
    table = compare_partitions(compiled, data.samples, runs=2)
    assert [r.partition for r in table.rows] == [p.name for p in compiled.plan.partitions]
    for row in table.rows:
        assert row.precision == "fp16" and row.backend == "onnxruntime"
        assert 1e-6 < row.rel_l2 < 1e-2 and row.cosine > 0.999  # a real fp16 error, measured locally
        assert row.fingerprint == compiled.dedup.instance(row.partition).fingerprint
    assert 0 < sum(r.latency_share for r in table.rows) <= 1.0 and table.total_ms > 0
    assert table.samples == 2 and "engine_0" in table.table() and "rest of the graph" in table.table()
    assert PartitionComparison.from_dict(json.loads(json.dumps(table.to_dict()))) == table
    single = compare_partitions(compiled, list(data.samples[0]), runs=0)  # one flat sample, no timing
    assert single.samples == 1 and all(r.latency_ms == 0 for r in single.rows)


def test_partition_precision_changes_only_the_named_partitions_fingerprint(mlp, tmp_path):
    _case, program = mlp
    cache = compiler.EngineCache(tmp_path)
    base = compiler.compile(program, cache=cache, precision="fp16")
    names = [p.name for p in base.plan.partitions]
    assert len(names) >= 2
    raised = compiler.compile(program, cache=cache, precision="fp16", partition_precision={names[0]: "fp32"})
    before = {n: base.dedup.instance(n).fingerprint for n in names}
    after = {n: raised.dedup.instance(n).fingerprint for n in names}
    assert before[names[0]] != after[names[0]] and all(before[n] == after[n] for n in names[1:])
    assert raised.report.engines_built == 1 and raised.report.cache_hits == len(set(before.values())) - 1
    table = compare_partitions(raised, random_data(raised.input_specs, 2).samples, runs=0)
    assert table.row(names[0]).precision == "fp32" and table.row(names[0]).rel_l2 < 1e-5
    assert table.row(names[1]).precision == "fp16" and table.row(names[1]).rel_l2 > 1e-6
    # the cache keeps both: going back to all-fp16 builds nothing
    again = compiler.compile(program, cache=cache, precision="fp16")
    assert again.report.engines_built == 0


def test_a_partition_set_to_torch_runs_its_submodule(mlp, tmp_path):
    case, program = mlp
    compiled = compiler.compile(
        program, cache=tmp_path, precision="fp16", partition_precision={"engine_0": "torch"}
    )
    row = compare_partitions(compiled, random_data(compiled.input_specs, 1).samples, runs=0).row("engine_0")
    assert row.precision == "torch" and row.backend == "torch" and row.rel_l2 == 0.0
    x = torch.randn(3, 64)
    assert torch.allclose(compiled(x), case.model(x), rtol=1e-2, atol=1e-2)


def test_partition_precision_is_checked_and_survives_a_package(mlp, tmp_path):
    _case, program = mlp
    with pytest.raises(PartitionError, match=r"partition_precision names \['engine_9'\]"):
        compiler.compile(program, cache=tmp_path, partition_precision={"engine_9": "fp32"})
    with pytest.raises(PartitionError, match="partition_precision"):
        compiler.CompileOptions(partition_precision={"engine_0": "int4"})
    with pytest.raises(PartitionError, match="on_accuracy_failure"):
        compiler.CompileOptions(on_accuracy_failure="ignore")
    compiled = compiler.compile(
        program, cache=tmp_path, precision="fp16", partition_precision={"engine_0": "fp32"}
    )
    compiler.save(compiled, tmp_path / "mlp.kiln")
    loaded = compiler.load(tmp_path / "mlp.kiln")
    assert loaded.plan.options.partition_precision == {"engine_0": "fp32"}
    x = torch.randn(3, 64)
    assert torch.equal(loaded(x), compiled(x))
