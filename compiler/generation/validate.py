"""Validating a compiled generation module against the eager model, and measuring its speed.

* Greedy tokens: on each prompt batch, the compiled ``generate`` and transformers' eager ``generate``
  (same prompts, mask, pad and eos); fp32 must give identical tokens. Where they differ, the first
  diverging position (counted from the end of the prompt) and the largest logits error of every step
  up to it are reported.
* Perplexity: on the same token sequences (prompts, the recorded text), the prefill program's logits
  against the eager model's, as perplexity; within ``perplexity_rel_tol`` of eager.
* Speed (no pass/fail here): time to first token at two prompt lengths (batch 1), and decode tokens/s
  at batch 1 and at ``max_batch`` (8 where allowed), compiled and eager through the same loop.

The report is plain data (``generation.json``'s ``validation``, MLflow metrics).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence
from typing import Any

import torch

from compiler.errors import ValidationDataError
from compiler.generation.module import GenerationModule
from compiler.generation.spec import GenerationSpec
from compiler.generation.step import Decode, Prefill

Prompt = tuple[torch.Tensor, torch.Tensor]  # (input_ids [B, T], attention_mask [B, T]), left-padded


def random_prompts(spec: GenerationSpec, samples: int = 4, seed: int = 0, low: int = 0) -> list[Prompt]:
    """``samples`` prompts inside the compiled range: one at the longest length alone, one at the
    shortest alone, the rest as one left-padded batch of random lengths (at most ``max_batch``)."""
    generator = torch.Generator().manual_seed(seed)
    vocab = spec.vocab_size

    def ids(batch: int, length: int) -> torch.Tensor:
        return torch.randint(low, vocab, (batch, length), generator=generator)

    prompts = [(ids(1, spec.prompt_max), torch.ones(1, spec.prompt_max, dtype=torch.long))]
    if samples > 1:
        prompts.append((ids(1, spec.prompt_min), torch.ones(1, spec.prompt_min, dtype=torch.long)))
    rest = min(max(samples - 2, 0), spec.max_batch)
    if rest:
        lengths = torch.randint(spec.prompt_min, spec.prompt_max + 1, (rest,), generator=generator)
        longest = int(lengths.max())
        batch, mask = ids(rest, longest), torch.zeros(rest, longest, dtype=torch.long)
        for row, n in enumerate(lengths.tolist()):
            mask[row, longest - n :] = 1
            batch[row, : longest - n] = spec.pad_token_id or 0
        prompts.append((batch, mask))
    return prompts


def recorded_prompts(path: str, spec: GenerationSpec, samples: int) -> list[Prompt]:
    """Prompts from a ``.safetensors``/``.npz`` file: ``input_ids [N, T]`` (and ``attention_mask``, left
    padding), taken ``max_batch`` rows at a time, at most ``samples`` rows."""
    from pathlib import Path

    from compiler.inputs.data import read_arrays

    arrays = read_arrays(Path(path))
    if "input_ids" not in arrays:
        raise ValidationDataError(
            f"generation.validation.prompts: {path} has no 'input_ids' array (it has {sorted(arrays)}); "
            "record the prompts' token ids as input_ids [samples, length]"
        )
    ids = torch.as_tensor(arrays["input_ids"]).long()
    mask = (
        torch.as_tensor(arrays["attention_mask"]).long()
        if "attention_mask" in arrays
        else torch.ones_like(ids)
    )
    if ids.dim() != 2 or mask.shape != ids.shape:
        raise ValidationDataError(
            f"generation.validation.prompts: {path}: input_ids must be [samples, length] and "
            f"attention_mask the same shape; got {tuple(ids.shape)} and {tuple(mask.shape)}"
        )
    ids, mask = ids[:samples], mask[:samples]
    return [
        (ids[i : i + spec.max_batch], mask[i : i + spec.max_batch])
        for i in range(0, len(ids), spec.max_batch)
    ]


def _first_divergence(got: torch.Tensor, want: torch.Tensor, prompt: int) -> int | None:
    n = min(got.shape[1], want.shape[1])
    differ = (got[:, prompt:n] != want[:, prompt:n]).any(0).nonzero()
    if len(differ):
        return int(differ[0])
    return None if got.shape[1] == want.shape[1] else n - prompt


def _nll(logits: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor) -> tuple[float, int]:
    """(summed next-token loss, positions) over real (unmasked) positions."""
    logp = torch.log_softmax(logits[:, :-1].double(), -1)
    nll = -logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    keep = (mask[:, 1:] * mask[:, :-1]).bool()
    return float(nll[keep].sum()), int(keep.sum())


def check_agreement(
    lm: torch.nn.Module,
    module: GenerationModule,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int,
    perplexity_rel_tol: float,
    exact_tokens: bool,
) -> dict[str, Any]:
    """Greedy tokens and perplexity against eager (see the module docstring); ``passed`` and, where it
    failed, ``failures`` naming each miss and the field to change."""
    spec, device = module.spec, module.device
    agree, total, divergences, step_errors = 0, 0, [], []
    nll = {"compiled": [0.0, 0], "eager": [0.0, 0]}
    eos = list(spec.eos_token_id) or None
    for ids, mask in prompts:
        ids, mask = ids.to(device), mask.to(device)
        short = module.prompt_floor - ids.shape[1]
        if short > 0:  # as generate pads it: left, masked (the eager model gets the same prompt)
            ids = torch.cat([ids.new_full((ids.shape[0], short), spec.pad_token_id or 0), ids], 1)
            mask = torch.cat([mask.new_zeros(mask.shape[0], short), mask], 1)
        new = min(max_new_tokens, spec.max_cache_len - ids.shape[1])
        got = module.generate(ids, mask, max_new_tokens=new, output_logits=True)
        with torch.no_grad():
            want = lm.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=new,
                do_sample=False,
                pad_token_id=spec.pad_token_id if spec.pad_token_id is not None else 0,
                eos_token_id=eos,
                output_logits=True,
                return_dict_in_generate=True,
            )
            # positions count real tokens, as generate (and the compiled prefill) count them
            positions = (mask.cumsum(-1) - 1).clamp(min=0)
            eager_logits = lm(input_ids=ids, attention_mask=mask, position_ids=positions).logits
        where = _first_divergence(got, want.sequences, ids.shape[1])
        total += 1
        agree += int(where is None)
        if where is not None:
            divergences.append(where)
        errors = [
            float((a.float() - b.float()).abs().max())
            for a, b in zip(module.last_logits, want.logits, strict=False)
        ]
        step_errors.append(errors[: (where + 1) if where is not None else len(errors)])
        compiled_logits = module.prefill(input_ids=ids, attention_mask=mask)[0]
        for name, logits in (("compiled", compiled_logits), ("eager", eager_logits)):
            loss, count = _nll(logits, ids, mask)
            nll[name][0] += loss
            nll[name][1] += count
    # perplexity over every real position of every prompt (none: a prompt of single tokens, 1.0)
    compiled_ppl, eager_ppl = (math.exp(s / n) if n else 1.0 for s, n in (nll["compiled"], nll["eager"]))
    rel = abs(compiled_ppl - eager_ppl) / eager_ppl
    failures, failed = [], []  # failed: the measures that missed (token_agreement, perplexity)
    if exact_tokens and agree < total:
        failed.append("token_agreement")
        failures.append(
            f"greedy tokens differ from eager generate on {total - agree} of {total} prompt batches (first "
            f"at new token {min(divergences)}); fp32 must match exactly: check the model exports faithfully, "
            "or set on_accuracy_failure/precision"
        )
    if not rel <= perplexity_rel_tol:
        failed.append("perplexity")
        failures.append(
            f"perplexity {compiled_ppl:.6g} vs eager {eager_ppl:.6g} (relative {rel:.3g}) is over "
            f"generation.validation.perplexity_rel_tol {perplexity_rel_tol:g}"
        )
    return {
        "prompt_batches": total,
        "token_agreement": agree / total if total else 1.0,
        "first_divergence": min(divergences) if divergences else None,
        "max_step_logits_error": max((max(e) for e in step_errors if e), default=0.0),
        "step_logits_error": [round(max(col), 8) for col in zip(*step_errors, strict=False)]
        if step_errors
        else [],
        "perplexity": compiled_ppl,
        "eager_perplexity": eager_ppl,
        "perplexity_rel_error": rel,
        "perplexity_rel_tol": perplexity_rel_tol,
        "max_new_tokens": max_new_tokens,
        "passed": not failures,
        "failures": failures,
        "failed_measures": failed,
    }


def _median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def measure_speed(
    module: GenerationModule, lm: torch.nn.Module | None = None, *, runs: int = 3, new_tokens: int = 16
) -> dict[str, Any]:
    """Time to first token at two prompt lengths (batch 1) and decode tokens/s at batch 1 and 8 (or
    ``max_batch``), for ``module`` and, with ``lm``, its eager programs through the same loop. On CUDA
    also ``<name>_peak_gpu_memory_bytes``: the most the process held allocated on the device while that
    module generated (its weights, static cache, graphs and activations, with what the process held
    before: the other module's weights too, where both are loaded)."""
    spec = module.spec
    modules = {"compiled": module}
    if lm is not None:
        modules["eager"] = GenerationModule(
            Prefill(lm, spec.max_cache_len), Decode(lm, spec.max_cache_len), spec
        )
    short = max(module.prompt_floor, min(8, spec.prompt_max))
    lengths = sorted({short, spec.prompt_max})
    batches = sorted({1, min(8, spec.max_batch)})
    generator = torch.Generator().manual_seed(0)
    result: dict[str, Any] = {"prompt_lengths": lengths, "batches": batches}
    cuda = module.device.type == "cuda"
    for name, m in modules.items():
        if cuda:
            torch.cuda.synchronize(module.device)
            torch.cuda.reset_peak_memory_stats(module.device)
        for length in lengths:
            ids = torch.randint(0, spec.vocab_size, (1, length), generator=generator).to(module.device)
            times = []
            for _ in range(runs + 1):
                m.generate(ids, max_new_tokens=1, eos_token_id=[])
                times.append(m.last_times.prefill)
            result[f"{name}_ttft_ms_prompt{length}"] = round(_median(times[1:]) * 1e3, 4)
        steps = max(2, min(new_tokens, spec.max_cache_len - short))
        for batch in batches:
            ids = torch.randint(0, spec.vocab_size, (batch, short), generator=generator).to(module.device)
            m.generate(ids, max_new_tokens=2, eos_token_id=[])  # warm-up
            per_step = []
            for _ in range(runs):
                m.generate(ids, max_new_tokens=steps, eos_token_id=[])
                per_step += m.last_times.decode
            result[f"{name}_decode_tokens_per_s_batch{batch}"] = round(batch / _median(per_step), 2)
        if cuda:
            result[f"{name}_peak_gpu_memory_bytes"] = int(torch.cuda.max_memory_allocated(module.device))
    result["measured_at"] = time.strftime("%Y-%m-%d")
    return result


def compare_decode_speed(
    candidate: GenerationModule,
    champion: GenerationModule,
    *,
    runs: int = 5,
    new_tokens: int = 16,
    seed: int = 0,
) -> dict[str, Any]:
    """Time per decode step of two generation modules on the same prompts, run by run interleaved (a
    release's speed gate: both in this process, on this machine): at batch 1 and at the largest batch
    both take (at most 8), at a prompt length both take. ``ratio_batch<B>``: the candidate's median
    step time over the champion's. ValueError when the two share no prompt length."""
    a, b = candidate.spec, champion.spec
    top = min(a.prompt_max, b.prompt_max)
    length = min(max(candidate.prompt_floor, champion.prompt_floor, min(8, top)), top)
    if length < max(candidate.prompt_floor, champion.prompt_floor):
        raise ValueError(
            f"no prompt length both take (candidate {a.prompt_min}..{a.prompt_max}, champion "
            f"{b.prompt_min}..{b.prompt_max})"
        )
    steps = max(2, min(new_tokens, a.max_cache_len - length, b.max_cache_len - length))
    batches = sorted({1, min(8, a.max_batch, b.max_batch)})
    generator = torch.Generator().manual_seed(seed)
    modules = {"candidate": candidate, "champion": champion}
    result: dict[str, Any] = {"prompt_length": length, "new_tokens": steps, "batches": batches, "runs": runs}
    for batch in batches:
        ids = torch.randint(0, min(a.vocab_size, b.vocab_size), (batch, length), generator=generator)
        for m in modules.values():  # warm-up
            m.generate(ids.to(m.device), max_new_tokens=2, eos_token_id=[])
        steps_s: dict[str, list[float]] = {name: [] for name in modules}
        for _ in range(max(1, runs)):
            for name, m in modules.items():
                m.generate(ids.to(m.device), max_new_tokens=steps, eos_token_id=[])
                steps_s[name] += m.last_times.decode
        medians = {name: _median(times) for name, times in steps_s.items()}
        for name, median in medians.items():
            result[f"{name}_decode_tokens_per_s_batch{batch}"] = round(batch / median, 2)
        result[f"ratio_batch{batch}"] = medians["candidate"] / medians["champion"]
    return result
