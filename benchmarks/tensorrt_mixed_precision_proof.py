"""Proof on real TensorRT(-RTX) that accuracy repair's layers kept in fp32 stay fp32 in the engine (issue
46): the same partition lowered with and without ``CompileOptions.float_layers``, parsed into kiln's
strongly typed network (the only precision control TensorRT-RTX has) and built by kiln's own
``TensorRTBackend.build``.

* fp16: the ops named (every LayerNorm and softmax of a tiny BERT) are kept in fp32 by Casts in the
  lowered ONNX graph (compiler.engine_build.float_ops). Proved on the parsed network: each layer's
  output type, counted by layer type, with and without the set (the kept ones FLOAT, the same layers
  HALF without); then the engine built, and, where the runtime deserializes it, TensorRT's engine
  inspector (a build with detailed profiling verbosity) listing each layer's precision.
* int8: TensorRT's Q/DQ recipe with two GEMMs excluded by name (ONNX Runtime's quantizer leaves them
  without Q/DQ): the kept GEMMs read no DequantizeLinear; built, and inspected where it can be.

Run on the GPU machine with TensorRT-RTX staged (``bash ../shared/gpu/stage-trt-rtx.sh``, its
``/tmp/trt/site`` on PYTHONPATH):

    PYTHONPATH=.:/tmp/trt/site python benchmarks/tensorrt_mixed_precision_proof.py --out $OUT/mixed.json

``--backend tensorrt`` for TensorRT; ``--dry-run`` (any machine, no TensorRT): lowering and the
ONNX-side checks only. Writes JSON (``--out``); exits 1 when a check fails.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

import onnx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import compiler
from compiler.engine_build.float_ops import candidates, op_name
from compiler.engine_build.lower import lower, lower_float
from compiler.quantization.quantize import quantize
from zoo import models as zoo

KEPT_OPS = ("layer_norm", "softmax", "_softmax")


def _plan(program, options, quantized: bool):
    plan = compiler.partition(program, options)
    if quantized:  # random calibration: meaningless scales, the same graph (what a build proves)
        plan = quantize(plan)
    return plan, compiler.dedup(plan)


def _onnx_types(graph: bytes) -> tuple[onnx.ModelProto, dict[str, int]]:
    model = onnx.shape_inference.infer_shapes(onnx.load_from_string(graph))
    types = {v.name: v.type.tensor_type.elem_type for v in model.graph.value_info}
    types.update({i.name: i.data_type for i in model.graph.initializer})
    types.update({i.name: i.type.tensor_type.elem_type for i in model.graph.input})
    return model, types


def _fp16_sets(plan) -> dict[str, tuple[str, ...]]:
    return {
        p.name: names
        for p in plan.partitions
        if (names := tuple(n for n, node in candidates(plan.submodule(p.name)) if op_name(node) in KEPT_OPS))
    }


def _int8_sets(plan) -> dict[str, tuple[str, ...]]:
    """Two GEMMs per quantized partition (its first and last), by the quantizer's canonical names."""
    from compiler.quantization.onnxruntime import _folded, prepared

    found = {}
    for p in plan.partitions:
        if plan.options.precision_of(p.name) != "int8":
            continue
        with tempfile.TemporaryDirectory() as tmp:
            source = prepared(_folded(onnx.load_from_string(lower_float(plan, p, "fp32").onnx)), Path(tmp))
            gemms = [n.name for n in onnx.load(source).graph.node if n.op_type in ("MatMul", "Gemm")]
        if len(gemms) >= 2:
            found[p.name] = (gemms[0], gemms[-1])
    return found


def _onnx_check(precision: str, lowered: bytes, kept: tuple[str, ...]) -> dict:
    model, types = _onnx_types(lowered)
    ops = collections.Counter()
    for node in model.graph.node:
        if node.op_type in ("Cast", "Constant", "Shape"):
            continue
        first = types.get(node.input[0]) if node.input else None
        ops[f"{node.op_type}:{onnx.TensorProto.DataType.Name(first) if first else '?'}"] += 1
    dq = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    out = {"onnx_nodes": len(model.graph.node), "onnx_op_input_types": dict(sorted(ops.items()))}
    if precision == "int8":
        # The quantized graph renames its nodes (n<k> after the Q/DQ inserted): the kept GEMMs are found
        # by position, the first and the last GEMM, as _int8_sets chose them in the float graph.
        gemms = [n for n in model.graph.node if n.op_type in ("MatMul", "Gemm")]
        chosen = {"first": gemms[0], "last": gemms[-1]} if len(kept) == 2 and len(gemms) >= 2 else {}
        # A kept GEMM computes in float unless both operands come through DequantizeLinear (TensorRT
        # fuses a GEMM into int8 exactly there); reading a float weight is the recipe's promise.
        out["kept_gemms_read_no_dequantize"] = {
            f"{where} ({kept[i]})": not all(t in dq for t in node.input[:2])
            for i, (where, node) in enumerate(chosen.items())
        }
        out["kept_gemms_inputs_dequantized"] = {
            f"{where} ({kept[i]})": [t in dq for t in node.input]
            for i, (where, node) in enumerate(chosen.items())
        }
    return out


def _network(backend, lowered) -> dict:
    """Layer output types of the parsed strongly typed network, by layer type."""
    trt = backend.trt
    _logger, _builder, network, _parser = backend._parsed(lowered.onnx, lowered.io, None)
    counts = collections.Counter()
    for i in range(network.num_layers):
        layer = network.get_layer(i)
        if layer.num_outputs:
            kind = str(layer.type).split(".")[-1]
            counts[f"{kind}:{str(layer.get_output(0).dtype).split('.')[-1]}"] += 1
    del trt
    return {"layers": network.num_layers, "layer_output_types": dict(sorted(counts.items()))}


def _inspect(backend, lowered, settings) -> dict:
    """A build of the same network with detailed profiling verbosity, and the engine inspector's layer
    information (each layer's precision and tactic), where the runtime deserializes it here."""
    from compiler.backends.tensorrt.build_settings import optimization_profiles

    trt = backend.trt
    logger, builder, network, _parser = backend._parsed(lowered.onnx, lowered.io, None)
    config = builder.create_builder_config()
    for shapes in optimization_profiles(lowered.io, settings):
        profile = builder.create_optimization_profile()
        for name, (lo, opt, hi) in shapes.items():
            profile.set_shape(name, lo, opt, hi)
        config.add_optimization_profile(profile)
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        return {"error": "build failed: " + "\n".join(logger.errors())[:2000]}
    engine = trt.Runtime(logger.logger).deserialize_cuda_engine(plan)
    if engine is None:
        return {
            "error": "the runtime did not deserialize the engine here: " + "\n".join(logger.errors())[:2000]
        }
    info = json.loads(
        engine.create_engine_inspector().get_engine_information(trt.LayerInformationFormat.JSON)
    )
    layers = info.get("Layers", [])
    precisions = collections.Counter()
    for layer in layers:
        if isinstance(layer, dict):
            kinds = {str(t.get("Format/Datatype", "?")).split(" ")[0] for t in layer.get("Outputs", [])}
            precisions[f"{layer.get('LayerType', '?')}:{'/'.join(sorted(kinds))}"] += 1
    return {
        "engine_layers": len(layers),
        "layer_types_and_output_formats": dict(sorted(precisions.items())),
        "layers": layers[:400],
    }


def prove(program, precision: str, backend, dry_run: bool) -> dict:
    quantized = precision == "int8"
    base = compiler.CompileOptions(
        backend="onnxruntime" if dry_run else backend.name,
        precision=precision,
        backend_options={} if dry_run else {"refit": "none"},
        calibration={"samples": 4, "allow_random": True},
    )
    plain_plan, plain_dedup = _plan(program, base, quantized)
    sets = _int8_sets(plain_plan) if quantized else _fp16_sets(plain_plan)
    kept_options = dataclasses.replace(base, float_layers=sets)
    kept_plan, kept_dedup = _plan(program, kept_options, quantized)
    out: dict = {"kept": {k: list(v) for k, v in sets.items()}, "partitions": {}}
    for name, kept in sets.items():
        entry: dict = {"layers_kept_fp32": len(kept)}
        for label, plan, dedup in (("plain", plain_plan, plain_dedup), ("kept", kept_plan, kept_dedup)):
            fp = dedup.instance(name).fingerprint
            lowered = lower(plan, dedup, fp)
            side = {"fingerprint": fp[:16], **_onnx_check(precision, lowered.onnx, kept)}
            if not dry_run:
                for step, call in (
                    ("network", lambda lw=lowered: _network(backend, lw)),
                    ("build", lambda lw=lowered, pl=plan, n=name: _build(backend, lw, pl, n)),
                    (
                        "inspector",
                        lambda lw=lowered, pl=plan, n=name: _inspect(
                            backend, lw, pl.options.build_settings(n)
                        ),
                    ),
                ):
                    try:
                        side[step] = call()
                    except Exception as exc:
                        side[step] = {
                            "error": f"{type(exc).__name__}: {exc}"[:2000],
                            "traceback": traceback.format_exc()[-2000:],
                        }
            entry[label] = side
        entry["checks"] = _checks(precision, entry, dry_run)
        out["partitions"][name] = entry
    return out


def _build(backend, lowered, plan, name: str) -> dict:
    start = time.perf_counter()
    engine = backend.build(lowered.onnx, lowered.io, plan.options.build_settings(name), partition=name)
    return {"engine_bytes": len(engine), "seconds": round(time.perf_counter() - start, 2)}


def _checks(precision: str, entry: dict, dry_run: bool) -> dict:
    plain, kept = entry["plain"], entry["kept"]
    checks = {"fingerprint_differs": plain["fingerprint"] != kept["fingerprint"]}
    if precision == "int8":
        kept_float, plain_float = (side.get("kept_gemms_read_no_dequantize", {}) for side in (kept, plain))
        checks["kept_gemms_read_no_dequantize"] = bool(kept_float) and all(kept_float.values())
        # Without the set the same GEMMs are int8 (both operands dequantized): the check above can fail.
        checks["plain_gemms_read_dequantize"] = bool(plain_float) and not any(plain_float.values())
    else:
        fp32_norms = kept["onnx_op_input_types"].get("LayerNormalization:FLOAT", 0)
        checks["onnx_kept_layernorms_fp32"] = fp32_norms > 0 and not plain["onnx_op_input_types"].get(
            "LayerNormalization:FLOAT"
        )
    if not dry_run:
        checks["built"] = "error" not in kept.get("build", {"error": 1})
        if precision != "int8":
            net = kept.get("network", {}).get("layer_output_types", {})
            plain_net = plain.get("network", {}).get("layer_output_types", {})
            float_kept = sum(v for k, v in net.items() if k.endswith(":FLOAT"))
            float_plain = sum(v for k, v in plain_net.items() if k.endswith(":FLOAT"))
            checks["network_more_fp32_layers_with_the_set"] = float_kept > float_plain
    return checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--backend", default="tensorrt-rtx", choices=["tensorrt-rtx", "tensorrt"])
    parser.add_argument("--precisions", nargs="*", default=["fp16", "int8"])
    parser.add_argument("--dry-run", action="store_true", help="no TensorRT: lowering and ONNX checks only")
    args = parser.parse_args()
    backend = None
    if not args.dry_run:
        from compiler.backends.tensorrt.builder import TensorRTBackend

        backend = TensorRTBackend(args.backend)
    case = zoo.tiny_bert(num_layers=2, hidden=64)
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    started = time.perf_counter()
    results = {}
    for precision in args.precisions:
        try:
            results[precision] = prove(program, precision, backend, args.dry_run)
        except Exception as exc:
            results[precision] = {
                "error": f"{type(exc).__name__}: {exc}"[:2000],
                "traceback": traceback.format_exc()[-3000:],
            }
    failed = [
        f"{precision}/{name}: {check}"
        for precision, res in results.items()
        for name, entry in res.get("partitions", {}).items()
        for check, ok in entry["checks"].items()
        if not ok
    ] + [f"{p}: {r['error']}" for p, r in results.items() if "error" in r]
    payload = {
        "library": f"{backend.name} {backend.library_version()}" if backend else None,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "seconds": round(time.perf_counter() - started, 1),
        "failed": failed,
        "results": results,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1, sort_keys=True, default=str))
    print(
        json.dumps(
            {
                "failed": failed,
                **{
                    p: {n: e["checks"] for n, e in r.get("partitions", {}).items()}
                    for p, r in results.items()
                },
            },
            indent=1,
        )
    )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
