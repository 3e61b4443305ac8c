"""The decode step's attention op on the GPU (issue 44): ``kiln::decode_attention``'s split-KV Triton
kernels against its ATen form (compiler/generation/attention.py) and SDPA, over the shapes decoders
have: grouped and plain heads, head sizes that are not powers of two, caches shorter than a block and
longer than 32 slices, padded rows; skips elsewhere with the reason.

    python3 -m pytest -q tests/gpu/test_decode_attention_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from compiler.generation.attention import gpu_kernel_applies, reference

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]


def _case(batch: int, heads: int, kv_heads: int, length: int, d: int, dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(batch * 1000 + length + d)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    # The query as transformers hands it: [B, H, 1, D], a transposed view of [B, 1, H, D].
    query = r(batch, 1, heads, d).transpose(1, 2)
    keys, values = r(batch, kv_heads, length, d), r(batch, kv_heads, length, d)
    new_keys, new_values = r(batch, kv_heads, 1, d), r(batch, kv_heads, 1, d)
    mask = torch.zeros(batch, 1, 1, length, device="cuda", dtype=dtype)
    mask[..., length * 3 // 4 :] = torch.finfo(dtype).min  # the cache's unwritten end
    if batch > 1:
        mask[1, ..., : length // 3] = torch.finfo(dtype).min  # a left-padded row
    return query, keys, values, mask, new_keys, new_values


@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "length", "d", "dtype"),
    [
        (1, 32, 8, 1024, 64, torch.float16),  # the benchmark's Llama
        (8, 32, 8, 1024, 64, torch.bfloat16),
        (3, 12, 12, 100, 64, torch.float16),  # GPT-2's plain heads, a cache under two blocks
        (2, 14, 2, 4096, 128, torch.bfloat16),  # 7 heads a group, 64 slices' worth merged into 32
        (2, 20, 4, 77, 80, torch.float16),  # a head size that is not a power of two
    ],
)
def test_split_kv_kernels_match_the_aten_form_and_sdpa(batch, heads, kv_heads, length, d, dtype):
    query, keys, values, mask, new_keys, new_values = _case(batch, heads, kv_heads, length, d, dtype)
    assert gpu_kernel_applies(query, keys)
    scale = d**-0.5
    out = torch.ops.kiln.decode_attention(query, keys, values, mask, new_keys, new_values, scale)
    want = reference(query, keys, values, mask, new_keys, new_values, scale)
    assert out.shape == (batch, 1, heads, d) and out.dtype == dtype
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    groups = heads // kv_heads
    full_keys = torch.cat([keys, new_keys], 2).repeat_interleave(groups, 1)
    full_values = torch.cat([values, new_values], 2).repeat_interleave(groups, 1)
    full_mask = torch.cat([mask, mask.new_zeros(batch, 1, 1, 1)], -1)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        query.float(), full_keys.float(), full_values.float(), full_mask.float(), scale=scale
    ).transpose(1, 2)
    torch.testing.assert_close(out.float(), sdpa, atol=tol, rtol=tol)


def test_no_mask_and_fp32_keep_the_aten_form():
    query, keys, values, _, new_keys, new_values = _case(1, 8, 2, 256, 64, torch.float16)
    out = torch.ops.kiln.decode_attention(query, keys, values, None, new_keys, new_values, 0.125)
    want = reference(query, keys, values, None, new_keys, new_values, 0.125)
    torch.testing.assert_close(out, want, atol=2e-3, rtol=2e-3)
    assert not gpu_kernel_applies(query.float(), keys.float())  # fp32 packages promise eager's tokens


def test_the_op_captures_in_a_cuda_graph_and_replays_new_inputs():
    query, keys, values, mask, new_keys, new_values = _case(1, 32, 8, 1024, 64, torch.float16)
    args = (query, keys, values, mask, new_keys, new_values, 0.125)
    torch.ops.kiln.decode_attention(*args)  # compiles the kernels outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.kiln.decode_attention(*args)
    keys.copy_(torch.randn_like(keys))
    mask[..., :10] = torch.finfo(torch.float16).min
    graph.replay()
    torch.testing.assert_close(out, reference(*args), atol=2e-3, rtol=2e-3)
