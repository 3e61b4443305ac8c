"""The two programs a causal LM is compiled into for generation, as plain modules torch.export takes.

:class:`Prefill` runs a (left-padded) prompt: ``input_ids [B, T]`` and ``attention_mask [B, T]`` ->
``logits [B, T, V]`` and the cache, one ``[B, kv_heads, max_cache_len, head_dim]`` key tensor and one
value tensor per layer, positions ``0..T-1`` filled. :class:`Decode` runs one token per row against the
cache: ``input_ids [B, 1]``, ``attention_mask [B, max_cache_len]`` (1 where a position holds a real
token, the current one included), ``cache_position [1]`` (where the token's key and value go) and the
cache -> ``logits [B, 1, V]`` and the step's own keys and values, ``[2 * layers, B, kv_heads, 1,
head_dim]`` (every layer's keys, then every layer's values), which the caller writes at
``cache_position`` (:func:`write_slot`).

Nothing is mutated in place: the decode program reads the cache it is given and never copies it. Its
attention (:func:`_decode_attention`, an attention implementation registered with transformers and
used by this program alone) scores the new token against the cache's earlier positions and against its
own key, which the cache does not hold yet; so a step moves the cache once (the attention's read), where
a program returning the updated cache wrote all of it per layer. Both programs are ordinary graphs for
every stage of the pipeline, and both wrap the same module: their weights
are the same tensors under the same names, which is what lets a package store them once. The
attention mask is built here as the 4-D additive mask transformers takes as given (causal over cache
positions, padding masked out), so no model's own mask code runs under export. Position ids count a
row's real tokens (left padding starts each row at 0), as transformers' ``generate`` does.
"""

from __future__ import annotations

import contextvars
import inspect
import sys
from typing import Any

import torch
from torch.export import Dim

from compiler.errors import GenerationError
from compiler.generation.attention import gpu_kernel_applies, reference
from compiler.generation.fuse import fused_projections
from compiler.generation.spec import GenerationSpec


def check_causal_lm(model: torch.nn.Module, where: str = "source") -> None:
    """A transformers causal LM with its head (``*ForCausalLM``), else a GenerationError naming why."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    head = getattr(model, "get_output_embeddings", None)
    if config is None or head is None or head() is None or not hasattr(model, "generate"):
        raise GenerationError(
            f"{where}: {name} has no causal LM head (a transformers *ForCausalLM model with "
            "get_output_embeddings() and generate()); task: text-generation needs one: load the model "
            "with its LM head (an hf: folder saved from a *ForCausalLM, or a factory returning one), or "
            "use another task"
        )


class _Layer:
    """One layer's keys and values, replaced (not mutated) on each update."""

    is_sliding = False
    is_compileable = True
    is_initialized = True

    def __init__(
        self, keys: torch.Tensor | None, values: torch.Tensor | None, position: torch.Tensor, size: int
    ):
        self.keys, self.values, self.position, self.size = keys, values, position, size

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        if self.keys is None:  # prefill: an empty cache of the states' batch, heads and head size
            b, h, _, d = key_states.shape
            self.keys = key_states.new_zeros(b, h, self.size, d)
            self.values = value_states.new_zeros(b, value_states.shape[1], self.size, value_states.shape[-1])
        self.keys = self.keys.index_copy(2, self.position, key_states)
        self.values = self.values.index_copy(2, self.position, value_states)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return 0


class _Slot(_Layer):
    """Decode: the cache as given (read, never written) and the step's own keys and values, kept for
    :func:`_decode_attention`."""

    new_keys: torch.Tensor
    new_values: torch.Tensor

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
        self.new_keys, self.new_values = key_states, value_states
        return self.keys, self.values


ATTENTION = "kiln_decode"  # the attention implementation name Decode runs the model with
# The running Decode's layers, the model's own attention implementation and whether its attention is
# kiln's op (None: by the query's dtype) (trace time only).
_DECODING: contextvars.ContextVar[tuple[list[_Slot], str, bool | None] | None] = contextvars.ContextVar(
    "kiln_decoding", default=None
)


def _decode_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """One new token per row attending to the cache (``key``/``value``: positions before it, as the mask
    allows) and to its own key and value (not in the cache yet): softmax over both, so no cache is
    copied. Grouped query heads share their key head by a reshape (no repeated keys). What this does
    not cover (softcapping, sliding windows, a position bias) runs the model's own attention on the
    cache with the new slot written, as before."""
    layers, original, use_op = _DECODING.get() or ((), "sdpa", None)
    layer = layers[module.layer_idx]
    new_k, new_v = layer.new_keys, layer.new_values
    _, heads, length, d = query.shape
    kv_heads = key.shape[1]
    special = any(kwargs.get(k) is not None for k in ("softcap", "sliding_window", "position_bias"))
    if special or length != 1 or heads % kv_heads:
        keys = key.index_copy(2, layer.position, new_k)
        values = value.index_copy(2, layer.position, new_v)
        if attention_mask is not None:  # the new token's own position, masked for the cache, allowed
            attention_mask = attention_mask.index_fill(-1, layer.position, 0.0)
        return _implementation(module, original)(
            module, query, keys, values, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    scale = d**-0.5 if scaling is None else scaling
    # one op, split-KV Triton kernels (compiler/generation/attention); an fp32 trace compiled at fp16 is
    # told so (use_op): the op picks its kernel by the dtype it runs at
    if use_op is not False and gpu_kernel_applies(query, key, at_any_dtype=bool(use_op)):
        out = torch.ops.kiln.decode_attention(query, key, value, attention_mask, new_k, new_v, scale)
    else:
        out = reference(query, key, value, attention_mask, new_k, new_v, scale)
    return out, None


def _implementation(module: torch.nn.Module, name: str) -> Any:
    """The attention function the model runs as ``name`` (its own module's for ``eager``)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def _register_attention() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTENTION, _decode_attention)


def write_slot(
    keys: list[torch.Tensor], values: list[torch.Tensor], new: torch.Tensor, position: torch.Tensor
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The caches with a decode step's keys and values (``new``, [2 * layers, B, kv_heads, 1, head_dim])
    at ``position``, as new tensors (the functional loop; decoding.py writes its buffers in place)."""
    layers = len(keys)
    return (
        [k.index_copy(2, position, n) for k, n in zip(keys, new[:layers], strict=True)],
        [v.index_copy(2, position, n) for v, n in zip(values, new[layers:], strict=True)],
    )


def _cache(layers: list[_Layer]) -> Any:
    from transformers.cache_utils import Cache

    class FunctionalCache(Cache):
        """transformers' Cache protocol over tensors the program takes and returns."""

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return 0  # position ids and the mask are given: nothing derives them from the cache

    return FunctionalCache(layers=layers)


class _Step(torch.nn.Module):
    def __init__(self, lm: torch.nn.Module, max_cache_len: int):
        super().__init__()
        check_causal_lm(lm)
        self.lm, self.max_cache_len = lm, int(max_cache_len)
        self.layers = int(lm.config.num_hidden_layers)
        parameters = inspect.signature(lm.forward).parameters
        # transformers 5.24 renamed past_key_values to cache (the old name still works, with a warning)
        self._cache_arg = "cache" if "cache" in parameters else "past_key_values"

    def _run(
        self,
        input_ids: torch.Tensor,
        mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache_position: torch.Tensor,
        layers: list[_Layer],
        own: bool = True,
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        positions = torch.arange(self.max_cache_len, device=input_ids.device)
        # own=False (decode): the token's own position is not in the cache it attends to
        at, current = positions[None, None, None, :], cache_position[None, None, :, None]
        causal = at <= current if own else at < current
        allowed = causal & mask[:, None, None, :].bool()
        if own:  # a padded position attends to itself: its row (and the cache it writes, read by no
            # real token) is then a defined value, not a softmax over nothing, which each precision
            # and kernel resolves its own way (fp16 on CUDA: 0.41 relative L2 on a GPT-2's cache)
            allowed = allowed | (at == current)
        dtype = next(self.lm.parameters()).dtype
        additive = torch.where(
            allowed, torch.zeros((), dtype=dtype), torch.full((), torch.finfo(dtype).min, dtype=dtype)
        )
        out = self.lm(
            input_ids=input_ids,
            attention_mask=additive,
            position_ids=position_ids,
            use_cache=True,
            **{self._cache_arg: _cache(layers)},
        )
        return out.logits, [la.keys for la in layers], [la.values for la in layers]


class Prefill(_Step):
    """The prompt pass (see the module docstring)."""

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        batch, length = input_ids.shape
        position = torch.arange(length, device=input_ids.device)
        mask = torch.cat(
            [attention_mask, attention_mask.new_zeros(batch, self.max_cache_len - length)], dim=1
        )
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        layers = [_Layer(None, None, position, self.max_cache_len) for _ in range(self.layers)]
        return self._run(input_ids, mask, position_ids, position, layers)


class Decode(_Step):
    """One token per row against the cache (see the module docstring). ``attention_op``: whether its
    attention is ``kiln::decode_attention`` on the GPU (None: where the traced dtype is fp16/bf16;
    True: also for a model traced in fp32 and compiled at fp16/bf16, by a backend whose engines keep
    kiln's ops, ``BackendRecord.kiln_ops``)."""

    def __init__(self, lm: torch.nn.Module, max_cache_len: int, attention_op: bool | None = None):
        super().__init__(lm, max_cache_len)
        self.attention_op = attention_op

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        cache_position: torch.Tensor,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        position_ids = (attention_mask.sum(-1, keepdim=True) - 1).clamp(min=0)
        layers = [_Slot(k, v, cache_position, self.max_cache_len) for k, v in zip(keys, values, strict=True)]
        config = self.lm.config
        original = config._attn_implementation or "sdpa"
        _register_attention()
        token = _DECODING.set((layers, original, self.attention_op))
        config._attn_implementation = ATTENTION
        try:
            logits, _, _ = self._run(
                input_ids, attention_mask, position_ids, cache_position, layers, own=False
            )
        finally:
            config._attn_implementation = original
            _DECODING.reset(token)
        new = torch.stack([la.new_keys for la in layers] + [la.new_values for la in layers])
        return logits, new.to(keys[0].dtype)


def _token_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(int(v) for v in (value if isinstance(value, list | tuple) else [value]))


def generation_spec(
    lm: torch.nn.Module, *, max_batch: int, max_cache_len: int, prompt_min: int, prompt_max: int
) -> GenerationSpec:
    """The spec of ``lm`` compiled with these limits: the cache layout from one eager prefill of two
    tokens (what the attention layers actually store), token ids from its generation config."""
    check_causal_lm(lm)
    config = lm.config
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if positions is not None and max_cache_len > int(positions):
        raise GenerationError(
            f"max_cache_len {max_cache_len} is over the model's {positions} positions "
            "(max_position_embeddings); lower generation.max_cache_len"
        )
    ids = torch.zeros(1, 2, dtype=torch.long, device=next(lm.parameters()).device)
    with torch.no_grad():
        _, keys, _ = Prefill(lm, max_cache_len)(ids, torch.ones_like(ids))
    _, kv_heads, _, head_dim = keys[0].shape
    generation = getattr(lm, "generation_config", None)
    pad = getattr(generation, "pad_token_id", None)
    pad = config.pad_token_id if pad is None else pad
    eos = getattr(generation, "eos_token_id", None)
    return GenerationSpec(
        max_batch=max_batch,
        max_cache_len=max_cache_len,
        prompt_min=prompt_min,
        prompt_max=prompt_max,
        layers=len(keys),
        kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        cache_dtype=str(keys[0].dtype).removeprefix("torch."),
        vocab_size=int(config.vocab_size),
        pad_token_id=None if pad is None else int(pad),
        eos_token_id=_token_ids(config.eos_token_id if eos is None else eos),
        model_type=str(getattr(config, "model_type", "")),
    )


def program_case(
    lm: torch.nn.Module, spec: GenerationSpec, program: str, attention_op: bool | None = None
) -> tuple[torch.nn.Module, dict[str, Any], dict[str, Any]]:
    """(module, example kwargs, dynamic shapes) of the ``prefill`` or ``decode`` program, with the
    spec's batch and prompt ranges. Example token ids span the vocabulary (validation draws from their
    range), masks span 0..1 and the decode example writes at the longest prompt's end. Both programs
    wrap the model with its q/k/v projections fused (compiler.generation.fuse: one product a layer,
    the same tensors in both). ``attention_op``: see :class:`Decode`."""
    device = next(lm.parameters()).device
    lm = fused_projections(lm)
    generator = torch.Generator().manual_seed(0)
    batch_dim = Dim("batch", min=1, max=spec.max_batch)
    batch = min(2, spec.max_batch)
    if program == "prefill":
        length = min(max(spec.prompt_min, 8), spec.prompt_max)
        ids = torch.randint(0, spec.vocab_size, (batch, length), generator=generator)
        ids.view(-1)[0], ids.view(-1)[-1] = 0, spec.vocab_size - 1
        mask = torch.ones_like(ids)
        mask[-1, 0] = 0  # a left-padded row
        shapes: dict[str, Any] = {"input_ids": {0: batch_dim}, "attention_mask": {0: batch_dim}}
        if spec.prompt_min < spec.prompt_max:
            # torch.export specializes a size-1 axis: a dynamic prompt length starts at 2 (a 1-token
            # prompt is a prompt_min of 1: spec ranges below say where it runs)
            prompt = Dim("prompt", min=max(2, spec.prompt_min), max=spec.prompt_max)
            shapes = {name: {0: batch_dim, 1: prompt} for name in shapes}
        else:
            length = spec.prompt_max
            ids, mask = ids[:, :1].expand(batch, length).clone(), torch.ones(batch, length, dtype=torch.long)
        kwargs = {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
        return Prefill(lm, spec.max_cache_len).eval(), kwargs, shapes
    if program != "decode":
        raise ValueError(f"program {program!r}: 'prefill' or 'decode'")
    dtype = getattr(torch, spec.cache_dtype)
    shape = spec.cache_shape(batch)
    ids = torch.randint(0, spec.vocab_size, (batch, 1), generator=generator)
    ids.view(-1)[0], ids.view(-1)[-1] = 0, spec.vocab_size - 1
    mask = torch.zeros(batch, spec.max_cache_len, dtype=torch.long)
    mask[:, : spec.prompt_max + 1] = 1
    mask[-1, 0] = 0
    kwargs = {
        "input_ids": ids,
        "attention_mask": mask,
        "cache_position": torch.tensor([spec.prompt_max]),
        "keys": [torch.randn(shape, generator=generator).to(dtype) for _ in range(spec.layers)],
        "values": [torch.randn(shape, generator=generator).to(dtype) for _ in range(spec.layers)],
    }
    kwargs = {
        k: [t.to(device) for t in v] if isinstance(v, list) else v.to(device) for k, v in kwargs.items()
    }
    shapes = {
        "input_ids": {0: batch_dim},
        "attention_mask": {0: batch_dim},
        "cache_position": None,
        "keys": [{0: batch_dim}] * spec.layers,
        "values": [{0: batch_dim}] * spec.layers,
    }
    return Decode(lm, spec.max_cache_len, attention_op).eval(), kwargs, shapes
