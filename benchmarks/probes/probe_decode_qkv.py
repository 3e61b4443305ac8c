"""Probe (issue 44): the batch-1 decode step's attention projections, alone, on the GPU.

The step's profile spends ~0.35 ms on RMSNorm and the q/k/v/o matrix-vector products of 16 layers, whose
weights take ~0.11 ms to read at copy bandwidth: the k and v products (512 x 2048) are too small to
fill the GPU, so each costs a launch's latency. This times 16 layers of norm -> q, k, v -> o as one
compiled function in a captured CUDA graph: as the step has them, with Inductor's combo kernels (several
independent kernels in one launch), and with one concatenated q/k/v weight (the bound of fusing them);
then 16 MLP blocks (norm -> gate, up -> down), with and without split reductions and coordinate descent.

    python3 benchmarks/probes/probe_decode_qkv.py OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.machine import gpu_machine  # noqa: E402
from benchmarks.probes.probe_decode_attention import time_graphed  # noqa: E402

LAYERS, HIDDEN, Q, KV, FFN = 16, 2048, 2048, 512, 8192


def _norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w


def separate(x, weights):
    outs = []
    for norm, wq, wk, wv, wo in weights:
        h = _norm(x, norm)
        q, k, v = h @ wq.t(), h @ wk.t(), h @ wv.t()
        x = x + (q + k.repeat(1, 4) + v.repeat(1, 4)) @ wo.t()
        outs.append(k)
    return x, outs


def fused(x, weights):
    outs = []
    for norm, wqkv, wo in weights:
        h = _norm(x, norm)
        q, k, v = (h @ wqkv.t()).split((Q, KV, KV), dim=-1)
        x = x + (q + k.repeat(1, 4) + v.repeat(1, 4)) @ wo.t()
        outs.append(k)
    return x, outs


def mlp(x, weights):
    for norm, gate, up, down in weights:
        h = _norm(x, norm)
        x = x + (torch.nn.functional.silu(h @ gate.t()) * (h @ up.t())) @ down.t()
    return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    args = parser.parse_args()
    dev, dtype = "cuda", torch.float16
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g) * 0.02

    layers = [
        (r(HIDDEN) + 1, r(Q, HIDDEN), r(KV, HIDDEN), r(KV, HIDDEN), r(HIDDEN, Q)) for _ in range(LAYERS)
    ]
    joined = [(n, torch.cat([a, b, c]), o) for n, a, b, c, o in layers]
    x = r(1, HIDDEN)
    weight_bytes = sum(t.numel() * t.element_size() for layer in layers for t in layer[1:])
    base = {"max_autotune": True, "coordinate_descent_tuning": True}
    ffn = [(r(HIDDEN) + 1, r(FFN, HIDDEN), r(FFN, HIDDEN), r(HIDDEN, FFN)) for _ in range(LAYERS)]
    ffn_bytes = sum(t.numel() * t.element_size() for layer in ffn for t in layer[1:])
    no_split = {**base, "split_reductions": False}
    cases = {
        "separate": (separate, layers, base),
        "separate+combo_kernels": (separate, layers, {**base, "combo_kernels": True}),
        "separate+no_split_reductions": (separate, layers, no_split),
        "fused_qkv": (fused, joined, base),
        "mlp": (mlp, ffn, base),
        "mlp+no_split_reductions": (mlp, ffn, no_split),
        "mlp+no_coordinate_descent": (mlp, ffn, {"max_autotune": True}),
    }
    result: dict = {"machine": gpu_machine(), "layers": LAYERS, "attention_weight_bytes": weight_bytes}
    result |= {"mlp_weight_bytes": ffn_bytes, "cases": {}}
    for name, (fn, weights, options) in cases.items():
        try:
            torch._dynamo.reset()
            compiled = torch.compile(fn, options=options, fullgraph=True)
            us = time_graphed(compiled, (x, weights))
            read = ffn_bytes if weights is ffn else weight_bytes
            row = {"us_16_layers": us, "gb_per_s": read / us / 1e3}
        except Exception as error:  # a probe: record and go on
            row = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
        result["cases"][name] = row
        print(name, row, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
