"""Quantization on Inductor, CUDA (issue 19): fp32 vs bf16 vs int8 vs fp8 (torchao's dynamic rowwise
recipes as ATen ops, ``compiler.quantization.rowwise``) for a BERT-base-sized classifier split per layer.

Per variant: latency at batch 1, 8 and 32 (median, interleaved in one run, CUDA graphs as kiln's runtime
replays them by default), package bytes (weight-stripped engines: the weights each variant ships), top-1
agreement and rel L2 vs eager fp32 on held-out samples, compile seconds. The GPU and the host CPU are
named in the JSON.

Run (a GPU of compute capability 8.9+ for fp8):
    python -m benchmarks.quantization_cuda [--layers 12] [--variants fp32,bf16,int8,fp8] [--out NAME]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import compiler
from benchmarks._common import interleaved, print_table, write_json
from benchmarks.quantization import bert_case, cpu_info

BATCHES = (1, 8, 32)  # low-precision GEMMs pay with the rows they multiply: batch x 128 tokens
VARIANTS = {
    "fp32": {},
    "bf16": {"precision": "bf16"},
    "int8": {"precision": "int8", "quantization": "dynamic"},
    "fp8": {"precision": "fp8", "quantization": "dynamic"},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12, help="BERT layers (12 = BERT-base)")
    parser.add_argument("--validation", type=int, default=16, help="held-out samples")
    parser.add_argument("--runs", type=int, default=30, help="timed runs per variant and batch")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="fp32 and bf16 first")
    parser.add_argument("--out", default="quantization_cuda_h100", help="results/<out>.json")
    args = parser.parse_args()
    chosen = args.variants.split(",")
    if chosen[:2] != ["fp32", "bf16"] or not set(chosen) <= set(VARIANTS):
        parser.error(f"--variants: fp32,bf16 then any of {', '.join(VARIANTS)}")
    model, kwargs, shapes, split, inputs, sample_batch = bert_case(args.layers, max_batch=max(BATCHES))
    model = model.cuda()
    program = compiler.export(model, (), {k: v.cuda() for k, v in kwargs.items()}, dynamic_shapes=shapes)
    generator = torch.Generator().manual_seed(1)
    held_out = {k: v.cuda() for k, v in inputs(args.validation, sample_batch, generator).items()}
    base = compiler.CompileOptions(backend="inductor", device="cuda", split_modules=split, strip_weights=True)
    variants: dict[str, compiler.CompiledModule] = {}
    seconds: dict[str, float] = {}
    for name in chosen:
        settings = VARIANTS[name]
        start = time.perf_counter()
        variants[name] = compiler.compile(program, dataclasses.replace(base, **settings), cache=False)
        seconds[name] = time.perf_counter() - start
        print(name, "compiled in", round(seconds[name], 1), "s", flush=True)
    batches = {b: {k: v[0].cuda() for k, v in inputs(1, b, generator).items()} for b in BATCHES}
    latency = {
        b: interleaved({v: (lambda c=c, x=x: c(**x)) for v, c in variants.items()}, warmup=5, runs=args.runs)
        for b, x in batches.items()
    }
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-cuda-quant-bench-") as tmp:
        for name, compiled in variants.items():
            report = compiler.validate(model, compiled, data=held_out, warmup=0, runs=1)
            # without the float weights only quantized engines read (what kiln zoo publishes)
            package = compiler.save(compiled, Path(tmp) / f"{name}.kiln", int8_weights_only=True)
            rows.append(
                {
                    "variant": name,
                    **{f"latency_ms_b{b}": latency[b][name]["median_ms"] for b in BATCHES},
                    "package_bytes": package.bytes,
                    "top1_agreement": report.min_top1_agreement,
                    "rel_l2": report.max_rel_l2,
                    "unique_engines": compiled.report.unique_fingerprints,
                    "fallbacks": (compiled.report.quantization or {}).get("fallbacks", {}),
                    "compile_seconds": round(seconds[name], 1),
                }
            )
    keys = [*(f"latency_ms_b{b}" for b in BATCHES), "package_bytes"]
    for row in rows:
        for key in keys:
            row[f"{key}_vs_fp32"] = row[key] / rows[0][key]
            row[f"{key}_vs_bf16"] = row[key] / rows[1][key]
    print_table(
        f"Quantization on Inductor ({torch.cuda.get_device_name()}; BERT {args.layers} layers, sequence 128)",
        [
            "variant",
            *(f"b{b} ms" for b in BATCHES),
            *(f"b{b} vs bf16" for b in BATCHES),
            "pkg vs fp32",
            "top-1",
            "rel L2",
            "engines",
        ],
        [
            [
                r["variant"],
                *(r[k] for k in keys[:-1]),
                *(r[f"{k}_vs_bf16"] for k in keys[:-1]),
                r["package_bytes_vs_fp32"],
                r["top1_agreement"],
                r["rel_l2"],
                r["unique_engines"],
            ]
            for r in rows
        ],
    )
    write_json(
        args.out,
        {
            "gpu": torch.cuda.get_device_name(),
            "capability": list(torch.cuda.get_device_capability()),
            "cpu": cpu_info(),
            "torch": torch.__version__,
            "bert_layers": args.layers,
            "validation_samples": args.validation,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
