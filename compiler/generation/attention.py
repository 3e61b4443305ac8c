"""The decode step's attention as one op, ``kiln::decode_attention``: split-KV on the GPU.

One new token per row attends to the static cache (positions the additive mask allows) and to its own
key and value, which the cache does not hold yet (compiler/generation/step.py). Written out in ATen,
Inductor makes that 6-7 kernels a layer (scores, the softmax's reductions, the value product: ~9 us a
layer on the H100 for a 1024-long cache, where the cache's bytes take ~1 us), and the decode step is
bound by such per-kernel costs (issue 44: the step's target is 1.5x its memory-bandwidth floor).

On CUDA, for fp16/bf16, the op is two Triton kernels (flash-decoding): each program scores one slice of
the cache for the query heads of one key/value head (grouped query heads share their key head without
copies) and keeps its running max, sum and weighted values; a second kernel merges the slices with the
own key's term. Elsewhere (the CPU, fp32, no Triton) it is the same softmax written in ATen, which is
also the reference the GPU form is tested against.

The op is kiln's own: a decode program exported on the GPU names it, and a package loads it by
importing this module (compiler.program.module_policy lets kiln's own op modules in; docs/security.md).
"""

from __future__ import annotations

import torch
from torch.utils._triton import has_triton


def reference(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """``query`` [B, H, 1, D], cache ``keys``/``values`` [B, KVH, L, D], additive ``mask`` broadcast to
    [B, 1, 1, L] (or None), the step's ``new_keys``/``new_values`` [B, KVH, 1, D] -> [B, 1, H, D]."""
    b, heads, _, d = query.shape
    kv_heads = keys.shape[1]
    q = query.reshape(b, kv_heads, heads // kv_heads, d)  # q head h reads kv head h // groups
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # [b, kv_heads, groups, cache]
    if mask is not None:
        scores = scores + mask
    own = (q.float() * new_keys.float()).sum(-1, keepdim=True) * scale  # [b, kv_heads, groups, 1]
    # The softmax over the cache and the own key written out, not over their concatenation (a
    # 1025-wide copy cost Inductor five kernels a layer); normalized after the value product, in fp32.
    top = torch.maximum(scores.amax(-1, keepdim=True), own)
    weights, own_weight = torch.exp(scores - top), torch.exp(own - top)
    total = weights.sum(-1, keepdim=True) + own_weight
    out = torch.matmul(weights.to(values.dtype), values).float() + own_weight * new_values.float()
    return (out / total).to(values.dtype).reshape(b, heads, 1, d).transpose(1, 2)


@torch.library.custom_op("kiln::decode_attention", mutates_args=())
def decode_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None,
    new_keys: torch.Tensor,
    new_values: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """See :func:`reference` (shapes); split-KV Triton kernels where :func:`gpu_kernel_applies`."""
    if gpu_kernel_applies(query, keys):
        from compiler.generation import attention_triton

        return attention_triton.decode_attention(query, keys, values, mask, new_keys, new_values, scale)
    return reference(query, keys, values, mask, new_keys, new_values, scale).contiguous()


@decode_attention.register_fake
def _(query, keys, values, mask, new_keys, new_values, scale):
    b, heads, _, d = query.shape
    return query.new_empty((b, 1, heads, d), dtype=values.dtype)


def gpu_kernel_applies(query: torch.Tensor, keys: torch.Tensor, at_any_dtype: bool = False) -> bool:
    """CUDA, fp16/bf16 (fp32 keeps ATen's exact matmuls: fp32 packages promise eager's tokens) and
    Triton importable. ``at_any_dtype``: the device alone (a trace in fp32 of a program an engine runs
    at fp16: the op, run, decides by its own inputs)."""
    dtypes = at_any_dtype or (query.dtype in (torch.float16, torch.bfloat16) and keys.dtype == query.dtype)
    return query.is_cuda and dtypes and has_triton()  # torch's check: Triton and a GPU it compiles for
