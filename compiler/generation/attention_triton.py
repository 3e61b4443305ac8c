"""Triton kernels of ``kiln::decode_attention`` (compiler/generation/attention.py): split-KV decoding.

Kernel 1 runs one program per (row, key/value head, slice of the cache): the slice's scores for the
head's group of query heads (a [groups, block] dot on tensor cores, groups padded to 16), the additive
mask, a running max and sum over the slice's blocks, and the weighted values; it writes those partials
(fp32). Kernel 2 runs one program per (row, query head): it merges the slices' partials with the
step's own key and value, which the cache does not hold yet, and writes [B, 1, H, D]. Imported only
where Triton is (the GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 64  # cache positions per inner step of a slice
MAX_SLICES = 32  # merged in registers by kernel 2


@triton.jit
def _slices(
    Q, K, V, MASK, PART_O, PART_M, PART_L,
    s_qb, s_qh, s_qd,
    s_kb, s_kh, s_kl, s_kd,
    s_vb, s_vh, s_vl, s_vd,
    s_mb, s_ml,
    scale, length, chunk,
    KV_HEADS: tl.constexpr, GROUPS: tl.constexpr, G_PAD: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, SLICES: tl.constexpr,
    HAS_MASK: tl.constexpr,
):  # fmt: skip
    row_head = tl.program_id(0)
    piece = tl.program_id(1)
    b = row_head // KV_HEADS
    h = row_head % KV_HEADS
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    g_ok = g < GROUPS
    d_ok = d < D
    q = tl.load(
        Q + b * s_qb + (h * GROUPS + g)[:, None] * s_qh + d[None, :] * s_qd,
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    top = tl.full([G_PAD], float("-inf"), tl.float32)
    total = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    start = piece * chunk
    stop = tl.minimum(start + chunk, length)
    for first in range(start, stop, BLOCK_N):
        n = first + tl.arange(0, BLOCK_N)
        n_ok = n < stop
        k = tl.load(
            K + b * s_kb + h * s_kh + n[:, None] * s_kl + d[None, :] * s_kd,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        scores = tl.dot(q, tl.trans(k)) * scale  # [G_PAD, BLOCK_N], fp32
        if HAS_MASK:
            bias = tl.load(MASK + b * s_mb + n * s_ml, mask=n_ok, other=0.0).to(tl.float32)
            scores += bias[None, :]
        scores = tl.where(n_ok[None, :], scores, float("-inf"))
        new_top = tl.maximum(top, tl.max(scores, 1))
        keep = tl.exp(top - new_top)
        p = tl.exp(scores - new_top[:, None])
        v = tl.load(
            V + b * s_vb + h * s_vh + n[:, None] * s_vl + d[None, :] * s_vd,
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        acc = acc * keep[:, None] + tl.dot(p.to(v.dtype), v)
        total = total * keep + tl.sum(p, 1)
        top = new_top
    at = (row_head * SLICES + piece) * GROUPS + g
    tl.store(PART_O + at[:, None] * D_PAD + d[None, :], acc, mask=g_ok[:, None])
    tl.store(PART_M + at, top, mask=g_ok)
    tl.store(PART_L + at, total, mask=g_ok)


@triton.jit
def _merge(
    Q, NEW_K, NEW_V, PART_O, PART_M, PART_L, OUT,
    s_qb, s_qh, s_qd,
    s_nkb, s_nkh, s_nkd,
    s_nvb, s_nvh, s_nvd,
    s_ob, s_oh, s_od,
    scale,
    KV_HEADS: tl.constexpr, GROUPS: tl.constexpr,
    D: tl.constexpr, D_PAD: tl.constexpr, SLICES: tl.constexpr, S_PAD: tl.constexpr,
):  # fmt: skip
    row_head = tl.program_id(0)  # one query head of one row
    b = row_head // (KV_HEADS * GROUPS)
    head = row_head % (KV_HEADS * GROUPS)
    h = head // GROUPS
    g = head % GROUPS
    d = tl.arange(0, D_PAD)
    s = tl.arange(0, S_PAD)
    d_ok = d < D
    s_ok = s < SLICES
    q = tl.load(Q + b * s_qb + head * s_qh + d * s_qd, mask=d_ok, other=0.0).to(tl.float32)
    new_k = tl.load(NEW_K + b * s_nkb + h * s_nkh + d * s_nkd, mask=d_ok, other=0.0).to(tl.float32)
    new_v = tl.load(NEW_V + b * s_nvb + h * s_nvh + d * s_nvd, mask=d_ok, other=0.0).to(tl.float32)
    own = tl.sum(q * new_k, 0) * scale
    at = ((b * KV_HEADS + h) * SLICES + s) * GROUPS + g  # [S_PAD]
    tops = tl.load(PART_M + at, mask=s_ok, other=float("-inf"))
    totals = tl.load(PART_L + at, mask=s_ok, other=0.0)
    top = tl.maximum(tl.max(tops, 0), own)
    weights = tl.where(s_ok, tl.exp(tops - top), 0.0)
    own_weight = tl.exp(own - top)
    total = tl.sum(weights * totals, 0) + own_weight
    parts = tl.load(PART_O + at[:, None] * D_PAD + d[None, :], mask=s_ok[:, None], other=0.0)
    out = (tl.sum(parts * weights[:, None], 0) + own_weight * new_v) / total
    tl.store(OUT + b * s_ob + head * s_oh + d * s_od, out.to(OUT.dtype.element_ty), mask=d_ok)


def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Shapes as compiler.generation.attention.reference; returns a new [B, 1, H, D] tensor."""
    b, heads, _, d = query.shape
    kv_heads, length = keys.shape[1], keys.shape[2]
    groups = heads // kv_heads
    g_pad = max(16, triton.next_power_of_2(groups))  # tl.dot's smallest tile
    d_pad = max(16, triton.next_power_of_2(d))
    # Enough programs to cover the GPU at batch 1 (8 key/value heads x 16 slices on a 1024 cache),
    # at most MAX_SLICES (kernel 2 holds them all in registers).
    slices = max(1, min(MAX_SLICES, triton.cdiv(length, BLOCK)))
    chunk = triton.cdiv(triton.cdiv(length, slices), BLOCK) * BLOCK
    slices = triton.cdiv(length, chunk)
    part_o = torch.empty((b * kv_heads * slices * groups, d_pad), device=query.device, dtype=torch.float32)
    part_m = torch.empty((b * kv_heads * slices * groups,), device=query.device, dtype=torch.float32)
    part_l = torch.empty_like(part_m)
    out = torch.empty((b, 1, heads, d), device=query.device, dtype=values.dtype)
    if mask is not None:
        mask = mask.expand(b, 1, 1, length)
    m_strides = (mask.stride(0), mask.stride(3)) if mask is not None else (0, 0)
    _slices[(b * kv_heads, slices)](
        query, keys, values, mask if mask is not None else keys, part_o, part_m, part_l,
        query.stride(0), query.stride(1), query.stride(3),
        *keys.stride()[:2], keys.stride(2), keys.stride(3),
        *values.stride()[:2], values.stride(2), values.stride(3),
        *m_strides,
        scale, length, chunk,
        KV_HEADS=kv_heads, GROUPS=groups, G_PAD=g_pad, D=d, D_PAD=d_pad, BLOCK_N=BLOCK,
        SLICES=slices, HAS_MASK=mask is not None,
    )  # fmt: skip
    _merge[(b * heads,)](
        query, new_keys, new_values, part_o, part_m, part_l, out,
        query.stride(0), query.stride(1), query.stride(3),
        new_keys.stride(0), new_keys.stride(1), new_keys.stride(3),
        new_values.stride(0), new_values.stride(1), new_values.stride(3),
        out.stride(0), out.stride(2), out.stride(3),
        scale,
        KV_HEADS=kv_heads, GROUPS=groups, D=d, D_PAD=d_pad, SLICES=slices,
        S_PAD=triton.next_power_of_2(slices),
    )  # fmt: skip
    return out
