"""GenerationModule: a prefill and a decode program with their spec, and ``generate`` over them.

The two programs are anything with the signatures of :mod:`compiler.generation.step` (compiled modules
loaded from a package, or the eager ``Prefill``/``Decode`` wrappers themselves, which is how validation
runs the same loop on both). ``generate`` checks the call against the spec first (a GenerationError
naming the limit and the zoo field), runs the prompt once, then one decode step per new token against
the static cache, greedy or sampled on the device, and returns the prompt followed by the new tokens,
rows that finished (``eos_token_id``) padded with the pad token: the layout transformers' ``generate``
returns, so the two compare position by position.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from compiler.errors import GenerationError
from compiler.generation.decoding import StaticDecode
from compiler.generation.spec import GenerationSpec
from compiler.generation.step import write_slot

Program = Callable[..., Any]


@dataclass
class StepTimes:
    """Where the last ``generate`` call's time went (seconds): the prompt pass and each decode step."""

    prefill: float = 0.0
    decode: list[float] = field(default_factory=list)


class GenerationModule(torch.nn.Module):
    """Prefill and decode over one copy of the weights; calling it runs the prefill program."""

    def __init__(self, prefill: Program, decode: Program, spec: GenerationSpec, *, static_cache: bool = True):
        super().__init__()
        self.prefill, self.decode, self.spec = prefill, decode, spec
        # static_cache: decode steps run on preallocated buffers updated in place, captured as CUDA
        # graphs where allowed (compiler.generation.decoding); False: each step's program returns a
        # new cache that the next step takes (the functional loop, kept to check the other against).
        self.static_cache = static_cache
        self._static: StaticDecode | None = None
        self.last_times = StepTimes()
        self.last_logits: list[torch.Tensor] = []

    # What the rest of kiln reads off a loaded package describes the prefill program (the package's
    # manifest is its manifest); the decode program's are ``module.decode.<name>``.
    @property
    def input_specs(self) -> tuple:
        return self.prefill.input_specs

    @property
    def report(self) -> Any:
        return self.prefill.report

    @property
    def validation(self) -> Any:
        return self.prefill.validation

    @property
    def load_seconds(self) -> dict[str, float]:
        return self.prefill.load_seconds

    @property
    def device(self) -> torch.device:
        return getattr(self.prefill, "device", None) or next(self.prefill.parameters()).device

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.prefill(*args, **kwargs)

    @property
    def prompt_floor(self) -> int:
        """The shortest prompt the prefill program takes (shorter ones are left-padded up to it)."""
        specs = getattr(self.prefill, "input_specs", None)
        return int(specs[0].min_shape[1]) if specs else self.spec.prompt_min

    def static_decode(self) -> StaticDecode:
        """The static cache and step runner of the decode program (made on first use; ``.graphed`` and
        ``.reason`` say whether steps replay CUDA graphs and why not)."""
        if self._static is None or self._static.decode is not self.decode:
            self._static = StaticDecode(self.decode, self.spec, self.device)
        return self._static

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        *,
        max_new_tokens: int = 16,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        eos_token_id: int | Sequence[int] | None = None,
        pad_token_id: int | None = None,
        output_logits: bool = False,
        on_token: Callable[[torch.Tensor, bool], Any] | None = None,
    ) -> torch.Tensor:
        """Token ids ``[batch, prompt + new]``: the (left-padded) prompts, then up to ``max_new_tokens``
        tokens each, greedy unless ``do_sample`` (``temperature``, then ``top_k``, then ``top_p``, drawn
        with a generator seeded by ``seed``). ``eos_token_id`` (default: the model's) ends a row; rows
        that ended early and prompts shorter than the compiled minimum are filled with ``pad_token_id``
        (default: the model's). ``output_logits``: each step's last-position logits are kept in
        ``module.last_logits`` (validation compares them with eager ones). ``on_token(tokens, last)``: called
        as each step's tokens are picked, before the next step runs (what streaming sends): ``tokens``
        [batch] on the device (a row that ended holds the pad token), ``last`` True on the final call."""
        spec = self.spec
        ids, mask = self._prompt(input_ids, attention_mask)
        batch, length = ids.shape
        spec.check_call(batch, max(length, spec.prompt_min), max_new_tokens)
        eos = spec.eos_token_id if eos_token_id is None else _ids(eos_token_id)
        pad = spec.pad_token_id if pad_token_id is None else int(pad_token_id)
        _check_sampling(do_sample, temperature, top_k, top_p)
        padded = bool((mask == 0).any())
        floor = self.prompt_floor
        if length < floor or padded or (eos and batch > 1):
            _need_pad(
                pad,
                "a padded batch"
                if padded
                else "prompts shorter than the compiled minimum"
                if length < floor
                else "rows that end early (eos_token_id) in a batch",
            )
        if length < floor:  # left-pad up to what the prefill program takes: masked, never attended
            fill = floor - length
            ids = torch.cat([ids.new_full((batch, fill), pad), ids], dim=1)
            mask = torch.cat([mask.new_zeros(batch, fill), mask], dim=1)
            length = floor
        spec.check_call(batch, length, max_new_tokens)
        generator = None
        if do_sample:
            generator = torch.Generator(device=ids.device)
            generator.manual_seed(0 if seed is None else int(seed))
        timer = _Timer(ids.device)
        timer.mark()
        logits, keys, values = self.prefill(input_ids=ids, attention_mask=mask)
        token = _pick(logits[:, -1], do_sample, temperature, top_k, top_p, generator)
        timer.mark()
        self.last_logits = [logits[:, -1]] if output_logits else []
        done = torch.zeros(batch, dtype=torch.bool, device=ids.device)
        eos_ids = torch.tensor(eos, dtype=ids.dtype, device=ids.device) if eos else None
        out = [ids]
        static = self.static_decode() if self.static_cache else None
        cache_mask = bucket = None
        with static.lock if static is not None else contextlib.nullcontext():
            for step in range(max_new_tokens):
                if eos_ids is not None:
                    token = torch.where(done, torch.full_like(token, pad), token)
                out.append(token[:, None])
                ended = step == max_new_tokens - 1
                if eos_ids is not None:
                    done |= torch.isin(token, eos_ids)
                    ended = ended or bool(done.all())
                if on_token is not None:
                    on_token(token, ended)
                if ended:
                    break
                if static is not None:
                    if bucket is None:
                        bucket = static.start(keys, values, mask, length)
                    last = static.step(bucket, token)
                else:  # the functional loop: a new cache each step
                    if cache_mask is None:
                        cache_mask = mask.new_zeros(batch, spec.max_cache_len)
                        cache_mask[:, :length] = mask
                    position = length + step
                    cache_mask[:, position] = 1
                    at = torch.tensor([position], device=ids.device)
                    step_out = self.decode(
                        input_ids=token[:, None],
                        attention_mask=cache_mask,
                        cache_position=at,
                        keys=list(keys),
                        values=list(values),
                    )
                    if len(step_out) == 2:  # the step's keys and values, written here
                        logits, new = step_out
                        keys, values = write_slot(list(keys), list(values), new, at)
                    else:  # an earlier kiln's decode program: the updated caches
                        logits, keys, values = step_out
                    last = logits[:, -1]
                if static is not None and not do_sample:  # picked inside the step: nothing launched here
                    token = static.greedy_token(bucket, batch)
                else:
                    token = _pick(last, do_sample, temperature, top_k, top_p, generator)
                timer.mark()
                if output_logits:
                    self.last_logits.append(last.clone())
        spans = timer.spans()
        times = StepTimes(spans[0], spans[1:])
        self.last_times = times
        return torch.cat(out, dim=1)

    def _prompt(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
            raise GenerationError(
                "input_ids must be an integer tensor [batch, prompt length] (token ids); got "
                f"{getattr(input_ids, 'shape', type(input_ids).__name__)}"
            )
        ids = input_ids.to(device=self.device, dtype=torch.long)
        vocab = self.spec.vocab_size
        if vocab and ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            # named here: past the embedding table it is an index error inside a kernel (or garbage)
            raise GenerationError(f"input_ids holds token id {bad}, outside the vocabulary 0..{vocab - 1}")
        if attention_mask is None:
            return ids, torch.ones_like(ids)
        if tuple(attention_mask.shape) != tuple(ids.shape):
            raise GenerationError(
                f"attention_mask has shape {tuple(attention_mask.shape)}; it must match input_ids "
                f"{tuple(ids.shape)}"
            )
        mask = attention_mask.to(device=self.device, dtype=torch.long)
        if bool(((mask != 0) & (mask != 1)).any()):
            raise GenerationError("attention_mask holds values other than 0 and 1")
        # Left padding only: a 0 after a 1 in a row is right padding, which would put pad tokens
        # between the prompt and what follows it.
        if bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise GenerationError(
                "attention_mask pads on the right; generation needs prompts padded on the left "
                "(tokenizer.padding_side = 'left')"
            )
        if bool((mask.sum(-1) == 0).any()):
            raise GenerationError("attention_mask has a row with no tokens; every prompt needs at least one")
        return ids, mask


class _Timer:
    """Marks on the device's timeline (CUDA events: no sync per step), read once at the end."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[Any] = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def spans(self) -> list[float]:
        """Seconds between consecutive marks."""
        if self.cuda and self.marks:
            self.marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:], strict=False)]
        return [b - a for a, b in zip(self.marks, self.marks[1:], strict=False)]


def _ids(value: int | Sequence[int]) -> tuple[int, ...]:
    return (int(value),) if isinstance(value, int) else tuple(int(v) for v in value)


def _need_pad(pad: int | None, why: str) -> None:
    if pad is None:
        raise GenerationError(
            f"{why} needs a pad token, and neither the model's config nor its generation config names "
            "one (pad_token_id); set generation.pad_token_id in the zoo entry (any id: padded positions "
            "are masked out), or pass pad_token_id= to generate"
        )


def _check_sampling(do_sample: bool, temperature: float, top_k: int | None, top_p: float | None) -> None:
    if not do_sample:
        return
    if not temperature > 0:
        raise GenerationError(f"temperature {temperature} must be > 0 (or do_sample=False for greedy)")
    if top_k is not None and top_k < 1:
        raise GenerationError(f"top_k {top_k} must be >= 1 (or None for no limit)")
    if top_p is not None and not 0 < top_p <= 1:
        raise GenerationError(f"top_p {top_p} must be in (0, 1] (or None for no limit)")


def _pick(
    logits: torch.Tensor,
    do_sample: bool,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """The next token of each row, on the device: argmax, or a draw after temperature, top-k, top-p
    (transformers' order)."""
    if not do_sample:
        return logits.argmax(-1)
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        ordered, order = torch.sort(scores, descending=True, dim=-1)
        cumulative = ordered.softmax(-1).cumsum(-1)
        drop = cumulative - ordered.softmax(-1) > top_p  # keep the smallest set reaching top_p
        scores = scores.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = scores.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
