"""GPU runtime benchmark (issues 15 and 20): eager vs torch.compile vs kiln's Inductor backend on one GPU.

For BERT-base (12 layers x 768, sequence 128, batch 1..8 dynamic) and the fallback model (12 blocks of
1024 wide with a custom op in each, which stays in PyTorch between engines), in fp32 and fp16, at batch
1, 8 and 5 (with ``--profiles 1,8`` kiln compiles batch 1 and 8 as shape profiles: Inductor's static
specialization per profile serves them, the dynamic engine serves batch 5; without, every batch is
served by the dynamic engines): latency of eager PyTorch, ``torch.compile`` default and
``mode="reduce-overhead"``, kiln ``inductor`` over the whole graph and split per block with dedup
(``--skip-split``: whole only), each with CUDA graphs (the default, ``cuda_graphs="auto"``) and without;
compile times; and for BERT-base fp16 (whole graph) the fresh process's load to first answer, trusted,
untrusted (engines compiled from their programs) and untrusted a second time (what the first kept in the
local engine cache), with where the trusted load's time goes (cProfile). Timings are interleaved
(``compiler.validation.validate.measure_latency``, synchronised). Every compile gets a fresh Inductor cache
directory, so compile times are cold on disk. Results are written after every step, so a run cut short
leaves what it measured.

    python3 benchmarks/gpu_runtime.py --out benchmarks/results/gpu_runtime_h100.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.export import Dim
from torch.utils import _pytree as pytree

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import compiler
from benchmarks._common import print_table
from benchmarks.gpu_cold_start import RUNS
from benchmarks.machine import cpu_model
from compiler.device import to_device
from compiler.validation.validate import measure_latency
from zoo import models as zoo

RESULT = Path(__file__).resolve().parent / "results" / "gpu_runtime_h100.json"


def bert_base() -> zoo.ModelCase:
    case = zoo.tiny_bert(num_layers=12, hidden=768, seq_len=128)
    batch = Dim("batch", min=1, max=8)
    case.dynamic_shapes = {"input_ids": {0: batch}, "attention_mask": {0: batch}}
    return case


def fallback_model() -> zoo.ModelCase:
    return zoo.repeated_fallback(depth=12, width=1024)


MODELS = {"bert_base": bert_base, "fallback": fallback_model}
SMOKE = {"mlp": zoo.mlp_with_fallback}  # a quick check of this script on any machine (--models mlp)


def fresh_inductor_cache() -> None:
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="kiln-bench-inductor-")


def at_batch(case: zoo.ModelCase, batch: int, half: bool) -> tuple[tuple, dict]:
    """The example inputs with their batch axis set to ``batch`` (ids cycle; floats are redrawn)."""

    def resize(t: torch.Tensor) -> torch.Tensor:
        t = t[:1].expand(batch, *t.shape[1:]).contiguous() if t.shape[0] != batch else t
        return t.half() if half and t.is_floating_point() else t

    return pytree.tree_map_only(torch.Tensor, resize, (tuple(case.args), dict(case.kwargs)))


def first_leaf(out: object) -> torch.Tensor:
    return pytree.tree_leaves(out)[0]


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, *args, **kwargs) -> tuple[object, float]:
    sync()
    start = time.perf_counter()
    result = fn(*args, **kwargs)
    sync()
    return result, time.perf_counter() - start


def trt_rtx_available(device: str) -> bool:
    try:
        import tensorrt_rtx  # noqa: F401
    except ImportError:
        return False
    return device.startswith("cuda")


def trt_rtx_builds(program, device: str, precision: str) -> dict:
    """TensorRT-RTX build seconds: split per block with dedup and without, and the whole graph. No
    engine cache, so every build is real (TensorRT's timing cache is off too: cache_dir None)."""
    from compiler.options import CompileOptions

    rows: dict = {}
    for label, split, share in (
        ("trt_rtx_split_dedup", "auto", True),
        ("trt_rtx_split_no_dedup", "auto", False),
        ("trt_rtx_whole", None, True),
    ):
        options = CompileOptions(
            backend="tensorrt-rtx", device=device, precision=precision, split_modules=split
        )
        plan = compiler.partition(program, options)
        unique = compiler.dedup(plan, share=share)
        start = time.perf_counter()
        artifacts = [compiler.build_engine(plan, unique, fp, cache=False) for fp in unique.fingerprints]
        rows[f"{label}_build_s"] = round(time.perf_counter() - start, 2)
        rows[f"{label}_builds"] = len(artifacts)
        rows[f"{label}_failed"] = sum(not a.is_engine for a in artifacts)
    dedup_s, no_dedup_s = rows["trt_rtx_split_dedup_build_s"], rows["trt_rtx_split_no_dedup_build_s"]
    rows["trt_rtx_dedup_over_no_dedup"] = round(dedup_s / no_dedup_s, 3) if no_dedup_s else None
    return rows


def without_graphs(module: compiler.CompiledModule) -> compiler.CompiledModule:
    """The same engines assembled with ``cuda_graphs="off"`` (no recompile: engines are kept per process)."""
    plan = copy.copy(module.plan)
    plan.options = dataclasses.replace(plan.options, cuda_graphs="off")
    return compiler.assemble(plan, module.dedup, module.engines, report=module.report)


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    device = args.device
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else "none"
    results: dict = {
        "machine": {
            "gpu": gpu,
            "host_cpu": cpu_model(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
        },
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
        "rows": [],
        "compile_seconds": [],
        "not_measured": [],
    }
    out = Path(args.out)

    def write() -> None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2, sort_keys=True))

    if args.cold_start_only:  # the load to first answer alone (first model, --cold-start-precision)
        from benchmarks.gpu_cold_start import load_to_first_answer

        case = {**MODELS, **SMOKE}[args.models[0]]()
        model, case.args, case.kwargs = to_device(case.model, case.args, case.kwargs, device=device)
        program = compiler.export(model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
        started_compile = time.perf_counter()
        module = compiler.compile(
            program,
            backend="inductor",
            device=device,
            precision=args.cold_start_precision,
            cache=False,
            backend_options={"aot": True} if args.aot else {},
        )
        compile_s = round(time.perf_counter() - started_compile, 2)
        runs = tuple(args.cold_start_runs.split(","))
        results["load_to_first_answer_s"] = load_to_first_answer(module, case, out.parent, device, runs)
        results["load_to_first_answer_s"].update(aot=args.aot, compile_s=compile_s)
        write()
        return results
    plan = [(m, p) for m in args.models for p in args.precisions]
    for index, (name, precision) in enumerate(plan):
        if time.perf_counter() - started > args.budget_s:
            results["not_measured"] += [f"{m} {p}: time budget spent" for m, p in plan[index:]]
            break
        case = {**MODELS, **SMOKE}[name]()
        model, case.args, case.kwargs = to_device(case.model, case.args, case.kwargs, device=device)
        half = precision == "fp16"
        eager = copy.deepcopy(model).half() if half else model
        torch._dynamo.reset()
        fresh_inductor_cache()
        compile_rows = {"model": name, "precision": precision}
        compiled_tc = {}
        for label, mode in (
            ("torch_compile", "default"),
            ("torch_compile_reduce_overhead", "reduce-overhead"),
        ):
            compiled_tc[label] = torch.compile(copy.deepcopy(eager), mode=mode)
            with torch.no_grad():
                for batch in args.batches:  # first call per batch compiles (static, then dynamic)
                    a, k = at_batch(case, batch, half)
                    _, seconds = timed(compiled_tc[label], *a, **k)
                    compile_rows[f"{label}_first_call_batch{batch}_s"] = round(seconds, 2)
        program = compiler.export(model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
        kiln = {}
        variants = (("kiln_whole", None),) + (() if args.skip_split else (("kiln_split_dedup", "auto"),))
        for label, split in variants:
            fresh_inductor_cache()
            start = time.perf_counter()
            module = compiler.compile(
                program,
                backend="inductor",
                device=device,
                precision=precision,
                split_modules=split,
                cache=False,
                profiles=[{"batch": b} for b in args.profiles],
            )
            compile_rows[f"{label}_build_s"] = round(time.perf_counter() - start, 2)
            compile_rows[f"{label}_partitions"] = len(module.report.partitions)
            compile_rows[f"{label}_unique"] = module.report.unique_fingerprints
            compile_rows[f"{label}_cuda_graph_check"] = module.report.cuda_graphs
            compile_rows[f"{label}_profiles"] = module.report.profiles  # latency and dispatch per profile
            compile_rows[f"{label}_build_failures"] = [
                {"partitions": f["partitions"], "error": f["error"][:2000]}
                for f in module.report.build_failures
            ]
            kiln[f"{label}_cuda_graphs"] = module
            kiln[f"{label}_no_graphs"] = without_graphs(module)
        whole, split = compile_rows["kiln_whole_build_s"], compile_rows.get("kiln_split_dedup_build_s")
        compile_rows["split_over_whole_compile"] = round(split / whole, 3) if whole and split else None
        first = compile_rows.get(f"torch_compile_first_call_batch{args.batches[0]}_s")
        compile_rows["kiln_whole_over_torch_compile_first_call"] = round(whole / first, 3) if first else None
        results["compile_seconds"].append(compile_rows)
        write()
        with torch.no_grad():
            for batch in args.batches:
                a, k = at_batch(case, batch, half)
                a32, k32 = at_batch(case, batch, False)
                reference = first_leaf(model(*a32, **k32)).float()
                fns = {
                    "eager": lambda a=a, k=k, f=eager: f(*a, **k),
                    **{label: (lambda a=a, k=k, f=f: f(*a, **k)) for label, f in compiled_tc.items()},
                    **{label: (lambda m=m, a=a32, k=k32: m(*a, **k)) for label, m in kiln.items()},
                }
                errors = {}
                for label, fn in fns.items():
                    got = first_leaf(fn()).float()
                    errors[label] = float((got - reference).norm() / reference.norm())
                latency = measure_latency(fns, warmup=args.warmup, runs=args.runs)
                ms = {label: round(lat.median_ms, 4) for label, lat in latency.items()}
                ro = ms["torch_compile_reduce_overhead"]
                row = {
                    "model": name,
                    "precision": precision,
                    "batch": batch,
                    # The names: kiln whole graph, with and without CUDA graphs.
                    "torch_compile_reduce_overhead_ms": ro,
                    "kiln_cuda_graphs_ms": ms["kiln_whole_cuda_graphs"],
                    "kiln_no_graphs_ms": ms["kiln_whole_no_graphs"],
                    **{f"{label}_ms": v for label, v in ms.items()},
                    **{f"{label}_p95_ms": round(lat.p95_ms, 4) for label, lat in latency.items()},
                    "rel_l2_vs_eager_fp32": {label: round(e, 6) for label, e in errors.items()},
                }
                for label in kiln:
                    row[f"{label}_over_reduce_overhead"] = round(ms[label] / ro, 3)
                for part in [v for v, _ in variants]:
                    row[f"{part}_graphs_over_no_graphs"] = round(
                        ms[f"{part}_cuda_graphs"] / ms[f"{part}_no_graphs"], 3
                    )
                results["rows"].append(row)
                print(json.dumps({k: v for k, v in row.items() if not k.endswith("p95_ms")}), flush=True)
                write()
        if args.trt_rtx and trt_rtx_available(device):
            compile_rows.update(trt_rtx_builds(program, device, precision))
            write()
        if args.cold_start and (name, precision) == (args.models[0], args.cold_start_precision):
            from benchmarks.gpu_cold_start import load_to_first_answer

            results["load_to_first_answer_s"] = load_to_first_answer(
                kiln["kiln_whole_cuda_graphs"], case, Path(args.out).parent, device
            )
            write()
        kiln.clear()
        compiled_tc.clear()
        torch._dynamo.reset()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    results["wall_seconds"] = round(time.perf_counter() - started, 1)
    write()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(RESULT))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--models", type=lambda s: s.split(","), default=list(MODELS))
    parser.add_argument("--precisions", type=lambda s: s.split(","), default=["fp16", "fp32"])
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8, 5])
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument("--trt-rtx", action="store_true", help="TensorRT-RTX build times too")
    parser.add_argument(
        "--cold-start", action="store_true", help="fresh-process load to first answer (first model)"
    )
    parser.add_argument("--cold-start-precision", default="fp16")
    parser.add_argument("--cold-start-only", action="store_true", help="only the load to first answer")
    parser.add_argument(
        "--aot",
        action="store_true",
        help="cold start with AOTInductor engines (backend_options aot)",
    )
    parser.add_argument(
        "--cold-start-runs",
        default=",".join(RUNS),
        help=f"which fresh-process loads --cold-start-only measures (comma-separated, of {RUNS})",
    )
    parser.add_argument(
        "--profiles",
        type=lambda s: [int(b) for b in s.split(",") if b],
        default=[],
        help="batch sizes kiln compiles as shape profiles (Inductor static specializations), e.g. 1,8",
    )
    parser.add_argument("--skip-split", action="store_true", help="kiln over the whole graph only")
    parser.add_argument(
        "--budget-s", type=float, default=480.0, help="start no new (model, precision) after this"
    )
    results = run(parser.parse_args())
    print_tables(results)


def print_tables(results: dict) -> None:
    kinds = (
        "eager",
        "torch_compile",
        "torch_compile_reduce_overhead",
        "kiln_whole_cuda_graphs",
        "kiln_whole_no_graphs",
        "kiln_split_dedup_cuda_graphs",
        "kiln_split_dedup_no_graphs",
    )
    print_table(
        "latency, ms (x torch.compile reduce-overhead)",
        ["model", "prec", "batch", "eager", "tc", "tc r-o", "kiln graphs", "kiln", "split graphs", "split"],
        [
            [r["model"], r["precision"], r["batch"]]
            + [
                f"{r[f'{k}_ms']:.2f}"
                + (f" ({r[f'{k}_over_reduce_overhead']:.2f}x)" if k.startswith("kiln") else "")
                if f"{k}_ms" in r
                else "-"
                for k in kinds
            ]
            for r in results["rows"]
        ],
    )
    print_table(
        "compile, s",
        ["model", "prec", "tc first call", "kiln whole", "kiln split", "whole/tc first"],
        [
            [
                r["model"],
                r["precision"],
                r.get(f"torch_compile_first_call_batch{1}_s"),
                r.get("kiln_whole_build_s"),
                r.get("kiln_split_dedup_build_s"),
                r.get("kiln_whole_over_torch_compile_first_call"),
            ]
            for r in results["compile_seconds"]
        ],
    )
    if "load_to_first_answer_s" in results:
        print("\nload to first answer, s:", json.dumps(results["load_to_first_answer_s"]))


if __name__ == "__main__":
    main()
