"""Probe (issue 34): a package's weights file to the load's device, the four-pass way loads read it
before (read, sha256, ``safetensors.torch.load``, ``.to(device)``, each pass timed) and the one-pass way
(``compiler.package.weights_file.read_weights``), side by side, alternating, file in the page cache.

The file holds GPT-2 12x768's float32 tensors (652 MB, random values), the size a GPT-2 package's
``weights.safetensors`` has.

    python3 benchmarks/probes/probe_weights_read.py OUT.json [--rounds 5] [--device cuda]
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import safetensors.torch  # noqa: E402
import torch  # noqa: E402

from benchmarks.machine import cpu_model  # noqa: E402
from compiler.package.check import checked_manifest, read_verified  # noqa: E402
from compiler.package.manifest import WEIGHTS, FileRecord  # noqa: E402
from compiler.package.weights_file import read_weights  # noqa: E402

FORMAT1 = ROOT / "tests" / "fixtures" / "packages" / "mlp-format1-2026-11.kiln"


def gpt2_tensors() -> dict[str, torch.Tensor]:
    hidden, vocab, positions = 768, 50257, 1024
    tensors = {"wte": torch.randn(vocab, hidden), "wpe": torch.randn(positions, hidden)}
    for layer in range(12):
        for name, shape in {
            "ln_1.weight": (hidden,),
            "ln_1.bias": (hidden,),
            "attn.c_attn.weight": (hidden, 3 * hidden),
            "attn.c_attn.bias": (3 * hidden,),
            "attn.c_proj.weight": (hidden, hidden),
            "attn.c_proj.bias": (hidden,),
            "ln_2.weight": (hidden,),
            "ln_2.bias": (hidden,),
            "mlp.c_fc.weight": (hidden, 4 * hidden),
            "mlp.c_fc.bias": (4 * hidden,),
            "mlp.c_proj.weight": (4 * hidden, hidden),
            "mlp.c_proj.bias": (hidden,),
        }.items():
            tensors[f"h.{layer}.{name}"] = torch.randn(shape)
    tensors["ln_f.weight"], tensors["ln_f.bias"] = torch.ones(hidden), torch.zeros(hidden)
    tensors["lm_head.weight"] = torch.randn(vocab, hidden)  # saved apart from wte, as the package has it
    return tensors


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def four_passes(path: Path, manifest, device: torch.device) -> dict[str, float]:
    laps, mark = {}, time.perf_counter()

    def lap(name: str) -> None:
        nonlocal mark
        now = time.perf_counter()
        laps[name], mark = now - mark, now

    data = (path / WEIGHTS).read_bytes()
    lap("read")
    hashlib.sha256(data).hexdigest()
    lap("sha256")
    tensors = safetensors.torch.load(data)
    lap("decode")
    placed = {k: v.to(device) for k, v in tensors.items()}
    sync(device)
    lap("to_device")
    laps["total"] = sum(laps.values())
    assert len(placed) == len(tensors)
    read_verified(path, WEIGHTS, manifest)  # the same checks pass on this file
    return laps


def one_pass(path: Path, manifest, device: torch.device) -> dict[str, float]:
    start = time.perf_counter()
    placed = read_weights(path, WEIGHTS, manifest, device)
    sync(device)
    assert placed
    return {"total": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    scratch = Path(tempfile.mkdtemp(prefix="kiln-weights-probe-"))
    data = safetensors.torch.save(gpt2_tensors())
    (scratch / WEIGHTS).write_bytes(data)
    record = FileRecord(hashlib.sha256(data).hexdigest(), len(data))
    manifest = dataclasses.replace(checked_manifest(FORMAT1, verify=False), files={WEIGHTS: record})
    torch.empty(1, device=device)  # the CUDA context, outside the timings
    one_pass(scratch, manifest, device)  # warm: page cache, pinned-memory allocator
    rounds = {"four_passes": [], "one_pass": []}
    for _ in range(args.rounds):
        rounds["four_passes"].append(four_passes(scratch, manifest, device))
        rounds["one_pass"].append(one_pass(scratch, manifest, device))
    medians = {
        mode: {k: round(statistics.median(r[k] for r in runs), 4) for k in runs[0]}
        for mode, runs in rounds.items()
    }
    result = {
        "machine": {
            "host_cpu": cpu_model(),
            "cpu_count": os.cpu_count(),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "torch": torch.__version__,
        },
        "file_bytes": len(data),
        "device": str(device),
        "rounds": args.rounds,
        "median_s": medians,
        "one_pass_over_four": round(medians["one_pass"]["total"] / medians["four_passes"]["total"], 3),
        "method": __doc__.split("\n\n")[1].replace("\n", " "),
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'mode':<12} {'total s':>8}  phases")
    for mode, median in medians.items():
        phases = ", ".join(f"{k} {v:.3f}" for k, v in median.items() if k != "total")
        print(f"{mode:<12} {median['total']:>8.3f}  {phases}")
    print(json.dumps({k: v for k, v in result.items() if k != "method"}))
    (scratch / WEIGHTS).unlink()
    scratch.rmdir()


if __name__ == "__main__":
    main()
