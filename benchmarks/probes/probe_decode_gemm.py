"""Probe (issue 44): how close to the copy bandwidth the decode step's GEMMs can run at batch 1 and 8.

The 1.5B Llama's 16 layers of weight GEMMs plus its head (2.47 GB fp16), as one CUDA-graph-captured
chain (the activations stay tiny; the weights are 16 distinct sets, so nothing sits in L2), in four forms:
separate (q, k, v, o, gate, up, down as the model has them) or fused (q|k|v and gate|up concatenated),
each as cuBLAS (eager F.linear) or compiled by Inductor with max-autotune (its Triton GEMM templates) and
coordinate-descent tuning. Prints ms per chain and the fraction of copy bandwidth.

    python3 benchmarks/probes/probe_decode_gemm.py OUT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

H, FFN, KV, LAYERS, VOCAB = 2048, 8192, 512, 16, 128256


def weights(fused: bool) -> list[list[torch.Tensor]]:
    def w(n: int, k: int) -> torch.Tensor:
        return torch.randn(n, k, device="cuda", dtype=torch.float16) * 0.02

    layers = []
    for _ in range(LAYERS):
        if fused:
            layers.append([w(H + 2 * KV, H), w(H, H), w(2 * FFN, H), w(H, FFN)])
        else:
            layers.append([w(H, H), w(KV, H), w(KV, H), w(H, H), w(FFN, H), w(FFN, H), w(H, FFN)])
    return layers


def chain(fused: bool):
    def run(x: torch.Tensor, layers: list[list[torch.Tensor]], head: torch.Tensor) -> torch.Tensor:
        for ws in layers:
            if fused:
                qkv = F.linear(x, ws[0])
                x = x + F.linear(qkv[..., :H], ws[1])
                gu = F.linear(x, ws[2])
                x = x + F.linear(F.silu(gu[..., :FFN]) * gu[..., FFN:], ws[3])
            else:
                q, k, v = F.linear(x, ws[0]), F.linear(x, ws[1]), F.linear(x, ws[2])
                x = x + F.linear(q + (k.sum() + v.sum()) * 0, ws[3])
                x = x + F.linear(F.silu(F.linear(x, ws[4])) * F.linear(x, ws[5]), ws[6])
        return F.linear(x, head)

    return run


def bandwidth() -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").fill_(1)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(10):
        t = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return 2 * src.numel() / statistics.median(times)


def timed(fn, x, layers, head) -> float:
    for _ in range(3):
        fn(x, layers, head)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(x, layers, head)
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        fn(x, layers, head)
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(30):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    out = Path(sys.argv[1])
    bw = bandwidth()
    head = torch.randn(VOCAB, H, device="cuda", dtype=torch.float16) * 0.02
    result: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_gb_s": bw / 1e9}
    for fused in (False, True):
        layers = weights(fused)
        nbytes = sum(w.numel() * 2 for ws in layers for w in ws) + head.numel() * 2
        floor_ms = nbytes / bw * 1e3
        for batch in (1, 8):
            x = torch.randn(batch, 1, H, device="cuda", dtype=torch.float16)
            forms = {"cublas": chain(fused)}
            for mode, extra in (
                ("max-autotune-no-cudagraphs", {}),
                ("max-autotune-no-cudagraphs+cdt", {"coordinate_descent_tuning": True}),
            ):
                torch._dynamo.reset()
                with torch._inductor.config.patch(extra):
                    forms[f"inductor {mode}"] = torch.compile(chain(fused), mode=mode.split("+")[0])
            for name, fn in forms.items():
                key = f"{'fused' if fused else 'separate'} b{batch} {name}"
                torch._dynamo.reset()  # each form compiles afresh (one code object for all)
                try:
                    with torch._inductor.config.patch({"coordinate_descent_tuning": name.endswith("cdt")}):
                        ms = timed(fn, x, layers, head)
                    result[key] = {"ms": ms, "floor_ms": floor_ms, "of_bandwidth": floor_ms / ms}
                except Exception as exc:
                    result[key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                print(key, result[key], flush=True)
                out.write_text(json.dumps(result, indent=1))
        del layers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
