"""Mixed precision inside a partition (issue 46, item 4): int8 on ONNX Runtime at a rel L2 tolerance of
0.1, where repair raising whole partitions gives fp32 and layer-granular repair keeps most of int8.

Models, each compiled as ONE partition (so partition-level repair has nothing to raise but the whole
model):
  * ``bert``: a BERT sequence classifier (transformers ``BertConfig``: 4 layers x 256, random weights,
    sequence 32), the issue's case;
  * ``vit``: a ViT image classifier (transformers ``ViTConfig``: 4 layers x 192, 32x32 images in 4x4
    patches, 10 classes, random weights);
  * ``distilbert`` and ``resnet``: a DistilBERT classifier (4 layers x 256) and a ResNet (4 stages, 64x64
    images), added after the layer search was designed on ``bert`` and ``vit``, so not tuned on;
  * ``digits``: a small transformer trained here on scikit-learn's handwritten digits (8x8 images, each
    row a token), so top-1 agreement and accuracy against the labels mean something.

Per model, on held-out samples (calibration takes the first ``--calibration`` samples, validation the
rest): fp32; int8 as calibrated (no repair); that int8 compile repaired at partition granularity
(``repair_seconds`` 0: no layer search) and at layer granularity (``--budget`` seconds of search). Each row:
package bytes and latency (batch 1 and 8, medians interleaved in one run) vs fp32, rel L2 and top-1
agreement vs eager fp32 (and accuracy vs the labels for ``digits``), layers raised, the share of weights
and FLOPs kept at int8, and the repair's seconds. Targets (issue 46): the layer-repaired package at most
0.5x the fp32 bytes and 0.7x its latency at batch 1 while within the tolerance; each miss is printed,
and the worst layer-repaired model of each is written (``worst``).

Run: python -m benchmarks.mixed_precision [--models bert,vit,distilbert,resnet,digits] [--budget 240]
    [--ort-threads 1]
Writes benchmarks/results/mixed_precision_cpu.json (naming the CPU and its load: latency ratios on a
shared machine move with it). About 12 minutes on 2 cores shared with other work.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import compiler
from benchmarks._common import interleaved, print_table, write_json
from benchmarks.quantization import _Logits, cpu_info
from compiler.accuracy.mixed import ended_precision, layers_raised
from compiler.runtime.module import assemble
from compiler.validation.report import precision_summary

TOLERANCE = 0.1
TARGETS = {"package_bytes_vs_fp32": 0.5, "latency_ms_b1_vs_fp32": 0.7}

# ---------------------------------------------------------------- the models


def bert_case(seq: int = 32):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(2)
    config = BertConfig(
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        num_labels=2,
        attn_implementation="eager",
    )
    model = _Logits(BertForSequenceClassification(config).eval())
    ids = torch.randint(0, config.vocab_size, (2, seq))
    batch = torch.export.Dim("batch", min=1, max=8)

    def inputs(n: int, size: int, generator: torch.Generator) -> tuple[dict[str, torch.Tensor], None]:
        ids = torch.randint(1000, config.vocab_size, (n, size, seq), generator=generator)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, None

    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return model, example, {"input_ids": {0: batch}, "attention_mask": {0: batch}}, inputs


class _ImageLogits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.model(pixel_values=pixel_values).logits


def vit_case():
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(3)
    config = ViTConfig(
        image_size=32,
        patch_size=4,
        hidden_size=192,
        num_hidden_layers=4,
        num_attention_heads=3,
        intermediate_size=768,
        num_labels=10,
        attn_implementation="eager",
    )
    model = _ImageLogits(ViTForImageClassification(config).eval())
    batch = torch.export.Dim("batch", min=1, max=8)

    def inputs(n: int, size: int, generator: torch.Generator) -> tuple[dict[str, torch.Tensor], None]:
        return {"pixel_values": torch.randn(n, size, 3, 32, 32, generator=generator)}, None

    return model, {"pixel_values": torch.randn(2, 3, 32, 32)}, {"pixel_values": {0: batch}}, inputs


def distilbert_case(seq: int = 32):
    """Not tuned on (added after the search's design was settled on BERT and ViT): DistilBERT, 4 layers
    x 256, random weights."""
    from transformers import DistilBertConfig, DistilBertForSequenceClassification

    torch.manual_seed(5)
    config = DistilBertConfig(
        dim=256, n_layers=4, n_heads=4, hidden_dim=1024, num_labels=3, attn_implementation="eager"
    )
    model = _Logits(DistilBertForSequenceClassification(config).eval())
    batch = torch.export.Dim("batch", min=1, max=8)

    def inputs(n: int, size: int, generator: torch.Generator) -> tuple[dict[str, torch.Tensor], None]:
        ids = torch.randint(1000, config.vocab_size, (n, size, seq), generator=generator)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, None

    ids = torch.randint(0, config.vocab_size, (2, seq))
    example = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return model, example, {"input_ids": {0: batch}, "attention_mask": {0: batch}}, inputs


def resnet_case():
    """Not tuned on: a convolutional classifier (transformers ``ResNetConfig``: 4 stages of one
    bottleneck each, 64x64 images, 10 classes, random weights)."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(6)
    config = ResNetConfig(
        embedding_size=32, hidden_sizes=[64, 128, 256, 512], depths=[1, 1, 1, 1], num_labels=10
    )
    model = _ImageLogits(ResNetForImageClassification(config).eval())
    batch = torch.export.Dim("batch", min=1, max=8)

    def inputs(n: int, size: int, generator: torch.Generator) -> tuple[dict[str, torch.Tensor], None]:
        return {"pixel_values": torch.randn(n, size, 3, 64, 64, generator=generator)}, None

    return model, {"pixel_values": torch.randn(2, 3, 64, 64)}, {"pixel_values": {0: batch}}, inputs


class DigitsTransformer(nn.Module):
    """Each of an 8x8 image's rows a token: a 2-layer transformer encoder, mean-pooled, 10 classes."""

    def __init__(self, width: int = 128, layers: int = 2):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.position = nn.Parameter(torch.zeros(1, 8, width))
        layer = nn.TransformerEncoderLayer(width, 4, width * 4, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x) + self.position).mean(1))


def digits_case(epochs: int = 12):
    """The transformer trained on scikit-learn's digits (1797 images; the last 297 held out, never seen
    in training). Recorded samples are batches of held-out images, with their labels kept aside."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32) / 16.0
    labels = torch.tensor(digits.target)
    train_x, train_y, held_x, held_y = images[:1500], labels[:1500], images[1500:], labels[1500:]
    torch.manual_seed(4)
    model = DigitsTransformer()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(epochs):
        order = torch.randperm(len(train_x))
        for start in range(0, len(order), 50):
            pick = order[start : start + 50]
            loss = nn.functional.cross_entropy(model(train_x[pick]), train_y[pick])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    batch = torch.export.Dim("batch", min=1, max=8)

    def inputs(n: int, size: int, generator: torch.Generator) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        pick = torch.randint(0, len(held_x), (n, size), generator=generator)
        return {"x": held_x[pick]}, held_y[pick]

    return model, {"x": held_x[:2]}, {"x": {0: batch}}, inputs


# ---------------------------------------------------------------- measuring


def accuracy_vs_labels(compiled, held_out: dict, labels: torch.Tensor) -> float:
    right = total = 0
    with torch.no_grad():
        for i in range(labels.shape[0]):
            got = compiled(**{k: v[i] for k, v in held_out.items()}).argmax(-1)
            right += int((got == labels[i]).sum())
            total += labels[i].numel()
    return right / total


def run_model(name: str, case, args: argparse.Namespace, out: Path) -> list[dict]:
    model, example, shapes, inputs = case
    generator = torch.Generator().manual_seed(1)
    program = compiler.export(model, (), example, dynamic_shapes=shapes)
    sample_batch = 2 if name in ("bert", "distilbert") else 8
    recorded, labels = inputs(args.calibration + args.validation, sample_batch, generator)
    held_out = {k: v[args.calibration :] for k, v in recorded.items()}
    tolerances = compiler.Tolerances(rel_l2=TOLERANCE)
    # Recorded data in a file, as a zoo entry names it: repair's layer search reads its calibration
    # samples again from there.
    data_file = out / f"{name}-recorded.npz"
    np.savez(data_file, **{k: v.numpy() for k, v in recorded.items()})
    base = compiler.CompileOptions(
        strip_weights=True,
        calibration={"samples": args.calibration, "data": str(data_file)},
        on_accuracy_failure="repair",
    )
    int8 = dataclasses.replace(base, precision="int8", repair_seconds=args.budget)
    variants: dict[str, compiler.CompiledModule] = {}
    info: dict[str, dict] = {}
    start = time.perf_counter()
    variants["fp32"] = compiler.compile(program, base, cache=False)
    info["fp32"] = {"compile_seconds": time.perf_counter() - start}
    start = time.perf_counter()
    static = compiler.compile(program, int8, cache=False)
    variants["int8 as calibrated"] = static
    info["int8 as calibrated"] = {"compile_seconds": time.perf_counter() - start}
    # Partition repair: the same engines with no search time (repair_seconds 0), so repair raises
    # partitions whole, as it did before issue 46.
    whole = dataclasses.replace(static.plan.options, repair_seconds=0.0)
    partition_only = assemble(
        dataclasses.replace(static.plan, options=whole), static.dedup, static.engines, cache=False
    )
    for variant, module in (("partition repair", partition_only), ("layer repair", static)):
        start = time.perf_counter()
        result = compiler.repair(
            model, module, tolerances, data=held_out, samples=args.validation, cache=False
        )
        record = result.record
        variants[variant] = result.compiled
        info[variant] = {
            "compile_seconds": info["int8 as calibrated"]["compile_seconds"],
            "repair_seconds": round(time.perf_counter() - start, 2),
            "budget_seconds": module.plan.options.repair_seconds,
            "layers_raised": layers_raised(record.to_dict()),
            "partitions_raised": [f"{s.partition} -> {s.precision_after}" for s in record.steps],
            "kept": record.kept,
            "repair_lines": record.lines()[-6:],
            "rel_l2_before_repair": record.before.max_rel_l2,
            "record": record.to_dict(),
        }
    batches = {b: {k: v[0] for k, v in inputs(1, b, generator)[0].items()} for b in (1, 8)}
    latency = {
        b: interleaved({v: (lambda c=c, x=x: c(**x)) for v, c in variants.items()}, warmup=3, runs=args.runs)
        for b, x in batches.items()
    }
    rows = []
    for variant, compiled in variants.items():
        report = compiler.validate(model, compiled, data=held_out, warmup=0, runs=1)
        package = compiler.save(
            compiled, out / f"{name}-{variant.replace(' ', '-')}.kiln", int8_weights_only=True
        )
        plan = precision_summary(
            compiler.compare_partitions(compiled, [tuple(v[0] for v in held_out.values())], runs=0).rows
        )
        row = {
            "model": name,
            "variant": variant,
            "precision": ended_precision(plan, info[variant].pop("record", None)),
            "latency_ms_b1": latency[1][variant]["median_ms"],
            "latency_ms_b8": latency[8][variant]["median_ms"],
            "package_bytes": package.bytes,
            "rel_l2": report.max_rel_l2,
            "top1_agreement": report.min_top1_agreement,
            "meets_tolerance": report.max_rel_l2 <= TOLERANCE,
            "validation_samples": report.samples,
            "calibration_samples": args.calibration,
            **{k: (round(v, 2) if isinstance(v, float) else v) for k, v in info[variant].items()},
        }
        if labels is not None:
            row["accuracy_vs_labels"] = accuracy_vs_labels(compiled, held_out, labels[args.calibration :])
        rows.append(row)
    fp32 = rows[0]
    for row in rows:
        for key in ("latency_ms_b1", "latency_ms_b8", "package_bytes"):
            row[f"{key}_vs_fp32"] = row[key] / fp32[key] if fp32[key] else None
    return rows


def missed(rows: list[dict]) -> list[str]:
    """Each issue-46 target the layer-repaired package misses, and partition repair that did not give fp32."""
    lines = []
    for row in rows:
        if row["variant"] != "layer repair":
            continue
        if not row["meets_tolerance"]:
            lines.append(f"{row['model']}: rel L2 {row['rel_l2']:.3f} > {TOLERANCE} after layer repair")
        for key, target in TARGETS.items():
            if row[key] is None or row[key] > target:
                lines.append(f"{row['model']}: {key} {row[key]:.2f} > target {target}")
    return lines


def report(rows: list[dict], cpu: dict) -> None:
    print_table(
        f"int8 on ONNX Runtime, rel L2 tolerance {TOLERANCE} ({cpu['model']}, {cpu['logical_cpus']} CPUs)",
        [
            "model",
            "variant",
            "pkg x",
            "b1 x",
            "b8 x",
            "rel L2",
            "top-1",
            "acc",
            "raised",
            "kept w",
            "repair s",
            "prec",
        ],
        [
            [
                r["model"],
                r["variant"],
                r["package_bytes_vs_fp32"],
                r["latency_ms_b1_vs_fp32"],
                r["latency_ms_b8_vs_fp32"],
                r["rel_l2"],
                r["top1_agreement"],
                r.get("accuracy_vs_labels", "-"),
                r.get("layers_raised", "-"),
                (r.get("kept") or {}).get("weights", "-"),
                r.get("repair_seconds", "-"),
                r["precision"],
            ]
            for r in rows
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="bert,vit,distilbert,resnet,digits")
    parser.add_argument("--calibration", type=int, default=16, help="calibration samples")
    parser.add_argument("--validation", type=int, default=8, help="held-out validation samples")
    parser.add_argument("--budget", type=float, default=240.0, help="layer search seconds (repair_seconds)")
    parser.add_argument(
        "--runs",
        type=int,
        default=60,
        help="timed rounds per batch (with 10, the fp32 engine measured 2.1x itself at batch 1, load 6)",
    )
    parser.add_argument("--out", default="mixed_precision_cpu", help="results/<out>.json")
    parser.add_argument(
        "--ort-threads",
        type=int,
        default=1,
        help="threads per ONNX Runtime session (KILN_ORT_THREADS; 0: one per core). One by default: the "
        "variants are timed in turn, and each session's spinning threads took the cores from the next "
        "(fp32 at batch 8 measured 20x slower than int8 on 2 shared cores)",
    )
    args = parser.parse_args()
    os.environ["KILN_ORT_THREADS"] = str(args.ort_threads)
    cases = {
        "bert": bert_case,
        "vit": vit_case,
        "distilbert": distilbert_case,
        "resnet": resnet_case,
        "digits": digits_case,
    }
    rows: list[dict] = []
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kiln-mixed-bench-") as tmp:
        for name in args.models.split(","):
            rows += run_model(name, cases[name](), args, Path(tmp))
            report(rows, cpu_info())  # after each model: a run cut short keeps what it measured
    cpu = cpu_info()
    misses = missed(rows)
    repaired = [r for r in rows if r["variant"] == "layer repair"]
    worst = {key: max(((r[key], r["model"]) for r in repaired), default=None) for key in (*TARGETS, "rel_l2")}
    print(f"worst after layer repair: {worst}")
    for line in misses:
        print(f"missed: {line}")
    import onnxruntime

    write_json(
        args.out,
        {
            "cpu": cpu,
            "onnxruntime": onnxruntime.__version__,
            "tolerance_rel_l2": TOLERANCE,
            "targets": TARGETS,
            "missed": misses,
            "worst": worst,
            "seconds": round(time.perf_counter() - start, 1),
            "settings": vars(args),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
