"""int8 on ONNX Runtime or Inductor (issue 19): fp32 vs int8 static vs int8 dynamic (ONNX Runtime
only) vs the plan the gate chose, on one backend (``--backend``).

Models (random weights, built from code):
  * ``bert``: a BERT-base-sized sequence classifier (transformers ``BertConfig``, 768 hidden, 12 heads,
    ``--layers`` layers, sequence 128), split per ``BertLayer`` so dedup builds one engine per level;
  * ``resnet50``: a ResNet-50 image classifier (transformers ``ResNetConfig``: bottleneck stages
    3-4-6-3, 224x224 RGB, ImageNet's 1000-class head), one partition;
  * ``cnn``: a small ResNet-like CNN (32x32 images, 10 classes): 0.4 ms at batch 1 on the GPU host,
    so it measures ONNX Runtime's per-node overhead more than int8 convolution;
  * ``sensitive``: 8 residual MLP blocks of one structure, one of which carries an outlier channel
    (x1e4 before a ReLU, undone after it) that per-tensor 8-bit activations cannot represent: the gate
    must raise exactly that block (a benchmark row and ``tests/compiler/quantization/test_quantize.py``).

Per model and variant: latency at batch 1 and 8 (median, interleaved in one run), package bytes
(weight-stripped engines off: the int8 weights are what shrinks), top-1 agreement and relative L2 vs
eager on held-out samples (calibration takes the first ``--calibration`` samples of the recorded
data, validation the rest), and calibration + quantization seconds. The CPU (model and ISA flags:
AVX2 / AVX512-VNNI / AMX decide whether int8 is faster) is named in the JSON.

With ``--backend inductor`` int8 engines hold their frozen int8 weights (compiler.quantization.pt2e),
so their ``weights.safetensors`` share is near 0 and the package bytes are the comparison.

Run: python -m benchmarks.quantization [--layers 12] [--backend inductor] [--out quantization_cpu]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import compiler
from benchmarks._common import interleaved, print_table, write_json
from compiler.validation.report import precision_summary
from zoo.models import SensitiveModel

# ---------------------------------------------------------------- the deliberately sensitive model


def sensitive_case(width: int = 32, blocks: int = 8, hot: int = 5, batch: int = 4, samples: int = 24):
    """(model, program, recorded data) for the sensitive model: ``samples`` inputs of ``[batch, width]``."""
    torch.manual_seed(0)
    model = SensitiveModel(width, blocks, hot).eval()
    program = compiler.export(model, (torch.randn(batch, width),))
    return model, program, {"x": torch.randn(samples, batch, width)}


# ---------------------------------------------------------------- the benchmark models


def bert_case(layers: int, seq: int = 128, classes: int = 2, seed: int = 0, max_batch: int = 8):
    """A BERT-base-sized sequence classifier (random weights), dynamic batch 1..``max_batch``, sequence
    ``seq``."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        hidden_size=768,
        num_hidden_layers=layers,
        num_attention_heads=12,
        intermediate_size=3072,
        num_labels=classes,
        attn_implementation="eager",
    )
    model = _Logits(BertForSequenceClassification(config).eval())
    ids = torch.randint(0, config.vocab_size, (2, seq))
    batch = torch.export.Dim("batch", min=1, max=max_batch)
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    shapes = {"input_ids": {0: batch}, "attention_mask": {0: batch}}

    def inputs(n: int, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        ids = torch.randint(1000, config.vocab_size, (n, batch_size, seq), generator=generator)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    return model, kwargs, shapes, ("BertLayer",), inputs, 1  # a sample: one sequence of 128 tokens


class _Logits(nn.Module):
    """The classifier's logits as a plain tensor (HF returns a ModelOutput)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


class _ImageLogits(_Logits):
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self.model(pixel_values=pixel_values).logits


class SmallCNN(nn.Module):
    """Three conv-BN-ReLU stages with residual blocks, global pooling, a 10-class head (32x32 RGB)."""

    def __init__(self, classes: int = 10):
        super().__init__()

        def stage(cin: int, cout: int, stride: int) -> nn.Sequential:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU()
            )

        self.stem = stage(3, 32, 1)
        self.body = nn.Sequential(stage(32, 64, 2), stage(64, 64, 1), stage(64, 128, 2), stage(128, 128, 1))
        self.head = nn.Linear(128, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.stem(x)).mean((2, 3)))


def _trained_batchnorm(model: nn.Module) -> None:
    """BatchNorm statistics of a trained net, roughly: not all identity."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.running_mean.uniform_(-0.1, 0.1)
                module.running_var.uniform_(0.5, 1.5)


def cnn_case(seed: int = 0):
    torch.manual_seed(seed)
    model = SmallCNN().eval()
    _trained_batchnorm(model)
    batch = torch.export.Dim("batch", min=1, max=8)

    def inputs(n: int, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(n, batch_size, 3, 32, 32, generator=generator)}

    return model, {"x": torch.randn(2, 3, 32, 32)}, {"x": {0: batch}}, None, inputs, 8  # 8 images a sample


def resnet50_case(seed: int = 0):
    """ResNet-50 (random weights, BatchNorm statistics as ``cnn_case``), dynamic batch 1..8, 224x224."""
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(seed)
    model = _ImageLogits(ResNetForImageClassification(ResNetConfig(num_labels=1000)).eval())
    _trained_batchnorm(model)
    batch = torch.export.Dim("batch", min=1, max=8)

    def inputs(n: int, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return {"pixel_values": torch.randn(n, batch_size, 3, 224, 224, generator=generator)}

    example = {"pixel_values": torch.randn(2, 3, 224, 224)}
    return model, example, {"pixel_values": {0: batch}}, None, inputs, 1  # a sample: one image


def sensitive_bench_case(seed: int = 0):
    torch.manual_seed(seed)
    model = SensitiveModel(width=64, blocks=8, hot=5).eval()
    batch = torch.export.Dim("batch", min=1, max=8)

    def inputs(n: int, batch_size: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(n, batch_size, 64, generator=generator)}

    return model, {"x": torch.randn(2, 64)}, {"x": {0: batch}}, ("OutlierBlock",), inputs, 8


# ---------------------------------------------------------------- measuring


def cpu_info() -> dict:
    """The CPU's model name and the ISA flags that decide int8 speed (VNNI, AMX)."""
    # The load average: on a shared machine other work skews latency ratios (say so in the results).
    info = {
        "model": platform.processor() or "unknown",
        "logical_cpus": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
    }
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return info
    for line in text.splitlines():
        if line.startswith("model name") and info["model"] in ("unknown", "", "x86_64"):
            info["model"] = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            info["isa"] = sorted(f for f in flags if f in ISA_FLAGS)
            break
    return info


ISA_FLAGS = {"avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "amx_bf16"}


def run_model(name: str, case, args: argparse.Namespace, out: Path) -> list[dict]:
    model, kwargs, shapes, split, inputs, sample_batch = case
    generator = torch.Generator().manual_seed(1)
    program = compiler.export(model, (), kwargs, dynamic_shapes=shapes)
    recorded = inputs(args.calibration + args.validation, sample_batch, generator)
    held_out = {k: v[args.calibration :] for k, v in recorded.items()}
    # Weight-stripped engines, int8 packages without the float weights only int8 engines read: what
    # the package bytes compare is the weights each variant ships.
    base = compiler.CompileOptions(
        backend=args.backend,
        split_modules=split,
        strip_weights=True,
        calibration={"samples": args.calibration},
    )
    tolerances = compiler.Tolerances.for_precision("int8")
    variants: dict[str, compiler.CompiledModule] = {}
    seconds: dict[str, float] = {}
    notes: dict[str, str] = {}
    settings_of = {
        "fp32": {},
        "int8 static": {"precision": "int8"},
        "int8 dynamic": {"precision": "int8", "quantization": "dynamic"},
    }
    if args.backend == "inductor":  # static only: its int8 kernels take calibrated activation scales
        del settings_of["int8 dynamic"]
    for variant, settings in settings_of.items():
        start = time.perf_counter()
        variants[variant] = compiler.compile(
            program, dataclasses.replace(base, **settings), cache=False, calibration_data=recorded
        )
        seconds[variant] = time.perf_counter() - start
    # The plan the gate chose: the static compile, repaired where it misses int8's tolerance.
    start = time.perf_counter()
    static = variants["int8 static"]
    mixed = compiler.repair(model, static, tolerances, data=recorded).compiled
    seconds["mixed plan"] = seconds["int8 static"] + time.perf_counter() - start
    plan = precision_summary(
        compiler.compare_partitions(mixed, [tuple(v[0] for v in held_out.values())], runs=0).rows
    )
    if mixed is static:  # the gate passed int8 as it is: the mixed plan is the static compile
        notes["int8 static"] = f"{plan} (the gate's plan: passed as is)"
    else:
        variants["mixed plan"] = mixed
        notes["mixed plan"] = plan
    rows = []
    batches = {b: {k: v[0] for k, v in inputs(1, b, generator).items()} for b in (1, 8)}
    latency = {
        b: interleaved({v: (lambda c=c, x=x: c(**x)) for v, c in variants.items()}, warmup=2, runs=args.runs)
        for b, x in batches.items()
    }
    for variant, compiled in variants.items():
        report = compiler.validate(model, compiled, data=held_out, warmup=0, runs=1)
        where = out / f"{name}-{variant.replace(' ', '-')}.kiln"
        package = compiler.save(compiled, where, int8_weights_only=True)
        quantization = compiled.report.quantization or {}
        rows.append(
            {
                "model": name,
                "variant": variant,
                "plan": notes.get(variant, compiled.plan.options.precision),
                "latency_ms_b1": latency[1][variant]["median_ms"],
                "latency_ms_b8": latency[8][variant]["median_ms"],
                "package_bytes": package.bytes,
                "weights_bytes": package.manifest.files["weights.safetensors"].bytes,
                "top1_agreement": report.min_top1_agreement,
                "rel_l2": report.max_rel_l2,
                "validation_samples": report.samples,
                "calibration_samples": quantization.get("samples", 0),
                "quantize_seconds": quantization.get("seconds", 0.0),
                "compile_seconds": round(seconds[variant], 2),
            }
        )
    fp32 = rows[0]
    for row in rows:
        for key in ("latency_ms_b1", "latency_ms_b8", "package_bytes", "weights_bytes"):
            row[f"{key}_vs_fp32"] = row[key] / fp32[key] if fp32[key] else None
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=12, help="BERT layers (12 = BERT-base)")
    parser.add_argument("--calibration", type=int, default=16, help="calibration samples")
    parser.add_argument("--validation", type=int, default=32, help="held-out validation samples")
    parser.add_argument("--runs", type=int, default=10, help="timed runs per variant and batch")
    parser.add_argument("--models", default="bert,resnet50,cnn,sensitive")
    parser.add_argument("--out", default="quantization_cpu", help="results/<out>.json")
    parser.add_argument(
        "--ort-threads", type=int, default=0, help="threads per ONNX Runtime session (KILN_ORT_THREADS)"
    )
    parser.add_argument(
        "--backend",
        choices=("onnxruntime", "inductor"),
        default="onnxruntime",
        help="inductor: int8 through torchao's PT2E flow, weights frozen (needs kiln[int8-inductor])",
    )
    parser.add_argument("--torch-threads", type=int, default=0, help="torch.set_num_threads (0: torch's)")
    args = parser.parse_args()
    os.environ["KILN_ORT_THREADS"] = str(args.ort_threads)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    cases = {
        "bert": lambda: bert_case(args.layers),
        "resnet50": resnet50_case,
        "cnn": cnn_case,
        "sensitive": sensitive_bench_case,
    }
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="kiln-quant-bench-") as tmp:
        for name in args.models.split(","):
            rows += run_model(name, cases[name](), args, Path(tmp))
            report(rows, args)  # after each model: a run cut short keeps what it measured


def report(rows: list[dict], args: argparse.Namespace) -> None:
    print_table(
        f"int8 on {args.backend} ({cpu_info()['model']}; BERT {args.layers} layers)",
        ["model", "variant", "b1 x", "b8 x", "pkg x", "wts x", "top-1", "rel L2", "quant s", "plan"],
        [
            [
                r["model"],
                r["variant"],
                r["latency_ms_b1_vs_fp32"],
                r["latency_ms_b8_vs_fp32"],
                r["package_bytes_vs_fp32"],
                r["weights_bytes_vs_fp32"],
                r["top1_agreement"],
                r["rel_l2"],
                r["quantize_seconds"],
                r["plan"],
            ]
            for r in rows
        ],
    )
    write_json(
        args.out,
        {
            "cpu": cpu_info(),
            "backend": args.backend,
            "onnxruntime": ort_version(),
            "torch": torch.__version__,
            "torchao": torchao_version(),
            "torch_threads": torch.get_num_threads(),
            "bert_layers": args.layers,
            "calibration_samples": args.calibration,
            "validation_samples": args.validation,
            "ort_threads": args.ort_threads or "ONNX Runtime's default (one per physical core)",
            "rows": rows,
        },
    )


def torchao_version() -> str | None:
    try:
        import torchao
    except ImportError:
        return None
    return torchao.__version__


def ort_version() -> str:
    import onnxruntime

    return onnxruntime.__version__


if __name__ == "__main__":
    main()
