"""Model factories for tests, benchmarks and the example zoo: real architectures, random weights.

Each factory returns a :class:`ModelCase`: the model in eval mode, example inputs, and the dynamic
shapes torch.export should use. Configs are tiny so the whole zoo compiles on a 2-core CPU in minutes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.export import Dim


@dataclass
class ModelCase:
    model: nn.Module
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    dynamic_shapes: Any = None


def _seeded(seed: int) -> None:
    torch.manual_seed(seed)


def tiny_bert(num_layers: int = 2, hidden: int = 64, seed: int = 0, seq_len: int = 16) -> ModelCase:
    """BERT encoder, dynamic batch (1..8) and sequence length (4..max(64, 2*seq_len))."""
    from transformers import BertConfig, BertModel

    _seeded(seed)
    max_seq = max(64, 2 * seq_len)
    config = BertConfig(
        vocab_size=512,
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4 if hidden < 256 else hidden // 64,
        intermediate_size=hidden * 4,
        max_position_embeddings=max_seq,
        attn_implementation="eager",
    )
    model = BertModel(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, seq_len))
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=4, max=max_seq)
    shapes = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    return ModelCase(model, (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, shapes)


def bert_encoder(num_layers: int, hidden: int = 128, seed: int = 0) -> ModelCase:
    """A BERT-shaped encoder of a given depth, for dedup benchmarks."""
    return tiny_bert(num_layers=num_layers, hidden=hidden, seed=seed)


def tiny_vit(seed: int = 0, image: int = 32, hidden: int = 64, num_layers: int = 2) -> ModelCase:
    """ViT, dynamic batch (1..8)."""
    from transformers import ViTConfig, ViTModel

    _seeded(seed)
    config = ViTConfig(
        image_size=image,
        patch_size=8 if image <= 64 else 16,
        num_channels=3,
        hidden_size=hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4 if hidden < 256 else hidden // 64,
        intermediate_size=hidden * 2 if hidden < 256 else hidden * 4,
        attn_implementation="eager",
    )
    model = ViTModel(config, add_pooling_layer=False).eval()
    return ModelCase(
        model,
        (),
        {"pixel_values": torch.randn(2, 3, image, image)},
        {"pixel_values": {0: Dim("batch", min=1, max=8)}},
    )


def tiny_resnet(seed: int = 0, image: int = 64, resnet18: bool = False) -> ModelCase:
    """HF ResNet, dynamic batch (1..8); ``resnet18=True`` gives ResNet-18's stages."""
    from transformers import ResNetConfig, ResNetModel

    _seeded(seed)
    config = ResNetConfig(
        num_channels=3,
        embedding_size=64 if resnet18 else 16,
        hidden_sizes=[64, 128, 256, 512] if resnet18 else [16, 32],
        depths=[2, 2, 2, 2] if resnet18 else [1, 1],
        layer_type="basic",
    )
    model = ResNetModel(config).eval()
    return ModelCase(
        model,
        (),
        {"pixel_values": torch.randn(2, 3, image, image)},
        {"pixel_values": {0: Dim("batch", min=1, max=8)}},
    )


class _LogitsOnly(nn.Module):
    """GPT-2 without its cache: returns logits only, so no cache objects cross the export boundary."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=input_ids, use_cache=False).logits


def tiny_gpt2(seed: int = 0, hidden: int = 64, num_layers: int = 2, seq_len: int = 16) -> ModelCase:
    """GPT-2 language model (no cache), dynamic batch (1..8) and sequence length."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _seeded(seed)
    max_seq = max(64, 2 * seq_len)
    config = GPT2Config(
        vocab_size=512,
        n_positions=max_seq,
        n_embd=hidden,
        n_layer=num_layers,
        n_head=4 if hidden < 256 else hidden // 64,
        bos_token_id=0,
        eos_token_id=0,
        attn_implementation="eager",
    )
    model = _LogitsOnly(GPT2LMHeadModel(config).eval()).eval()
    ids = torch.randint(0, config.vocab_size, (2, seq_len))
    return ModelCase(model, (ids,), {}, ({0: Dim("batch", min=1, max=8), 1: Dim("seq", min=4, max=max_seq)},))


def _lm_case(model: nn.Module, vocab: int) -> ModelCase:
    """A causal LM with its head and cache (``task: text-generation`` wraps it in its two programs)."""
    ids = torch.randint(0, vocab, (1, 8))
    return ModelCase(model.eval(), (ids,), {}, None)


def tiny_gpt2_lm(seed: int = 0, hidden: int = 64, num_layers: int = 2, positions: int = 128) -> ModelCase:
    """GPT-2 with its LM head and KV cache, for generation (initializer_range 0.2: random weights that
    do not greedily repeat one token, so token agreement means something)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    _seeded(seed)
    config = GPT2Config(
        vocab_size=512,
        n_positions=positions,
        n_embd=hidden,
        n_layer=num_layers,
        n_head=4,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,
        attn_implementation="eager",
    )
    return _lm_case(GPT2LMHeadModel(config), config.vocab_size)


def tiny_llama_lm(
    seed: int = 0, hidden: int = 64, num_layers: int = 2, positions: int = 128, pad: bool = True
) -> ModelCase:
    """A Llama-style decoder (RMSNorm, rotary positions, SwiGLU, grouped-query attention: 4 query heads
    over 2 key/value heads) with its LM head; ``pad=False``: a config without a pad token."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _grouped_query_lm(LlamaConfig, LlamaForCausalLM, seed, hidden, num_layers, positions, pad=pad)


def tiny_qwen2_lm(seed: int = 0, hidden: int = 32, num_layers: int = 2, positions: int = 128) -> ModelCase:
    """A Qwen2 decoder (a third family: Llama's layout with biases on the query, key and value
    projections; grouped-query attention, 4 query heads over 2 key/value heads) with its LM head
    (initializer_range 0.2, as tiny_gpt2_lm's)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return _grouped_query_lm(
        Qwen2Config, Qwen2ForCausalLM, seed, hidden, num_layers, positions, initializer_range=0.2
    )


def _grouped_query_lm(
    config_class: type,
    model_class: type,
    seed: int,
    hidden: int,
    num_layers: int,
    positions: int,
    *,
    pad: bool = True,
    **extra: Any,
) -> ModelCase:
    """The layout Llama and Qwen2 share: vocabulary 512, an MLP twice as wide, 4 query heads over 2
    key/value heads, SDPA attention; ``extra``: the family's own config fields."""
    _seeded(seed)
    config = config_class(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=positions,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0 if pad else None,
        attn_implementation="sdpa",
        **extra,
    )
    return _lm_case(model_class(config), config.vocab_size)


@torch.library.custom_op("kiln_zoo::soft_sign_clip", mutates_args=())
def soft_sign_clip(x: torch.Tensor) -> torch.Tensor:
    """An op no engine backend knows: it has no ONNX translation, so it must fall back to PyTorch."""
    return x / (1 + x.abs()) * 2.0


@soft_sign_clip.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class MLPWithFallback(nn.Module):
    """Two engine-friendly blocks around an op that no backend supports."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.head = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
        self.tail = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tail(soft_sign_clip(self.head(x)))


def mlp_with_fallback(width: int = 64, seed: int = 0) -> ModelCase:
    _seeded(seed)
    return ModelCase(
        MLPWithFallback(width).eval(), (torch.randn(4, width),), {}, ({0: Dim("batch", min=1, max=32)},)
    )


class RepeatedFallbackBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(soft_sign_clip(self.fc1(x))))


class RepeatedFallbackModel(nn.Module):
    """A fallback op in every block: capability partitioning yields many structurally equal engines."""

    def __init__(self, depth: int = 6, width: int = 64):
        super().__init__()
        self.blocks = nn.Sequential(*(RepeatedFallbackBlock(width) for _ in range(depth)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def repeated_fallback(depth: int = 6, width: int = 64, seed: int = 0) -> ModelCase:
    _seeded(seed)
    return ModelCase(
        RepeatedFallbackModel(depth, width).eval(),
        (torch.randn(4, width),),
        {},
        ({0: Dim("batch", min=1, max=32)},),
    )


class OverflowBlock(nn.Module):
    def __init__(self, width: int, scale: float = 1.0):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.norm = nn.LayerNorm(width)
        with torch.no_grad():  # a "hot" block: same structure, weights that overflow fp16
            self.fc2.weight.mul_(scale)
            self.fc2.bias.mul_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(torch.relu(self.fc1(x))))


class OverflowModel(nn.Module):
    """``blocks`` residual blocks and a classifier head; block ``hot`` overflows fp16 before its norm."""

    def __init__(
        self, width: int = 64, blocks: int = 12, hot: int = 7, scale: float = 1e5, classes: int = 10
    ):
        super().__init__()
        self.blocks = nn.ModuleList(OverflowBlock(width, scale if i == hot else 1.0) for i in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def overflow_blocks(width: int = 32, blocks: int = 4, hot: int = 2, seed: int = 0) -> ModelCase:
    """Residual blocks, one of which overflows fp16 (accuracy repair's case), dynamic batch (1..16)."""
    _seeded(seed)
    return ModelCase(
        OverflowModel(width, blocks, hot).eval(),
        (torch.randn(4, width),),
        {},
        ({0: Dim("batch", min=1, max=16)},),
    )


class OutlierBlock(nn.Module):
    """``x + fc2(relu(fc1(x) * s) / s)``: with ``s`` all ones a plain MLP block; in a "hot" block one
    channel of ``s`` is 1e4, so the activation after the multiply spans 1e4 in one channel and ~1 in
    the rest: one int8 scale per tensor rounds the rest to zero. Same structure either way."""

    def __init__(self, width: int, hot: bool = False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        scale = torch.ones(2 * width)
        if hot:
            scale[0] = 1e4
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x) * self.scale) / self.scale)


class SensitiveModel(nn.Module):
    def __init__(self, width: int = 32, blocks: int = 8, hot: int = 5, classes: int = 10):
        super().__init__()
        self.blocks = nn.ModuleList(OutlierBlock(width, i == hot) for i in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sensitive_blocks(width: int = 32, blocks: int = 4, hot: int = 2, seed: int = 0) -> ModelCase:
    """Residual blocks, one of which int8 cannot represent (the int8 gate's case), batch 4."""
    _seeded(seed)
    return ModelCase(SensitiveModel(width, blocks, hot).eval(), (torch.randn(4, width),))


def small_bert() -> ModelCase:
    """MiniLM-sized BERT (6 layers, 384 wide, sequence 128): a realistic size for latency benchmarks."""
    return tiny_bert(num_layers=6, hidden=384, seq_len=128)


def small_vit() -> ModelCase:
    """DeiT-small-sized ViT (224 px, patch 16, 6 layers, 384 wide)."""
    return tiny_vit(image=224, hidden=384, num_layers=6)


def small_resnet() -> ModelCase:
    """ResNet-18 stages on 224 px images."""
    return tiny_resnet(image=224, resnet18=True)


def small_gpt2() -> ModelCase:
    """DistilGPT-2-sized (6 layers, 384 wide, sequence 128)."""
    return tiny_gpt2(hidden=384, num_layers=6, seq_len=128)


FACTORIES = {
    "tiny_bert": tiny_bert,
    "tiny_vit": tiny_vit,
    "tiny_resnet": tiny_resnet,
    "tiny_gpt2": tiny_gpt2,
    "mlp_with_fallback": mlp_with_fallback,
    "repeated_fallback": repeated_fallback,
    "small_bert": small_bert,
    "small_vit": small_vit,
    "small_resnet": small_resnet,
    "small_gpt2": small_gpt2,
}
