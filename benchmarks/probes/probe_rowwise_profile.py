"""Probe (issue 19): where the time of Inductor's int8 / fp8 rowwise BERT layers goes on the GPU, next
to bf16: CUDA kernels by total time over 20 calls at batch 32 (4096 rows), CUDA graphs off so each
kernel is seen. Writes probe_rowwise_profile.<gpu>[.<tag>].json next to this file.

    python3 benchmarks/probes/probe_rowwise_profile.py [KEY=VALUE ...]   (Inductor config, e.g.
        coordinate_descent_tuning=1: each variant compiled with it)
"""

import dataclasses
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import compiler
from benchmarks.quantization import bert_case

VARIANTS = {
    "bf16": {"precision": "bf16"},
    "int8": {"precision": "int8", "quantization": "dynamic"},
    "fp8": {"precision": "fp8", "quantization": "dynamic"},
}


def main() -> None:
    model, kwargs, shapes, split, inputs, _ = bert_case(2, max_batch=32)
    program = compiler.export(
        model.cuda(), (), {k: v.cuda() for k, v in kwargs.items()}, dynamic_shapes=shapes
    )
    config = {k: bool(int(v)) for k, v in (a.split("=") for a in sys.argv[1:])}
    base = compiler.CompileOptions(
        backend_options={"compile_options": config} if config else {},
        backend="inductor",
        device="cuda",
        split_modules=split,
        cuda_graphs="off",
    )
    x = {k: v[0].cuda() for k, v in inputs(1, 32, torch.Generator().manual_seed(0)).items()}
    result: dict = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rows": 32 * 128,
        "inductor_config": config,
    }
    for name, settings in VARIANTS.items():
        compiled = compiler.compile(program, dataclasses.replace(base, **settings), cache=False)
        for _ in range(5):
            compiled(**x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                compiled(**x)
            torch.cuda.synchronize()
        kernels: dict[str, float] = defaultdict(float)
        for event in prof.events():
            if event.device_type == torch.autograd.DeviceType.CUDA:
                kernels[event.name[:90]] += event.device_time / 20
        total = sum(kernels.values())
        top = sorted(kernels.items(), key=lambda kv: -kv[1])[:8]
        result[name] = {"gpu_us_per_call": round(total, 1), "top": {k: round(v, 1) for k, v in top}}
        print(name, json.dumps(result[name], indent=1), flush=True)
    gpu = torch.cuda.get_device_name().split()[1].lower()
    tag = "".join(f".{k}" for k in config)
    (Path(__file__).parent / f"probe_rowwise_profile.{gpu}{tag}.json").write_text(
        json.dumps(result, indent=1)
    )


if __name__ == "__main__":
    main()
