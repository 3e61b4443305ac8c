"""Probe: torch._int_mm on CUDA under eager and Inductor (dynamic M), and int8 vs bf16 linear speed."""

import json
import time
from pathlib import Path

import torch
import torch._inductor.config as ic


def int8_linear(x, w, ws, b):
    rows = x.reshape(-1, x.shape[-1])
    s = rows.abs().amax(-1, keepdim=True).float().clamp(min=1e-12) / 127
    q = (rows.float() / s).round().clamp(-127, 127).to(torch.int8)
    y = torch._int_mm(q, w.t())
    y = (y.float() * s * ws.t()).to(x.dtype)
    if b is not None:
        y = y + b
    return y.reshape(*x.shape[:-1], w.shape[0])


def bench(fn, *a, n=200):
    for _ in range(10):
        fn(*a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn(*a)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


K, N = 768, 3072  # BERT-base's FFN up-projection


def operands(dev: str = "cuda") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(int8 weight [N, K], its row scales, a bf16 bias)."""
    w = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=dev)
    ws = torch.rand(N, 1, device=dev) / 100
    return w, ws, torch.randn(N, device=dev, dtype=torch.bfloat16)


def main():
    res = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    dev = "cuda"
    w, ws, b = operands(dev)
    for M in (1, 8, 16, 17, 128):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        try:
            int8_linear(x, w, ws, b)
            res[f"eager_M{M}"] = "ok"
        except Exception as e:
            res[f"eager_M{M}"] = str(e).splitlines()[0][:150]
    for fuse in (False, True):
        ic.force_fuse_int_mm_with_mul = fuse
        torch._dynamo.reset()
        f = torch.compile(int8_linear, dynamic=True)
        for M in (1, 8, 17, 128):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            try:
                y = f(x, w, ws, b)
                ref = int8_linear(x, w, ws, b) if M > 16 else None
                res[f"compiled_fuse{fuse}_M{M}"] = (
                    "ok" if ref is None else f"ok maxdiff {float((y - ref).abs().max()):.3g}"
                )
            except Exception as e:
                res[f"compiled_fuse{fuse}_M{M}"] = str(e).splitlines()[0][:200]
    # speed: int8 vs bf16 compiled
    ic.force_fuse_int_mm_with_mul = True
    torch._dynamo.reset()
    fi = torch.compile(int8_linear)
    wf = (w.float() * ws).to(torch.bfloat16)
    fb = torch.compile(lambda x, w, b: torch.nn.functional.linear(x, w, b))
    for M in (128, 1024, 4096, 16384):
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        res[f"us_M{M}"] = {"bf16": round(bench(fb, x, wf, b), 1), "int8": round(bench(fi, x, w, ws, b), 1)}
    print(json.dumps(res, indent=1))
    gpu = res["gpu"].split()[1].lower()
    (Path(__file__).parent / f"probe_int_mm.{gpu}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
