"""Probe (issue 44): the decode step's attention forms, alone, on the GPU.

The batch-1 decode step's profile (probe_decode_profile.py --decode-only, H100) spends ~0.28 ms of its
1.6 ms in attention: per layer a bmm template, five softmax kernels (Inductor splits the 1025-wide
reductions of 32 rows and fuses the mask's construction into each) and a second bmm. This probe times
the attention of 16 layers (the benchmark's Llama: 32 query heads, 8 key/value heads, head size 64,
cache 1024) as one compiled function in a captured CUDA graph, for several ways to write it, so the
step's form is chosen on numbers. Each form is checked against SDPA over the cache with the own key.

    python3 benchmarks/probes/probe_decode_attention.py OUT.json [--smoke]
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

LAYERS, HEADS, KV, D, CACHE = 16, 32, 8, 64, 1024


def _mask(attention_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # As the decode program builds it: 0 where a position holds a real token, the dtype's min elsewhere.
    allowed = attention_mask[:, None, None, :].bool()
    return torch.where(allowed, 0.0, torch.finfo(dtype).min).to(dtype)


def form_current(q, k, v, nk, nv, mask):  # compiler/generation/step.py as of c764401
    d = q.shape[-1]
    scores = torch.matmul(q, k.transpose(-1, -2)) * d**-0.5 + mask
    own = (q * nk).sum(-1, keepdim=True) * d**-0.5
    probs = torch.cat([scores, own], dim=-1).softmax(-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(probs[..., :-1], v) + probs[..., -1:] * nv


def form_nocat(q, k, v, nk, nv, mask):  # softmax by hand: no 1025-wide concatenation
    d = q.shape[-1]
    scores = (torch.matmul(q, k.transpose(-1, -2)) * d**-0.5 + mask).float()
    own = (q * nk).sum(-1, keepdim=True).float() * d**-0.5
    top = torch.maximum(scores.amax(-1, keepdim=True), own)
    e, e_own = torch.exp(scores - top), torch.exp(own - top)
    total = e.sum(-1, keepdim=True) + e_own
    out = torch.matmul(e.to(v.dtype), v).float() + e_own * nv.float()
    return (out / total).to(v.dtype)


def form_reduce(q, k, v, nk, nv, mask):  # scores and output as mul+sum reductions (no bmm templates)
    d = q.shape[-1]
    scores = (q.unsqueeze(3).float() * k.unsqueeze(2).float()).sum(-1) * d**-0.5 + mask.float()
    own = (q * nk).sum(-1, keepdim=True).float() * d**-0.5
    top = torch.maximum(scores.amax(-1, keepdim=True), own)
    e, e_own = torch.exp(scores - top), torch.exp(own - top)
    total = e.sum(-1, keepdim=True) + e_own
    out = (e.unsqueeze(-1) * v.unsqueeze(2).float()).sum(-2) + e_own * nv.float()
    return (out / total).to(v.dtype)


def form_sdpa_ref(q, k, v, nk, nv, mask):  # reference: SDPA over the cache with the own key appended
    b, kvh, g, d = q.shape
    keys = torch.cat([k, nk], dim=2).repeat_interleave(g, dim=1)
    values = torch.cat([v, nv], dim=2).repeat_interleave(g, dim=1)
    full = torch.cat([mask, mask.new_zeros((*mask.shape[:-1], 1))], dim=-1)
    out = torch.nn.functional.scaled_dot_product_attention(q.reshape(b, kvh * g, 1, d), keys, values, full)
    return out.reshape(b, kvh, g, d)


def form_flex(q, k, v, nk, nv, mask):  # FlexAttention's decoding kernel over the cache, then the own key
    from torch.nn.attention.flex_attention import flex_attention

    b, kvh, g, d = q.shape
    bias = mask[:, 0, 0, :].float()

    def score_mod(score, batch, head, q_idx, kv_idx):
        return score + bias[batch, kv_idx]

    out, lse = flex_attention(
        q.reshape(b, kvh * g, 1, d), k, v, score_mod=score_mod, enable_gqa=True, return_lse=True
    )
    # Merge the own key's softmax term: the cache's part has total exp(lse).
    own = (q * nk).sum(-1, keepdim=True).float() * d**-0.5
    lse = lse.reshape(b, kvh, g, 1).float()
    top = torch.maximum(lse, own)
    w_cache, w_own = torch.exp(lse - top), torch.exp(own - top)
    merged = out.reshape(b, kvh, g, d).float() * w_cache + nv.float() * w_own
    return (merged / (w_cache + w_own)).to(v.dtype)


def form_kiln(q, k, v, nk, nv, mask):  # kiln::decode_attention: split-KV Triton kernels (issue 44)
    import compiler.generation.attention  # noqa: F401  (defines the op)

    b, kvh, g, d = q.shape
    out = torch.ops.kiln.decode_attention(q.reshape(b, kvh * g, 1, d), k, v, mask, nk, nv, d**-0.5)
    return out.reshape(b, kvh, g, d)


FORMS = {
    "current": form_current,
    "nocat": form_nocat,
    "reduce": form_reduce,
    "sdpa_ref": form_sdpa_ref,
    "flex": form_flex,
    "kiln": form_kiln,
}


def layers_fn(form):
    def run(qs, ks, vs, nks, nvs, attention_mask):
        mask = _mask(attention_mask, qs[0].dtype)
        return [form(q, k, v, nk, nv, mask) for q, k, v, nk, nv in zip(qs, ks, vs, nks, nvs, strict=True)]

    return run


def inputs(dev: str, dtype: torch.dtype, length: int):
    g = torch.Generator(device=dev).manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, device=dev, dtype=dtype, generator=g)

    qs = [r(1, KV, HEADS // KV, D) for _ in range(LAYERS)]
    ks = [r(1, KV, CACHE, D) for _ in range(LAYERS)]
    vs = [r(1, KV, CACHE, D) for _ in range(LAYERS)]
    nks = [r(1, KV, 1, D) for _ in range(LAYERS)]
    nvs = [r(1, KV, 1, D) for _ in range(LAYERS)]
    attention_mask = torch.zeros(1, CACHE, device=dev, dtype=torch.long)
    attention_mask[:, :length] = 1
    return qs, ks, vs, nks, nvs, attention_mask


def time_graphed(fn, args, steps: int = 200) -> float:
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn(*args)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps * 1e3  # us


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--smoke", action="store_true", help="CPU, eager: checks the forms agree")
    parser.add_argument("--forms", default=",".join(FORMS), help="comma-separated, of " + ",".join(FORMS))
    parser.add_argument("--split", default="1,0", help="split_reductions settings to try: 1, 0 or both")
    args = parser.parse_args()
    dev, dtype = ("cpu", torch.float32) if args.smoke else ("cuda", torch.float16)
    data = inputs(dev, dtype, length=700)
    reference = layers_fn(form_sdpa_ref)(*data)
    result: dict = {"machine": {} if args.smoke else gpu_machine(), "layers": LAYERS, "forms": {}}
    chosen = {name: FORMS[name] for name in args.forms.split(",")}
    for split in (bool(int(x)) for x in args.split.split(",")):
        for name, form in chosen.items():
            key = f"{name}{'' if split else '+no_split_reductions'}"
            # max-autotune-no-cudagraphs as config (torch.compile takes a mode or options, not both)
            options = {"max_autotune": True, "coordinate_descent_tuning": True, "split_reductions": split}
            try:
                fn = layers_fn(form)
                if not args.smoke:
                    torch._dynamo.reset()
                    fn = torch.compile(fn, options=options, fullgraph=True)
                out = fn(*data)
                pairs = zip(out, reference, strict=True)
                err = max(float((a.float() - b.float()).abs().max()) for a, b in pairs)
                row = {"max_abs_err_vs_sdpa": err}
                if not args.smoke:
                    row["us_16_layers"] = time_graphed(fn, data)
                    row["us_per_layer"] = row["us_16_layers"] / LAYERS
            except Exception as error:  # a probe: record and go on
                row = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            result["forms"][key] = row
            print(key, row, flush=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
