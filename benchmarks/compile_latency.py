"""Compiler core benchmark: eager vs kiln-compiled vs whole-model ONNX Runtime, batch 1 and 8.

Targets (issue: compiler core): compiled <= 1.05x whole-model ONNX Runtime and <= 0.8x eager at
batch 1 on CPU. Run: python benchmarks/compile_latency.py [--runs N] [--models a,b]
"""

from __future__ import annotations

import argparse
import io
import sys
import time
import warnings
from pathlib import Path

import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import compiler
from benchmarks._common import interleaved, print_table, write_json
from zoo.models import FACTORIES

# Realistic small sizes (MiniLM, DeiT-small, ResNet-18, DistilGPT-2 class): per-call overhead shows at
# its true weight, not against a toy that computes nothing.
MODELS = ["small_bert", "small_vit", "small_resnet", "small_gpt2", "mlp_with_fallback"]


def whole_model_session(case) -> tuple[ort.InferenceSession, list[str]]:
    """The model exported as one ONNX graph, the reference an engine-per-partition compile must match."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            case.model,
            case.args,
            kwargs=case.kwargs,
            dynamo=True,
            dynamic_shapes=case.dynamic_shapes,
            external_data=False,
            verbose=False,
        )
    buffer = io.BytesIO()
    program.save(buffer)
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    session = ort.InferenceSession(buffer.getvalue(), options, providers=["CPUExecutionProvider"])
    return session, [i.name for i in session.get_inputs()]


def inputs_at(compiled, batch: int) -> list[torch.Tensor]:
    from compiler.inputs.data import sample_inputs

    specs = [
        compiler.InputSpec(
            s.name,
            s.dtype,
            s.min_shape,
            tuple(batch if a == 0 and 0 in s.dynamic_dims else d for a, d in enumerate(s.opt_shape)),
            s.max_shape,
            s.dynamic_dims,
            s.value_range,
        )
        for s in compiled.input_specs
    ]
    return sample_inputs(specs, "opt", torch.Generator().manual_seed(0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args()
    rows, results = [], []
    for name in args.models.split(","):
        case = FACTORIES[name]()
        start = time.perf_counter()
        program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
        export_s = time.perf_counter() - start
        compiled = compiler.compile(program, cache=False)
        stages = {"export": round(export_s, 3), **compiled.report.stage_seconds}
        try:
            session, names = whole_model_session(case)
        except (
            Exception
        ) as exc:  # a model with an op ONNX lacks has no whole-model reference: that is the point
            session, names = None, []
            print(f"{name}: no whole-model ONNX Runtime reference ({type(exc).__name__})")
        for batch in (1, 8):
            flat = inputs_at(compiled, batch)
            call_args, call_kwargs = torch.utils._pytree.tree_unflatten(flat, program.call_spec.in_spec)
            fns = {
                "eager": lambda a=call_args, k=call_kwargs, m=case.model: m(*a, **k),
                "compiled": lambda a=call_args, k=call_kwargs, c=compiled: c(*a, **k),
            }
            if session is not None:
                feed = {n: t.numpy() for n, t in zip(names, flat, strict=True)}
                fns["onnxruntime"] = lambda f=feed, s=session: s.run(None, f)
            timing = interleaved(fns, runs=args.runs)
            eager, comp = timing["eager"]["median_ms"], timing["compiled"]["median_ms"]
            whole = timing["onnxruntime"]["median_ms"] if session is not None else None
            row = {
                "model": name,
                "batch": batch,
                "eager_ms": eager,
                "compiled_ms": comp,
                "whole_ort_ms": whole,
                "compiled_vs_ort": comp / whole if whole else None,
                "compiled_vs_eager": comp / eager,
                "partitions": len(compiled.report.partitions),
                "stage_seconds": stages,
                "timing": timing,
            }
            results.append(row)
            rows.append(
                [
                    name,
                    batch,
                    eager,
                    comp,
                    whole or "n/a",
                    row["compiled_vs_ort"] or "n/a",
                    row["compiled_vs_eager"],
                    row["partitions"],
                    sum(stages.values()),
                ]
            )
    print_table(
        "kiln compile vs eager vs whole-model ONNX Runtime (CPU, median ms)",
        ["model", "batch", "eager", "compiled", "whole ORT", "comp/ORT", "comp/eager", "parts", "compile s"],
        rows,
    )
    batch1 = [r for r in results if r["batch"] == 1]
    targets = {
        "compiled_vs_ort_batch1_max": max(r["compiled_vs_ort"] for r in batch1 if r["compiled_vs_ort"]),
        "compiled_vs_eager_batch1_max": max(r["compiled_vs_eager"] for r in batch1),
    }
    targets["met"] = (
        targets["compiled_vs_ort_batch1_max"] <= 1.05 and targets["compiled_vs_eager_batch1_max"] <= 0.8
    )
    print(
        f"targets (batch 1): compiled/ORT <= 1.05 -> {targets['compiled_vs_ort_batch1_max']:.3f}; "
        f"compiled/eager <= 0.8 -> {targets['compiled_vs_eager_batch1_max']:.3f}; met: {targets['met']}"
    )
    write_json("compile_latency", {"rows": results, "targets": targets})


if __name__ == "__main__":
    main()
