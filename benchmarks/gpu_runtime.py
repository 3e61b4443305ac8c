"""GPU runtime benchmark (issue 15): eager vs torch.compile vs kiln's Inductor backend on one GPU.

For BERT-base (12 layers x 768, sequence 128, batch 1..8 dynamic) and the fallback model (12 blocks of
1024 wide with a custom op in each, which stays in PyTorch between engines), in fp32 and fp16, at batch
1 and 8: latency of eager PyTorch, ``torch.compile`` (default mode), kiln ``inductor`` over the whole
graph and kiln ``inductor`` split per block with dedup (one compiled graph per unique block), and the
compile time of each; where TensorRT-RTX is installed, its build time split per block with dedup (one
build per unique block) and without (one build per block), and over the whole graph (builds only: its
runtime refuses the H100). Timings are interleaved (``compiler.validate.measure_latency``, synchronised).
Every compile gets a fresh Inductor cache directory, so compile times are cold on disk (in-process
kernel caches of earlier compiles may still help later ones; the order is torch.compile, kiln whole,
kiln split). Results are written after every step, so a run cut short leaves what it measured.

    python3 benchmarks/gpu_runtime.py --out benchmarks/results/gpu_runtime_h100.json
"""

from __future__ import annotations

import argparse
import copy
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
from compiler.device import to_device
from compiler.validate import measure_latency
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
        artifacts = [compiler.build_engine(plan, unique, fp) for fp in unique.fingerprints]
        rows[f"{label}_build_s"] = round(time.perf_counter() - start, 2)
        rows[f"{label}_builds"] = len(artifacts)
        rows[f"{label}_failed"] = sum(not a.is_engine for a in artifacts)
    dedup_s, no_dedup_s = rows["trt_rtx_split_dedup_build_s"], rows["trt_rtx_split_no_dedup_build_s"]
    rows["trt_rtx_dedup_over_no_dedup"] = round(dedup_s / no_dedup_s, 3) if no_dedup_s else None
    return rows


def run(args: argparse.Namespace) -> dict:
    started = time.perf_counter()
    device = args.device
    gpu = torch.cuda.get_device_name(0) if device.startswith("cuda") else "none"
    results: dict = {
        "machine": {
            "gpu": gpu,
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
        compiled_tc = torch.compile(eager)
        compile_rows = {"model": name, "precision": precision}
        with torch.no_grad():
            for batch in args.batches:  # first call per batch compiles (static, then automatic dynamic)
                a, k = at_batch(case, batch, half)
                _, seconds = timed(compiled_tc, *a, **k)
                compile_rows[f"torch_compile_first_call_batch{batch}_s"] = round(seconds, 2)
        program = compiler.export(model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
        kiln = {}
        for label, split in (("kiln_inductor_whole", None), ("kiln_inductor_split_dedup", "auto")):
            fresh_inductor_cache()
            start = time.perf_counter()
            module = compiler.compile(
                program,
                backend="inductor",
                device=device,
                precision=precision,
                split_modules=split,
                cache=False,
            )
            compile_rows[f"{label}_build_s"] = round(time.perf_counter() - start, 2)
            compile_rows[f"{label}_partitions"] = len(module.report.partitions)
            compile_rows[f"{label}_unique"] = module.report.unique_fingerprints
            # A partition whose Inductor build failed runs eagerly in PyTorch: its latency is eager's.
            compile_rows[f"{label}_build_failures"] = [
                {"partitions": f["partitions"], "error": f["error"][:2000]}
                for f in module.report.build_failures
            ]
            kiln[label] = module
        whole, split = (
            compile_rows["kiln_inductor_whole_build_s"],
            compile_rows["kiln_inductor_split_dedup_build_s"],
        )
        compile_rows["split_over_whole_compile"] = round(split / whole, 3) if whole else None
        results["compile_seconds"].append(compile_rows)
        write()
        with torch.no_grad():
            for batch in args.batches:
                a, k = at_batch(case, batch, half)
                a32, k32 = at_batch(case, batch, False)
                reference = first_leaf(model(*a32, **k32)).float()
                fns = {
                    "eager": lambda a=a, k=k, f=eager: f(*a, **k),
                    "torch_compile": lambda a=a, k=k, f=compiled_tc: f(*a, **k),
                    **{label: (lambda m=m, a=a32, k=k32: m(*a, **k)) for label, m in kiln.items()},
                }
                errors = {}
                for label, fn in fns.items():
                    got = first_leaf(fn()).float()
                    errors[label] = float((got - reference).norm() / reference.norm())
                latency = measure_latency(fns, warmup=args.warmup, runs=args.runs)
                row = {
                    "model": name,
                    "precision": precision,
                    "batch": batch,
                    **{f"{label}_ms": round(lat.median_ms, 4) for label, lat in latency.items()},
                    **{f"{label}_p95_ms": round(lat.p95_ms, 4) for label, lat in latency.items()},
                    "rel_l2_vs_eager_fp32": {label: round(e, 6) for label, e in errors.items()},
                }
                tc = latency["torch_compile"].median_ms
                eg = latency["eager"].median_ms
                for label in kiln:
                    row[f"{label}_over_torch_compile"] = round(latency[label].median_ms / tc, 3)
                    row[f"{label}_over_eager"] = round(latency[label].median_ms / eg, 3)
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
                write()
        if trt_rtx_available(device):
            compile_rows.update(trt_rtx_builds(program, device, precision))
            write()
        kiln.clear()
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
    parser.add_argument("--precisions", type=lambda s: s.split(","), default=["fp32", "fp16"])
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 8])
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--runs", type=int, default=50)
    parser.add_argument(
        "--budget-s", type=float, default=480.0, help="start no new (model, precision) after this"
    )
    results = run(parser.parse_args())
    print_tables(results)


def print_tables(results: dict) -> None:
    kinds = ("eager", "torch_compile", "kiln_inductor_whole", "kiln_inductor_split_dedup")
    print_table(
        "latency, ms (x torch.compile)",
        ["model", "prec", "batch", "eager", "torch.compile", "kiln whole", "kiln split+dedup"],
        [
            [r["model"], r["precision"], r["batch"]]
            + [
                f"{r[f'{k}_ms']:.2f}"
                + (f" ({r[f'{k}_over_torch_compile']:.2f}x)" if k.startswith("kiln") else "")
                for k in kinds
            ]
            for r in results["rows"]
        ],
    )
    print_table(
        "compile, s",
        [
            "model",
            "prec",
            "torch.compile b1",
            "kiln whole",
            "kiln split+dedup",
            "split/whole",
            "trt-rtx dedup/no",
        ],
        [
            [
                r["model"],
                r["precision"],
                r.get("torch_compile_first_call_batch1_s"),
                r.get("kiln_inductor_whole_build_s"),
                r.get("kiln_inductor_split_dedup_build_s"),
                r.get("split_over_whole_compile"),
                r.get("trt_rtx_dedup_over_no_dedup", "-"),
            ]
            for r in results["compile_seconds"]
        ],
    )


if __name__ == "__main__":
    main()
