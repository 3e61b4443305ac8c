"""int8 on ONNX Runtime: calibrated on the user's data, one build per unique block, precision per
partition chosen by the gate, and every bad input a typed error (issue 19)."""

from __future__ import annotations

import dataclasses
import json
import warnings

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import compiler
from benchmarks.quantization import sensitive_case
from compiler.errors import (
    CalibrationError,
    CalibrationWarning,
    PackageError,
    PartitionError,
    RefitError,
    ValidationDataError,
)
from compiler.inputs.data import sample_digest
from compiler.partitioning.partition import QUANTIZED_PREFIX
from compiler.quantization.quantize import calibration_samples, quantize
from compiler.validation.report import precision_summary
from compiler.validation.validate import validation_inputs

HOT = 2
INT8 = compiler.Tolerances.for_precision("int8")


@pytest.fixture(scope="module")
def case():
    return sensitive_case(width=32, blocks=4, hot=HOT, batch=4, samples=24)


@pytest.fixture(scope="module")
def int8(case, tmp_path_factory):
    """The sensitive model compiled int8 (one engine for the four blocks), calibrated on 12 samples."""
    _, program, data = case
    cache = compiler.EngineCache(tmp_path_factory.mktemp("int8-cache"))
    options = compiler.CompileOptions(
        precision="int8",
        split_modules=("OutlierBlock",),
        calibration={"samples": 16},
        on_accuracy_failure="repair",
    )
    recorded = tmp_path_factory.mktemp("data") / "recorded.npz"  # calibration reads the first 16
    np.savez(recorded, x=data["x"].numpy())
    options = dataclasses.replace(
        options, calibration=dataclasses.replace(options.calibration, data=str(recorded))
    )
    return compiler.compile(program, options, cache=cache), cache


def test_identical_blocks_build_once_and_each_instance_runs_its_own_weights_and_scales(case, int8, tmp_path):
    _, _, data = case
    compiled, _ = int8
    report = compiled.report
    assert report.unique_fingerprints == 2 and report.engines_built == 2  # 4 blocks + head
    assert report.quantization["partitions"] == [f"engine_{i}" for i in range(5)]
    assert (
        report.quantization["samples"] == 16 and "recorded.npz sha256:" in report.quantization["data_source"]
    )
    blocks = [f"engine_{i}" for i in range(4)]
    assert len({compiled.dedup.instance(b).fingerprint for b in blocks}) == 1
    # Each instance's quantized weights and activation scales are its own refit tensors.
    first, second = (
        {
            k.rsplit("/", 1)[1]: v
            for k, v in compiled.plan.quantized.items()
            if k.startswith(f"{QUANTIZED_PREFIX}{b}/")
        }
        for b in blocks[:2]
    )
    assert first.keys() == second.keys() and any(v.dtype == torch.int8 for v in first.values())
    assert any(not torch.equal(first[k], second[k]) for k in first)
    # ... and each instance computes its own block: every engine is close to its own PyTorch submodule.
    held_out = [(x,) for x in data["x"][16:20]]
    rows = compiler.compare_partitions(compiled, held_out, runs=0).rows
    assert all(r.precision == "int8" for r in rows)
    errors = {r.partition: r.rel_l2 for r in rows}
    calm = [errors[b] for b in blocks if b != f"engine_{HOT}"]
    assert max(calm) < 0.1 and errors[f"engine_{HOT}"] > 2 * max(calm)  # the outlier block stands out
    # A weight-stripped package round-trips: same outputs, int8 tensors restored from the package.
    plan = dataclasses.replace(
        compiled.plan, options=dataclasses.replace(compiled.plan.options, strip_weights=True)
    )
    unique = compiler.dedup(plan)  # no new quantization: the stripped engines come from the same graphs
    stripped = compiler.assemble(
        plan, unique, {fp: compiler.build_engine(plan, unique, fp, cache=False) for fp in unique.fingerprints}
    )
    assert stripped.report.strip_weights and all(a.stripped for a in stripped.engines.values())
    full = compiler.save(stripped, tmp_path / "int8-full.kiln")
    small = compiler.save(stripped, tmp_path / "int8.kiln", int8_weights_only=True)
    # float weights only int8 engines read are left out: the int8 tensors (+ scales) remain
    weights_bytes = [info.manifest.files["weights.safetensors"].bytes for info in (small, full)]
    assert weights_bytes[0] < 0.4 * weights_bytes[1]
    loaded = compiler.load(tmp_path / "int8.kiln")
    x = data["x"][15]
    assert torch.equal(loaded(x), stripped(x)) and loaded.report.quantization == stripped.report.quantization
    with pytest.raises(RefitError, match="int8 partitions"):
        loaded.refit({"head.weight": torch.zeros(10, 32)})
    with pytest.raises(PackageError, match="float weights were left out"):
        compiler.rebuild(loaded, {f"engine_{HOT}": "fp32"})
    assert compiler.save(loaded, tmp_path / "again.kiln").bytes == small.bytes  # stays small
    # MLflow: the calibration data is a run input (metadata only), the quantization metrics and tag
    from registry.models import lineage_tags
    from registry.payload import calibration_input_for, metrics_for

    manifest = compiler.read_manifest(tmp_path / "int8.kiln")
    dataset = calibration_input_for(manifest)
    assert dataset.dataset.name == "recorded.npz" and json.loads(dataset.dataset.profile)["samples"] == 16
    assert {(t.key, t.value) for t in dataset.tags} >= {("mlflow.data.context", "calibration")}
    metrics = metrics_for(manifest, small.bytes)
    assert metrics["quantization.calibration_samples"] == 16 and metrics["quantization.partitions"] == 5
    assert "recorded.npz" in lineage_tags(manifest)["kiln.calibration_data"]


def test_int8_weights_use_seven_bits_so_no_x86_cpu_saturates_their_products(int8):
    """ONNX Runtime's uint8 x int8 products saturate on x86 CPUs without VNNI unless one side has 7 bits
    (compiler/backends/capabilities.REDUCE_RANGE): every engine's int8 weights lie in [-64, 64] (ONNX
    Runtime's symmetric 7 bits: 255 x 64 x 2 fits int16), and each reaches its end (not fewer bits)."""
    compiled, _ = int8
    weights = [v for v in compiled.plan.quantized.values() if v.dtype == torch.int8 and v.any()]
    assert weights  # (the int8 zero points are all 0: left out)
    assert all(int(w.min()) >= -64 and int(w.max()) <= 64 for w in weights)
    assert {max(-int(w.min()), int(w.max())) for w in weights} == {64}


def test_the_gate_raises_only_the_sensitive_blocks_layer_and_records_the_plan(case, int8, tmp_path):
    model, _, data = case
    compiled, cache = int8
    checked, report = compiler.ensure_accuracy(
        model, compiled, INT8, data=data, warmup=0, runs=2, cache=cache
    )
    # Layers first (issue 46): the sensitive block's outlier channel comes back within tolerance with
    # layers of that block alone in fp32, so no block is raised whole and every partition stays int8.
    assert checked.plan.options.partition_precision == {}
    assert set(checked.plan.options.float_layers) == {f"engine_{HOT}"}
    record = checked.report.accuracy_repair
    assert record["steps"] == []
    [search] = record["searches"]
    assert search["partition"] == f"engine_{HOT}" and search["passed"], search
    # Every raised layer has its measurement: the outlier's scale Mul quantized alone makes the block's
    # output non-finite (the Div sharing its dequantized scale divides by entries rounded to zero):
    # recorded as inf, the worst, and said so; never nan or "not measured".
    assert all(r["rel_l2"] is not None and r["rel_l2"] != "nan" for r in search["raised"]), search
    assert "nan" not in json.dumps(record) and "not measured" not in json.dumps(record)
    assert any("non-finite" in line or "added rel L2" in line for line in record["lines"]), record["lines"]
    assert record["engines_built"] == search["verifications"]
    assert record["before"]["max_rel_l2"] > INT8.rel_l2 >= report.max_rel_l2
    # Validation never saw a calibration sample: 24 recorded, 16 calibrated on, 8 held out.
    assert report.samples == 8 and sum("used for calibration" in s for s in report.skipped) == 16
    plan = {row["partition"]: row["precision"] for row in report.precision_plan}
    assert plan == {f"engine_{i}": "int8" for i in range(5)}
    assert all(row["latency_ms"] > 0 for row in report.precision_plan)
    assert precision_summary(report.precision_plan) == "int8 x5"
    from registry.models import lineage_tags
    from registry.payload import artifacts_for, metrics_for

    info = compiler.save(checked, tmp_path / "checked.kiln", validation=report)
    assert lineage_tags(info.manifest)["kiln.precision_plan"] == "int8 x5"
    assert metrics_for(info.manifest, info.bytes)[f"partition.engine_{HOT}.rel_l2"] < INT8.rel_l2
    assert len(artifacts_for(info.manifest, None, None)["precision_plan.json"]["partitions"]) == 5
    # Pinned partitions are left alone: with the hot block pinned to int8, repair raises another one.
    pinned, built = compiler.rebuild(compiled, {f"engine_{HOT}": "int8"}, cache=cache)
    assert built == []  # a pin at the compile's own precision changes no fingerprint
    result = compiler.repair(model, pinned, INT8, data=data, cache=cache, max_rounds=1)
    assert [s.partition for s in result.record.steps] != [f"engine_{HOT}"]
    assert result.compiled.plan.options.partition_precision[f"engine_{HOT}"] == "int8"


def test_a_package_read_back_counts_what_repair_kept_at_int8_from_its_engines(case, int8, tmp_path):
    """A module read back (a package here, a workspace in kiln zoo) holds no quantized graphs: the
    kept-at-int8 count reads the engines' own ONNX graphs (issue 46)."""
    model, _, data = case
    compiled, cache = int8
    compiler.save(compiled, tmp_path / "staged.kiln")  # float weights kept: repair may raise a block
    loaded = compiler.load(tmp_path / "staged.kiln")
    assert not loaded.plan.quantized_graphs
    record = compiler.repair(model, loaded, INT8, data=data, cache=cache).record
    assert list(record.steps) == []  # no block raised whole: layers of the sensitive one sufficed
    kept = record.kept
    assert kept is not None and kept["precision"] == "int8", record.lines()
    # The raised layers are a few of the sensitive block's: nearly every weight stays int8.
    assert 0.9 < kept["weights"] < 1.0 and kept["flops"] > 0.9, kept
    assert kept["weights_int8"] < kept["weights_total"] and kept["flops_total"] > 0


def test_calibration_and_validation_never_share_a_sample(case, int8):
    _, _, data = case
    compiled, _ = int8
    recorded = compiler.validation_data(compiled.input_specs, data)
    used = compiled.report.quantization["sample_digests"]
    assert used == [sample_digest(s) for s in recorded.samples[:16]]  # the first 16, in order
    rest = validation_inputs(compiled, data)
    assert len(rest) == 8 and not {sample_digest(s) for s in rest.samples} & set(used)
    with pytest.raises(ValidationDataError, match="every one of its 4 samples was used for calibration"):
        validation_inputs(compiled, {"x": data["x"][:4]})


# The bad partition's NaN ranges are the point: ONNX Runtime's calibrator says so before its quantizer fails.
@pytest.mark.filterwarnings("ignore:All-NaN axis encountered:RuntimeWarning")
def test_a_quantizer_failure_keeps_that_partition_in_fp32_and_names_it():
    class Good(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(8, 8)

        def forward(self, x):
            return torch.relu(self.fc(x))

    class Bad(torch.nn.Module):  # sqrt of negative activations: NaN ranges, ONNX Runtime's quantizer fails
        def __init__(self):
            super().__init__()
            self.fc, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.out(torch.sqrt(self.fc(x)))

    model = torch.nn.Sequential(Good(), Bad()).eval()
    program = compiler.export(model, (torch.randn(2, 8),))
    options = compiler.CompileOptions(precision="int8", split_modules=("Good", "Bad"))
    data = {"input": torch.randn(16, 2, 8)}
    plan = quantize(compiler.partition(program, options), data)
    failed = plan.quantization["fallbacks"]
    [bad] = failed
    assert "scale" in failed[bad] and plan.options.partition_precision == {bad: "fp32"}
    assert plan.quantization["partitions"] and bad not in plan.quantization["partitions"]
    assert not any(k.startswith(f"{QUANTIZED_PREFIX}{bad}/") for k in plan.quantized)
    unique = compiler.dedup(plan)  # the fp32 engine is built for it; nothing was cached for int8
    compiled = compiler.assemble(
        plan, unique, {fp: compiler.build_engine(plan, unique, fp, cache=False) for fp in unique.fingerprints}
    )
    assert {compiled.plan.options.precision_of(p.name) for p in plan.partitions} == {"int8", "fp32"}
    assert f"quantization failed, kept in fp32: {bad}" in compiled.report.summary()


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x)


@pytest.fixture(scope="module")
def plan():
    """One small int8 partition taking ``x`` of shape [4, 8]: bad inputs fail before any engine."""
    program = compiler.export(_Tiny().eval(), (torch.randn(4, 8),))
    return compiler.partition(program, compiler.CompileOptions(precision="int8"))


@pytest.mark.parametrize(
    ("arrays", "match"),
    [
        (
            {"x": torch.randn(4, 4, 8), "y": torch.randn(4, 4, 8)},
            r"calibration\.data: .*field\(s\) \['y'\] name no model input.* "
            r"calibration\.ignore_fields: \['y'\]",
        ),
        (
            {"x": torch.randn(4, 4, 8).double()},
            r"calibration\.data: .*'x' has dtype float64; the model input is float32",
        ),
        ({"x": torch.randn(4, 8)}, r"calibration\.data: .*'x' has rank 2"),
        ({"x": torch.randn(4, 4, 5)}, r"calibration\.data: .*input 'x': shape \(4, 5\) is outside"),
        ({"x": torch.full((4, 4, 8), float("nan"))}, r"calibration\.data: .*'x' holds NaN"),
        (
            {"x": torch.full((4, 4, 8), float("inf"))},
            r"calibration\.data: input 'x' of sample 0 holds NaN or inf",
        ),
    ],
)
def test_calibration_data_that_does_not_fit_is_a_typed_error_naming_the_input(plan, arrays, match):
    with pytest.raises(CalibrationError, match=match):
        quantize(plan, arrays)


def test_no_calibration_data_is_refused_unless_random_is_allowed_or_quantization_is_dynamic(plan, tmp_path):
    with pytest.raises(
        CalibrationError, match=r"calibration\.data: precision int8 .*calibration\.allow_random"
    ):
        quantize(plan)
    random_ok = dataclasses.replace(
        plan,
        options=dataclasses.replace(
            plan.options, calibration=compiler.options.Calibration(samples=2, allow_random=True)
        ),
    )
    assert calibration_samples(random_ok)[0].source == "random"
    dynamic = dataclasses.replace(plan, options=dataclasses.replace(plan.options, quantization="dynamic"))
    record = quantize(dynamic).quantization
    assert record["mode"] == "dynamic" and record["samples"] == 0 and record["partitions"]
    # A file: read by the validation-data readers; too few samples warn with the count.
    path = tmp_path / "calib.npz"
    np.savez(path, x=np.random.randn(3, 4, 8).astype(np.float32))
    with pytest.warns(CalibrationWarning, match="3 usable sample.* asks for 16"):
        found, notes = calibration_samples(plan, path)
    assert found.source.startswith(f"{path} sha256:") and len(found) == 3 and "3 usable" in notes[0]
    save_file({"x": torch.randn(2, 4, 8)}, str(tmp_path / "c.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CalibrationWarning)
        assert len(calibration_samples(plan, tmp_path / "c.safetensors")[0]) == 2


def test_int8_and_fp8_on_a_backend_without_them_are_refused_by_name():
    with pytest.raises(PartitionError, match=r"precision fp8: ONNX Runtime has no fp8 kernels.*'tensorrt'"):
        compiler.CompileOptions(precision="fp8")
    with pytest.raises(PartitionError, match=r"quantization 'dynamic' with backend 'tensorrt'.*static"):
        compiler.CompileOptions(backend="tensorrt", precision="int8", quantization="dynamic")
    for backend in ("tensorrt", "tensorrt-rtx"):  # built there: Q/DQ graphs TensorRT parses
        assert compiler.CompileOptions(backend=backend, precision="fp8").quantized
    with pytest.raises(PartitionError, match=r"calibration\.method 'kl'"):
        compiler.CompileOptions(precision="int8", calibration={"method": "kl"})


def test_the_zoo_entry_carries_int8_to_the_request_and_preflight_wants_calibration_data(tmp_path):
    from zoo.errors import ZooConfigError
    from zoo.preflight import preflight
    from zoo.zoo_file import parse_zoo

    np.savez(tmp_path / "calib.npz", x=np.zeros((2, 4, 8), np.float32))
    entry = {
        "name": "tiny",
        "factory": "zoo.models:mlp_with_fallback",
        "precision": "int8",
        "calibration": {"data": "calib.npz", "samples": 8, "method": "percentile"},
        "partition": {"precision": {"engine_1": "int8", "engine_2": "torch"}},
    }
    zoo = parse_zoo({"models": [entry]}, zoo_dir=str(tmp_path))
    [request] = zoo.requests(zoo.entries[0])
    calibration = request.options.calibration
    assert (calibration.data, calibration.samples, calibration.method) == (
        str(tmp_path / "calib.npz"),
        8,
        "percentile",
    )
    assert request.options.build_settings("engine_0").quantization == {
        "method": "percentile",
        "mode": "static",
        "per_channel": True,
        "types": "u8s8",
        "scales": "refit",
        "graph": "ort-basic-optimized",
        "reduce_range": True,
    }
    assert request.options.build_settings("engine_2").quantization is None
    assert request.tolerances.rel_l2 == 0.1  # int8's default
    assert "calibration_data_sha256" in request.cache_identity()
    preflight(request)  # the file is there
    missing = parse_zoo({"models": [{**entry, "calibration": {}}]}, zoo_dir=str(tmp_path))
    with pytest.raises(ZooConfigError, match=r"models\[tiny\]\.calibration\.data: precision int8"):
        preflight(missing.requests(missing.entries[0])[0])
    dynamic = parse_zoo({"models": [{**entry, "calibration": {}, "quantization": "dynamic"}]})
    preflight(dynamic.requests(dynamic.entries[0])[0])  # dynamic: no calibration data needed
    wrong = parse_zoo(
        {"models": [{**entry, "backend": "inductor"}, {**entry, "name": "m", "quantization": "qat"}]}
    )
    assert "calibration.method 'percentile' is ONNX Runtime's calibrator; backend 'inductor'" in (
        wrong.invalid[0].error
    )
    assert "quantization" in wrong.invalid[1].error


@pytest.mark.parametrize(("precision", "quantized_type"), [("int8", "INT8"), ("fp8", "FLOAT8E4M3FN")])
def test_tensorrt_quantized_graphs_are_symmetric_with_scales_compiled_in_one_engine_per_instance(
    case, precision, quantized_type
):
    """TensorRT's recipe, made here without TensorRT (its builds: tensorrt_rtx_quantized_build_proof):
    zero points 0 and positive scales, which it requires; scales and zero points are constants of each
    instance's own graph (TensorRT refuses to refit them), and only weights are refit tensors."""
    import onnx
    from onnx import numpy_helper

    _, program, data = case
    plan = compiler.partition(
        program, compiler.CompileOptions(precision="int8", split_modules=("OutlierBlock",))
    )
    # Partitioned for ONNX Runtime (TensorRT is not installed here): the recipe follows the backend.
    options = dataclasses.replace(plan.options, backend="tensorrt-rtx", precision=precision)
    fixed_shape = {"x": data["x"][:16]}  # the fp8 calibrator stacks samples: one shape
    plan = quantize(dataclasses.replace(plan, options=options), fixed_shape)
    assert not plan.quantization["fallbacks"] and len(plan.quantization["partitions"]) == 5
    assert plan.quantization["method"] == ("distribution" if precision == "fp8" else "minmax")
    assert set(plan.quantized_graphs) == {p.name for p in plan.partitions}  # one graph per instance
    assert len(compiler.dedup(plan).unique) == 5  # the four identical blocks build four engines
    for name, graph in plan.quantized_graphs.items():
        model = onnx.load_from_string(graph)
        inits = {i.name: i for i in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
                scale, zero = (numpy_helper.to_array(inits[n]) for n in node.input[1:3])
                assert (scale > 0).all() and (np.asarray(zero, np.float32) == 0).all()
                assert node.input[1].startswith("c") and node.input[2].startswith("c")
                assert onnx.TensorProto.DataType.Name(inits[node.input[2]].data_type) == quantized_type
        refit = {
            k.split("/")[-1]: v
            for k, v in plan.quantized.items()
            if k.startswith(f"{QUANTIZED_PREFIX}{name}/")
        }
        assert refit and set(refit) == {n for n in inits if n.startswith("w")}
        want = torch.int8 if precision == "int8" else torch.float8_e4m3fn
        assert want in {t.dtype for t in refit.values()} and torch.int32 not in {
            t.dtype for t in refit.values()
        }
    if precision == "fp8":  # and ONNX Runtime cannot run what was made for TensorRT
        with pytest.raises(PartitionError, match="fp8"):
            dataclasses.replace(options, backend="onnxruntime")


def test_the_fp8_calibrator_refuses_samples_of_several_shapes_by_name():
    batch = torch.export.Dim("batch", min=1, max=8)
    program = compiler.export(_Tiny().eval(), (torch.randn(4, 8),), dynamic_shapes=({0: batch},))
    options = compiler.CompileOptions(precision="int8", calibration={"samples": 4, "allow_random": True})
    plan = compiler.partition(program, options)
    plan = dataclasses.replace(
        plan, options=dataclasses.replace(options, backend="tensorrt", precision="fp8")
    )
    out = quantize(plan, {"x": torch.randn(4, 4, 8)})  # one shape: quantized
    assert out.quantization["partitions"] and not out.quantization["fallbacks"]
    # Random inputs span the batch range (1 and 8 rows): the partition falls back, and says why.
    [reason] = quantize(plan).quantization["fallbacks"].values()
    assert "every calibration sample must reach this partition in one shape, got 3 shapes" in reason


def test_batchnorm_is_fused_into_its_convolution_before_quantizing():
    """Unfused, each BatchNorm ran in fp32 between Q/DQ pairs: ResNet-50 int8 at 0.99x fp32 on the AMX
    host (benchmarks/probes/probe_resnet_int8.py). Fused, the int8 graph has no BatchNorm and every Conv reads
    dequantized int8 weights."""
    import onnx

    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, bias=False),
        torch.nn.BatchNorm2d(8),
        torch.nn.ReLU(),
        torch.nn.Conv2d(8, 4, 1),
    ).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-0.5, 0.5)
        model[1].running_var.uniform_(0.5, 1.5)
    program = compiler.export(model, (torch.randn(1, 3, 8, 8),))
    options = compiler.CompileOptions(precision="int8", calibration={"samples": 8})
    data = {"input": torch.randn(8, 1, 3, 8, 8)}
    compiled = compiler.compile(program, options, cache=False, calibration_data=data)
    [graph] = compiled.plan.quantized_graphs.values()
    nodes = onnx.load_from_string(graph).graph.node
    ops = [n.op_type for n in nodes]
    assert "BatchNormalization" not in ops and ops.count("Conv") == 2
    produced = {o: n.op_type for n in nodes for o in n.output}
    for conv in (n for n in nodes if n.op_type == "Conv"):
        assert produced[conv.input[0]] == "DequantizeLinear" and produced[conv.input[1]] == "DequantizeLinear"
    x = data["input"][0]
    with torch.no_grad():
        assert torch.allclose(compiled(x), model(x), atol=0.1, rtol=0.1)


@pytest.mark.parametrize("backend", ["onnxruntime", "tensorrt"])  # u8s8 and s8s8-symmetric
def test_a_layer_kept_in_float_reads_the_float_activation_not_another_layers_dequantized_copy(
    backend, tmp_path
):
    """An activation quantized for one consumer reached a kept one through the same Q/DQ pair: TensorRT
    then built the kept MatMul in int8 (both operands dequantized; its H100 build, issue 46) and ONNX
    Runtime computed it on rounded inputs. The kept layer reads the float tensor; the other keeps its pair."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from compiler.quantization.onnxruntime import run_static

    rng = np.random.default_rng(0)
    weights = [
        numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), f"w{i}") for i in (1, 2)
    ]
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["m1"], name="keep"),
            helper.make_node("MatMul", ["x", "w2"], ["m2"], name="quant"),
            helper.make_node("Add", ["m1", "m2"], ["y"], name="add"),
        ],
        "two_readers",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        initializer=weights,
    )
    source = tmp_path / "float.onnx"
    onnx.save_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), source)
    feeds = [{"x": rng.standard_normal((4, 8)).astype(np.float32)} for _ in range(8)]
    options = compiler.CompileOptions(backend=backend, precision="int8", calibration={"method": "minmax"})
    settings = {**options.quantization_settings("int8"), "per_channel": False}
    model = run_static(source, tmp_path, feeds, settings, exclude=["keep"])
    produced = {out: node.op_type for node in model.graph.node for out in node.output}
    keep = next(n for n in model.graph.node if n.name == "keep")
    quant = next(n for n in model.graph.node if n.name.startswith("quant") and n.op_type == "MatMul")
    assert list(keep.input) == ["x", "w1"]  # the graph's own float input and float weight
    assert all(produced.get(t) == "DequantizeLinear" for t in quant.input)
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = feeds[0]["x"]
    exact = x @ numpy_helper.to_array(weights[0]) + x @ numpy_helper.to_array(weights[1])
    assert np.abs(session.run(None, {"x": x})[0] - exact).max() < 0.5
