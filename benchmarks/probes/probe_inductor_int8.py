"""Probe: int8 through torchao's PT2E flow and Inductor on the CPU, before kiln builds it (issue 19's
Inductor row). Measures, on the GPU machine's AMX/VNNI host, what kiln's Inductor engines would get:

* fp32: ``torch.compile`` (Inductor, freezing on: weights are constants, as the oneDNN paths want);
* int8 frozen: ``prepare_pt2e`` with ``X86InductorQuantizer``'s default (static, per-channel
  weights), calibrated on 8 samples, ``convert_pt2e``, then ``torch.compile`` with freezing on;
* int8 unfrozen: the same graph with freezing off. kiln's engines take weights as inputs (refit,
  stripping, dedup); this row says what int8 is worth without constant weights.

Per model and batch: latency (median of interleaved runs), ratio to fp32, rel L2 vs eager fp32,
compile seconds, and how many quantize/dequantize nodes the converted graph holds. Writes
$OUT/probe_inductor_int8.json (or argv[1]).

Found on the GPU machine's host (torch 2.11, 4 threads): the quantizer annotated nothing. With
torchao 0.17 (``probe_inductor_int8.h100host.json``: BERT 2 layers, ResNet-50) and 0.18 alike, the
converted graphs hold 0 quantize/dequantize nodes (of 103 and 122), their outputs equal fp32's (rel
L2 4e-7), and every int8 row runs at 0.95-1.02x fp32. The same function on the 2-core machine (torch
2.13, torchao 0.18) annotates a BERT layer (22 quantize/dequantize nodes of 95, rel L2 0.015).

Cause, found next: the quantizer finds linear and convolution nodes with torch's
``get_source_partitions``, which reads ``source_fn_stack``. Non-strict ``torch.export`` records none;
torch 2.13 falls back to ``nn_module_stack``, torch 2.11 does not, so there nothing matched. kiln's
Inductor int8 (``compiler/quantization/pt2e.py``) names each node's functional source itself, which
works on both (``benchmarks/results/quantization_gpu_host_inductor*.json``). This probe keeps its
first form: it records what the quantizer does with a plain export.

    python3 benchmarks/probes/probe_inductor_int8.py [OUT.json] [--models bert,resnet50] [--threads 4]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import interleaved
from benchmarks.quantization import bert_case, cpu_info, resnet50_case


def rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))


def quantized(model: torch.nn.Module, kwargs: dict, calibration: list[dict]) -> torch.nn.Module:
    import torchao.quantization.pt2e.quantizer.x86_inductor_quantizer as xiq
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    exported = torch.export.export(model, (), kwargs).module()
    quantizer = xiq.X86InductorQuantizer().set_global(xiq.get_default_x86_inductor_quantization_config())
    prepared = prepare_pt2e(exported, quantizer)
    for sample in calibration:
        prepared(**sample)
    return convert_pt2e(prepared)


def compiled(module: torch.nn.Module, kwargs: dict, freezing: bool) -> tuple[torch.nn.Module, float]:
    import torchao.quantization.pt2e.inductor_passes.x86  # noqa: F401 - registers the int8 lowerings

    torch._dynamo.reset()
    start = time.perf_counter()
    with torch._inductor.config.patch(freezing=freezing):
        fn = torch.compile(module)
        fn(**kwargs)
    return fn, time.perf_counter() - start


def probe(name: str, case, batches: tuple[int, ...], runs: int) -> dict:
    model, _, _, _, inputs, _ = case
    generator = torch.Generator().manual_seed(0)
    out: dict = {}
    for batch in batches:
        data = inputs(9, batch, generator)
        kwargs = {k: v[0] for k, v in data.items()}
        calibration = [{k: v[i] for k, v in data.items()} for i in range(1, 9)]
        with torch.no_grad():
            reference = model(**kwargs)
            variants, seconds = {}, {}
            variants["fp32"], seconds["fp32"] = compiled(model, kwargs, freezing=True)
            int8 = quantized(model, kwargs, calibration)
            # What the quantizer put in: an unannotated graph has no quantize/dequantize nodes.
            ops = [str(n.target) for n in int8.graph.nodes if n.op == "call_function"]
            quant_ops = sum("quantize" in op for op in ops)
            variants["int8 frozen"], seconds["int8 frozen"] = compiled(int8, kwargs, freezing=True)
            variants["int8 unfrozen"], seconds["int8 unfrozen"] = compiled(int8, kwargs, freezing=False)
            timing = interleaved(
                {v: (lambda f=f, x=kwargs: f(**x)) for v, f in variants.items()}, warmup=2, runs=runs
            )
            row = {}
            for variant, fn in variants.items():
                row[variant] = {
                    "median_ms": timing[variant]["median_ms"],
                    "vs_fp32": timing[variant]["median_ms"] / timing["fp32"]["median_ms"],
                    "rel_l2": rel_l2(fn(**kwargs), reference),
                    "compile_s": round(seconds[variant], 1),
                }
        out[f"b{batch}"] = {**row, "quantize_dequantize_nodes": quant_ops, "nodes": len(ops)}
        ratios = {v: (round(r["vs_fp32"], 3), f"{r['rel_l2']:.1e}") for v, r in row.items()}
        print(name, batch, ratios, f"q/dq nodes {quant_ops} of {len(ops)}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "out", nargs="?", default=str(Path(os.environ.get("OUT", ".")) / "probe_inductor_int8.json")
    )
    parser.add_argument("--models", default="bert,resnet50")
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    import torchao

    cases = {"bert": lambda: bert_case(args.layers), "resnet50": resnet50_case}
    results: dict = {
        "cpu": cpu_info(),
        "torch": torch.__version__,
        "torchao": torchao.__version__,
        "threads": args.threads,
        "bert_layers": args.layers,
        "platform": platform.platform(),
        "models": {},
    }
    for name in args.models.split(","):
        try:
            results["models"][name] = probe(name, cases[name](), (1, 8), args.runs)
        except Exception as exc:  # a probe: the failure is the finding
            results["models"][name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(name, "ERROR", results["models"][name]["error"][:500], flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    print("wrote", args.out)


if __name__ == "__main__":
    main()
