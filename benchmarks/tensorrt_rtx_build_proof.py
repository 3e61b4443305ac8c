"""Proof on real TensorRT-RTX: every partition of every zoo model parses and builds, full and
weight-stripped, and dedup cuts builds exactly as it does on ONNX Runtime.

Run on a machine with a CUDA GPU and TensorRT-RTX (refittable builds need a GPU; the H100 here can
build but not run TensorRT-RTX engines, whose runtime refuses sm_90):

    python3 benchmarks/tensorrt_rtx_build_proof.py [--out PATH]

For each model, partitioning mode (capability only / one engine per repeated block) and precision
it partitions the program twice (ONNX Runtime's and TensorRT's op tables), compares the plans, and
for each unique TensorRT fingerprint lowers it once and builds it full and stripped. Results go to
``benchmarks/results/tensorrt_rtx_build_proof.json`` (or ``--out``).

``--precisions int8 fp8``: quantized builds (issue 19). Each plan is quantized by kiln's quantizer
with TensorRT's recipe (symmetric Q/DQ; fp8 E4M3) on random calibration inputs: scales from random
data are meaningless for accuracy but give the same graph, which is what a build proves. TensorRT
compiles scales in, so each instance of a block is its own engine, whose quantized weights and float
tensors are marked refittable (and stripped).

``--cpu-aot`` is a dry run without a GPU: partitions with ONNX Runtime's table, builds
non-refittable engines only (TensorRT-RTX compiles those ahead of time on the CPU), no stripping.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
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
from compiler.backends import get_backend
from compiler.backends.base import QUANTIZED_PRECISIONS
from compiler.backends.tensorrt.builder import TensorRTBackend
from compiler.backends.tensorrt.engine_format import decode_engine
from compiler.backends.tensorrt.onnx_rewrites import canonical_initializers
from compiler.engine_build.lower import lower
from compiler.errors import KilnError
from compiler.inputs.data import sample_inputs
from compiler.quantization.quantize import quantize
from zoo import models as zoo

RESULT = Path(__file__).resolve().parent / "results" / "tensorrt_rtx_build_proof.json"

# The test zoo, plus one BERT at a realistic width: in the tiny models an engine's fixed part
# (kernels, graph) outweighs its weights, so only a wide model shows what stripping saves.
MODELS = {
    "tiny_bert": zoo.tiny_bert,
    "tiny_vit": zoo.tiny_vit,
    "tiny_resnet": zoo.tiny_resnet,
    "tiny_gpt2": zoo.tiny_gpt2,
    "mlp_with_fallback": zoo.mlp_with_fallback,
    "repeated_fallback": zoo.repeated_fallback,
    "bert_encoder_768": lambda: zoo.bert_encoder(num_layers=2, hidden=768),
    # BERT-base sized (12 x 768): one engine holds ~340 MB of weights, where the 2% target applies.
    "bert_base_768x12": lambda: zoo.bert_encoder(num_layers=12, hidden=768),
}
MODES = {"capability": None, "blocks": "auto"}
STRIP_TARGET = 0.02
COMPRESS_FULL_MAX = 96 << 20  # xz of bigger plans takes longer than their builds


def _partition_names(plan: compiler.PartitionPlan) -> list[list[str]]:
    return sorted(sorted(p.to_dict().get("nodes", [])) for p in plan.partitions)


def _weight_bytes(model: onnx.ModelProto) -> int:
    names = set(canonical_initializers(model))
    total = 0
    for init in model.graph.initializer:
        if init.name in names:
            count = 1
            for d in init.dims:
                count *= d
            total += count * onnx.helper.tensor_dtype_to_np_dtype(init.data_type).itemsize
    return total


def _build(backend: TensorRTBackend, lowered, settings, name: str) -> dict:
    start = time.perf_counter()
    try:
        engine = backend.build(lowered.onnx, lowered.io, settings, partition=name)
    except KilnError as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:2000], "node": getattr(exc, "node", None)}
    header, plan = decode_engine(engine)
    out = {
        "seconds": round(time.perf_counter() - start, 3),
        "engine_bytes": len(engine),  # what kiln stores: header + plan (xz-compressed when stripped)
        "plan_bytes": len(plan),  # the TensorRT plan itself
        "plan_encoding": header["plan_encoding"],
        "refittable_weights": len(header["weights"]),
    }
    if header["plan_encoding"] == "raw" and len(plan) <= COMPRESS_FULL_MAX:
        # the full plan under the same compression, so stripped vs full can be read at equal footing
        out["plan_xz_bytes"] = len(lzma.compress(plan, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64))
    return out


def prove_case(
    name: str, program, mode: str, precision: str, backend: TensorRTBackend, cpu_aot: bool
) -> dict:
    split = MODES[mode]
    quantized = precision in QUANTIZED_PRECISIONS
    # ONNX Runtime has no fp8: its int8 plan is the one to compare partitions and builds with.
    ort_options = compiler.CompileOptions(
        backend="onnxruntime", precision="int8" if quantized else precision, split_modules=split
    )
    trt_options = compiler.CompileOptions(
        backend="onnxruntime" if cpu_aot else backend.name,
        precision=precision,
        split_modules=split,
        backend_options={"refit": "none"} if cpu_aot else {},
        calibration={"samples": 4, "allow_random": True},
    )
    ort_plan = compiler.partition(program, ort_options)
    ort_dedup = compiler.dedup(ort_plan)
    plan = compiler.partition(program, trt_options)
    if quantized:  # one shape for every sample: ONNX Runtime's fp8 calibrator stacks them
        generator = torch.Generator().manual_seed(0)
        samples = [sample_inputs(plan.specs, "max", generator) for _ in range(4)]
        plan = quantize(plan, {s.name: torch.stack(t) for s, *t in zip(plan.specs, *samples, strict=True)})
    dedup = compiler.dedup(plan)
    out: dict = {
        "onnxruntime": {
            "partitions": len(ort_plan.partitions),
            "unique": len(ort_dedup.fingerprints),
            "fallback_ops": dict(ort_plan.fallback_ops),
        },
        "tensorrt": {
            "partitions": len(plan.partitions),
            "unique": len(dedup.fingerprints),
            "fallback_ops": dict(plan.fallback_ops),
        },
        "quantization": {k: plan.quantization[k] for k in ("partitions", "fallbacks")} if quantized else None,
        "same_partitions_as_onnxruntime": _partition_names(ort_plan) == _partition_names(plan),
        "same_builds_as_onnxruntime": len(ort_dedup.fingerprints) == len(dedup.fingerprints),
        "fingerprints": {},
    }
    full_settings = trt_options.build_settings()
    stripped_settings = compiler.CompileOptions(
        **{**trt_options.to_dict(), "strip_weights": True}
    ).build_settings()
    for fp in dedup.fingerprints:
        rep = dedup.unique[fp]
        entry: dict = {"partition": rep, "instances": len(dedup.instances_of(fp))}
        try:
            lowered = lower(plan, dedup, fp)
        except KilnError as exc:
            entry.update(parsed=False, built=False, error=f"lowering: {type(exc).__name__}: {exc}"[:2000])
            out["fingerprints"][fp] = entry
            continue
        model = onnx.load_model_from_string(lowered.onnx)
        entry.update(
            onnx_ops=sorted({n.op_type for n in model.graph.node}),
            onnx_nodes=len(model.graph.node),
            weight_bytes=_weight_bytes(model),
            lower_seconds=round(lowered.seconds, 3),
        )
        try:
            entry["network_layers"] = backend.parse(lowered.onnx, lowered.io, partition=rep)
            entry["parsed"] = True
        except KilnError as exc:
            entry.update(parsed=False, built=False, error=f"{type(exc).__name__}: {exc}"[:2000])
            entry["node"] = getattr(exc, "node", None)
            out["fingerprints"][fp] = entry
            continue
        entry["full"] = _build(backend, lowered, full_settings, rep)
        if not cpu_aot:
            entry["stripped"] = _build(backend, lowered, stripped_settings, rep)
        builds = [entry["full"], *([entry["stripped"]] if "stripped" in entry else [])]
        entry["built"] = all("error" not in b for b in builds)
        if entry["built"] and "stripped" in entry:
            stripped, full = entry["stripped"], entry["full"]
            entry["stripped_ratio"] = round(stripped["engine_bytes"] / full["engine_bytes"], 5)
            entry["stripped_plan_ratio"] = round(stripped["plan_bytes"] / full["plan_bytes"], 5)
            if "plan_xz_bytes" in full:
                entry["stripped_ratio_equal_compression"] = round(
                    stripped["engine_bytes"] / full["plan_xz_bytes"], 5
                )
            entry["stripped_removed_bytes"] = full["plan_bytes"] - stripped["plan_bytes"]
        errors = [b["error"] for b in builds if "error" in b]
        if errors:
            entry["error"] = errors[0]
            entry["node"] = next((b.get("node") for b in builds if b.get("node")), None)
        out["fingerprints"][fp] = entry
    return out


def summarize(results: dict) -> dict:
    entries = [
        (model, mode, prec, fp, e)
        for model, modes in results.items()
        for mode, precs in modes.items()
        for prec, case in precs.items()
        if isinstance(case, dict) and "fingerprints" in case
        for fp, e in case["fingerprints"].items()
    ]
    failed = [f"{m}/{mo}/{p}/{fp[:12]}" for m, mo, p, fp, e in entries if not e.get("built")]
    ratios = [
        (e["stripped_ratio"], e["weight_bytes"], f"{m}/{mo}/{p}")
        for m, mo, p, _, e in entries
        if "stripped_ratio" in e
    ]
    equal = [
        e["stripped_ratio_equal_compression"] for *_, e in entries if "stripped_ratio_equal_compression" in e
    ]
    cases = [c for modes in results.values() for precs in modes.values() for c in precs.values()]
    cases = [c for c in cases if isinstance(c, dict)]
    export_errors = [f"{m}: {modes['export']['error']}" for m, modes in results.items() if "export" in modes]
    return {
        "unique_partitions_built": sum(1 for *_, e in entries if e.get("built")),
        "unique_partitions": len(entries),
        "every_partition_built": not failed and not export_errors and all("error" not in c for c in cases),
        "export_errors": export_errors,
        "failed": failed,
        "case_errors": [c["error"] for c in cases if "error" in c],
        "stripped_ratio_max": max((r for r, *_ in ratios), default=None),
        "stripped_ratio_target": STRIP_TARGET,
        "stripped_within_target": sum(1 for r, *_ in ratios if r <= STRIP_TARGET),
        "stripped_measured": len(ratios),
        # Stored bytes compare an xz-compressed stripped engine with a raw full one (kiln does not
        # compress weights, which do not compress); at equal footing both plans are compressed.
        "stripped_ratio_equal_compression_max": max(equal, default=None),
        "stripped_within_target_equal_compression": sum(1 for r in equal if r <= STRIP_TARGET),
        "stripped_measured_equal_compression": len(equal),
        "stripped_plan_ratio_max": max(
            (e["stripped_plan_ratio"] for *_, e in entries if "stripped_plan_ratio" in e), default=None
        ),
        "stripped_engine_bytes_max": max(
            (e["stripped"]["engine_bytes"] for *_, e in entries if "stripped_ratio" in e), default=None
        ),
        # the smallest weights at which every engine met the target at equal compression
        "stripped_within_target_equal_compression_from_weight_bytes": _threshold(entries),
        # Stripping removes exactly the canonical weights; what stays is the engine's fixed part
        # (graph and kernels), so the 2% target needs weights >= ~50x that part.
        "stripped_removes_all_weight_bytes": all(
            e["weight_bytes"] - e["stripped_removed_bytes"] <= max(0.01 * e["weight_bytes"], 4096)
            for *_, e in entries
            if "stripped_ratio" in e
        ),
        "stripped_fixed_bytes_max": max(
            (e["stripped"]["plan_bytes"] for *_, e in entries if "stripped_ratio" in e), default=None
        ),
        "stripped_ratio_of_largest_engine": min(
            ((-e["full"]["plan_bytes"], e["stripped_ratio"]) for *_, e in entries if "stripped_ratio" in e),
            default=(None, None),
        )[1],
        "stripped_within_target_when_weights_over_4MB": all(
            r <= STRIP_TARGET for r, w, _ in ratios if w > 4 << 20
        ),
        "dedup_same_as_onnxruntime": all(
            c.get("same_builds_as_onnxruntime") for c in cases if "tensorrt" in c
        ),
        "partitions_same_as_onnxruntime": all(
            c.get("same_partitions_as_onnxruntime") for c in cases if "tensorrt" in c
        ),
        "builds_total": sum(c["tensorrt"]["unique"] for c in cases if "tensorrt" in c),
        "partitions_total": sum(c["tensorrt"]["partitions"] for c in cases if "tensorrt" in c),
    }


def _threshold(entries: list) -> int | None:
    """The least weight bytes W such that every engine with weights >= W met the target at equal
    compression (None when even the largest did not)."""
    measured = sorted(
        (e["weight_bytes"], e["stripped_ratio_equal_compression"] <= STRIP_TARGET)
        for *_, e in entries
        if "stripped_ratio_equal_compression" in e
    )
    threshold = None
    for weight_bytes, ok in reversed(measured):
        if not ok:
            break
        threshold = weight_bytes
    return threshold


def _write(payload: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=out.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as fh:
        json.dump(payload, fh, indent=1, sort_keys=True, default=str)
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)
    print(json.dumps(payload["summary"], indent=1))
    print(f"wrote {out}")


def merge(paths: list[Path], out: Path) -> None:
    """One result from runs over model subsets (each GPU call has a 10-minute limit), which must
    agree on library, GPU and versions."""
    parts = [json.loads(p.read_text()) for p in paths]
    same = ("library", "gpu", "capability", "torch", "onnx", "cpu_aot_dry_run", "target_device")
    for part in parts[1:]:
        diff = [k for k in same if part[k] != parts[0][k]]
        if diff:
            raise SystemExit(f"cannot merge runs that differ in {diff}")
    models = {name: res for part in parts for name, res in part["models"].items()}
    payload = {**parts[0], "models": models, "seconds": round(sum(p["seconds"] for p in parts), 1)}
    payload["runs"] = len(parts)
    payload["summary"] = summarize(models)
    _write(payload, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULT)
    parser.add_argument("--models", nargs="*", default=list(MODELS))
    parser.add_argument("--precisions", nargs="*", default=["fp32", "fp16"])
    parser.add_argument("--modes", nargs="*", default=list(MODES))
    parser.add_argument("--cpu-aot", action="store_true", help="dry run without a GPU (see module doc)")
    parser.add_argument(
        "--merge", nargs="*", type=Path, help="combine result files of runs over model subsets"
    )
    args = parser.parse_args()
    if args.merge:
        merge(args.merge, args.out)
        return

    backend = (
        TensorRTBackend("tensorrt-rtx", require_gpu=False) if args.cpu_aot else get_backend("tensorrt-rtx")
    )
    fp8_backend = (
        TensorRTBackend("tensorrt-rtx", compute_capabilities=("sm_89",)) if "fp8" in args.precisions else None
    )
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    try:
        backend.check_runnable()
        runnable = "yes"
    except KilnError as exc:
        runnable = f"no: {exc}"
    started = time.perf_counter()
    results: dict = {}
    for name in args.models:
        results[name] = {}
        try:
            case = MODELS[name]()
            program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
        except Exception as exc:  # a zoo model that cannot export is a result, not a crash
            results[name] = {"export": {"error": f"{type(exc).__name__}: {exc}"[:2000]}}
            continue
        for mode in args.modes:
            results[name][mode] = {}
            for precision in args.precisions:
                t0 = time.perf_counter()
                try:
                    # fp8 needs FP8 tensor cores: TensorRT-RTX's default targets (sm_80, sm_86) have none.
                    builder = fp8_backend if precision == "fp8" and not args.cpu_aot else backend
                    res = prove_case(name, program, mode, precision, builder, args.cpu_aot)
                except Exception as exc:
                    res = {
                        "error": f"{type(exc).__name__}: {exc}",
                        "traceback": traceback.format_exc()[-3000:],
                    }
                res["seconds"] = round(time.perf_counter() - t0, 2)
                results[name][mode][precision] = res
                built = sum(1 for e in res.get("fingerprints", {}).values() if e.get("built"))
                print(
                    f"{name:18s} {mode:10s} {precision}: "
                    f"partitions {res.get('tensorrt', {}).get('partitions')}"
                    f" unique {len(res.get('fingerprints', {}))} built {built} ({res['seconds']} s)"
                    + (f" ERROR {res['error'][:300]}" if "error" in res else ""),
                    flush=True,
                )
    payload = {
        "library": f"{backend.name} {backend.library_version()}",
        "gpu": gpu,
        "capability": "sm_{}{}".format(*torch.cuda.get_device_capability()) if gpu else None,
        "engines_runnable_here": runnable,
        "target_device": backend.engine_target(),
        "cpu_aot_dry_run": args.cpu_aot,
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "python": platform.python_version(),
        "seconds": round(time.perf_counter() - started, 1),
        "summary": summarize(results),
        "models": results,
    }
    _write(payload, args.out)


if __name__ == "__main__":
    main()
