"""The oldest torch and transformers pyproject.toml admits, tried: ``hf:`` models exported, compiled and
validated against eager (issue 41).

Each model is a tiny config with random weights, written with ``save_pretrained`` into a temporary folder
(never a hub download), then loaded the way a zoo entry's ``hf:`` source loads it
(``zoo.sources.hf.HfSource``: the task's Auto class, its inputs and ranges), exported with the entry's
dynamic batch and sequence, compiled and validated:

- ``bert``: BERT sequence classification with ``token_type_ids`` (a sentence pair), ``hf:`` text;
- ``gpt2``: GPT-2 as ``feature-extraction`` (a decoder whose cache must stay off), ``hf:`` decoder;
- ``gpt2-lm``: GPT-2 as ``causal-lm`` (logits);
- ``llama``: a Llama-style decoder (rotary positions, RMSNorm, SwiGLU), ``causal-lm``;
- ``vit``: ViT image classification, ``hf:`` vision;
- ``llama-gqa`` (only when named with ``--model``): ``llama`` with grouped-query attention (2 key/value
  heads for 4 query heads, as Llama 3, Mistral and Qwen have). torch 2.11 cannot export it with a
  dynamic sequence: transformers repeats the key/value heads with expand + reshape, whose stride check
  leaves a guard (``Min(8*seq, 16*seq) == 8*seq``) torch 2.11 cannot prove; torch 2.13 exports it.

It needs torch, transformers, onnx, onnxruntime (and onnxscript) and kiln's ``compiler/`` and ``zoo/``
sources on ``PYTHONPATH``: no Prefect, MLflow or pydantic (checked with them blocked), so it runs on a
GPU host's own torch::

    PYTHONPATH=. python benchmarks/floor_versions.py                     # cpu, and cuda where there is one
    PYTHONPATH=. python benchmarks/floor_versions.py --device cuda --backend inductor --precision fp16

Each row says what was asked (device, backend, precision), what happened (``ok``, ``failed`` at
``export``, ``compile`` or ``validate``, with the error's first line) and the accuracy against eager. The
JSON (``benchmarks/results/floor_versions_<torch>_<transformers>_<machine>.json``) names the versions and
the machine. Exit status 1 when any row failed.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import compiler  # noqa: E402
from benchmarks.machine import cpu_model  # noqa: E402
from compiler.validation.report import Tolerances  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MODELS = ("bert", "gpt2", "gpt2-lm", "llama", "vit")
OPTIONAL = ("llama-gqa",)


def _save(name: str, folder: Path) -> str:
    """A tiny ``name`` with random weights in ``folder`` (save_pretrained); its task."""
    import transformers as t

    torch.manual_seed(0)
    if name == "bert":
        config = t.BertConfig(
            vocab_size=120,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=64,
            type_vocab_size=2,
            num_labels=3,
        )
        model, task = t.BertForSequenceClassification(config), "sequence-classification"
    elif name in ("gpt2", "gpt2-lm"):
        config = t.GPT2Config(
            vocab_size=120, n_positions=64, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0
        )
        if name == "gpt2":
            model, task = t.GPT2Model(config), "feature-extraction"
        else:
            model, task = t.GPT2LMHeadModel(config), "causal-lm"
    elif name in ("llama", "llama-gqa"):
        config = t.LlamaConfig(
            vocab_size=120,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2 if name == "llama-gqa" else 4,
            max_position_embeddings=64,
            bos_token_id=0,
            eos_token_id=0,
            pad_token_id=0,
        )
        model, task = t.LlamaForCausalLM(config), "causal-lm"
    elif name == "vit":
        config = t.ViTConfig(
            image_size=32,
            patch_size=8,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=4,
        )
        model, task = t.ViTForImageClassification(config), "image-classification"
    else:
        raise SystemExit(f"--model {name!r}: not one of {', '.join(MODELS + OPTIONAL)}")
    model.save_pretrained(folder)
    return task


def _first_line(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text.splitlines()[0][:500] if text else type(exc).__name__


def run_one(name: str, device: str, backend: str, precision: str, scratch: Path) -> dict[str, Any]:
    """One model through load, export, compile and validate; the row (never raises)."""
    from zoo.sources.hf import HfSource

    row: dict[str, Any] = {"model": name, "device": device, "backend": backend, "precision": precision}
    stage, start = "save", time.perf_counter()
    try:
        folder = scratch / name
        row["task"] = _save(name, folder)
        stage = "load"
        case = HfSource(str(folder), row["task"]).load()

        def move(value: Any) -> Any:
            return value.to(device) if isinstance(value, torch.Tensor) else value

        model = case.model.to(device)
        args = tuple(move(a) for a in case.args)
        kwargs = {k: move(v) for k, v in case.kwargs.items()}
        stage = "export"
        program = compiler.export(model, args, kwargs, dynamic_shapes=case.dynamic_shapes)
        row["inputs"] = [s.name for s in compiler.input_specs(program)]
        stage = "compile"
        compiled = compiler.compile(program, device=device, backend=backend, precision=precision, cache=False)
        stage = "validate"
        report = compiler.validate(model, compiled, samples=3, warmup=1, runs=3)
        tolerance = Tolerances().resolved(precision)
        row["max_rel_l2"] = report.max_rel_l2
        row["rel_l2_tolerance"] = tolerance.rel_l2
        failures = report.failures(tolerance)
        row["status"] = "failed" if failures else "ok"
        if failures:
            row["stage"], row["error"] = "validate", "; ".join(failures)
    except Exception as exc:  # a row per failure: the other models still run
        row.update(status="failed", stage=stage, error=_first_line(exc))
        row["traceback"] = traceback.format_exc()[-4000:]
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
        major, minor = torch.cuda.get_device_capability(0)
        info["engine_target"] = f"cuda:sm_{major}{minor}"
    return info


def versions() -> dict[str, str]:
    found = {}
    for package in ("torch", "transformers", "onnx", "onnxruntime", "onnxscript", "triton"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


def _configurations(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(device, backend, precision) to run: the flags, else cpu (ONNX Runtime fp32) and, where there is
    a GPU, cuda (Inductor fp16: what the GPU host's zoo asked for)."""
    if args.device:
        backend = args.backend or ("inductor" if args.device.startswith("cuda") else "onnxruntime")
        return [(args.device, backend, args.precision or ("fp16" if backend == "inductor" else "fp32"))]
    runs = [("cpu", args.backend or "onnxruntime", args.precision or "fp32")]
    if torch.cuda.is_available():
        runs.append(("cuda", args.backend or "inductor", args.precision or "fp16"))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--model", action="append", choices=MODELS + OPTIONAL, help="repeatable; default: all but llama-gqa"
    )
    parser.add_argument("--device", help="cpu, cuda, cuda:1 (default: cpu, and cuda where there is one)")
    parser.add_argument("--backend", help="onnxruntime, inductor, tensorrt (default: by device)")
    parser.add_argument("--precision", help="fp32, fp16, bf16 (default: fp32 on cpu, fp16 on cuda)")
    parser.add_argument("--out", type=Path, help="the JSON file (default: benchmarks/results/...)")
    args = parser.parse_args(argv)

    found, where = versions(), machine()
    print(f"torch {found['torch']}, transformers {found['transformers']}, onnxruntime {found['onnxruntime']}")
    print(f"python {where['python']}; {where.get('gpu', 'no GPU')}; {where['cpu']}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-floor-") as scratch:
        for device, backend, precision in _configurations(args):
            for name in args.model or MODELS:
                row = run_one(name, device, backend, precision, Path(scratch) / device.replace(":", "_"))
                rows.append(row)
                rel = f"{row['max_rel_l2']:.1e}" if row.get("max_rel_l2") is not None else "-"
                print(
                    f"{name:8} {device:6} {backend:11} {precision:5} {row['status']:6} rel_l2 {rel:8} "
                    f"{row['seconds']:6.1f}s"
                    + (f"  {row['stage']}: {row['error']}" if "error" in row else ""),
                    flush=True,
                )
    failed = [r for r in rows if r["status"] != "ok"]
    for row in failed:
        print(
            f"\n--- {row['model']} on {row['device']} ({row['stage']}):\n{row.get('traceback', row['error'])}"
        )
    payload = {"versions": found, "machine": where, "rows": rows, "ok": len(rows) - len(failed)}
    payload["failed"] = len(failed)
    label = where.get("gpu", "cpu").split()[-1].lower()  # "h100", "cpu"
    out = args.out or RESULTS / (
        f"floor_versions_torch{found['torch'].split('+')[0]}_transformers{found['transformers']}_{label}.json"
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2, sort_keys=True))
    print(f"\n{len(rows) - len(failed)} ok, {len(failed)} failed; wrote {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
