"""Probe: does Inductor's max-autotune GEMM (Triton int8 template, scale multiply fused) make the
int8 dynamic linear pay against bf16 on the H100, and at what compile time? Dynamic M."""

import json
import sys
import time
from pathlib import Path

import torch
import torch._inductor.config as ic

sys.path.insert(0, "benchmarks/probes")
from probe_int_mm import K, bench, int8_linear, operands

res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
dev = "cuda"
w, ws, b = operands(dev)
wf = (w.float() * ws).to(torch.bfloat16)
ic.force_fuse_int_mm_with_mul = True
ic.max_autotune_gemm = True
for name, fn, args in (
    ("int8", int8_linear, (w, ws, b)),
    ("bf16", lambda x, w, b: torch.nn.functional.linear(x, w, b), (wf, b)),
):
    torch._dynamo.reset()
    f = torch.compile(fn, dynamic=False)
    for M in (8, 128, 4096, 16384):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        t = time.perf_counter()
        try:
            f(x, *args)
            torch.cuda.synchronize()
            res[f"{name}_M{M}"] = {
                "compile_s": round(time.perf_counter() - t, 1),
                "us": round(bench(f, x, *args), 1),
            }
        except Exception as e:
            res[f"{name}_M{M}"] = str(e).splitlines()[0][:200]
        print(name, M, res[f"{name}_M{M}"], flush=True)
print(json.dumps(res, indent=1))
gpu = res["gpu"].split()[1].lower()
(Path(__file__).parent / f"probe_int_mm_autotune.{gpu}.json").write_text(json.dumps(res, indent=1))
