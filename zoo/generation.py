"""A zoo entry's ``generation:`` block (``task: text-generation``) and the plan a request carries.

::

    task: text-generation
    generation:
      max_batch: 8                 # prompts per call (the programs' batch range is 1..max_batch)
      max_cache_len: 128           # positions of the static KV cache: prompt + new tokens
      prompt_length: {min: 1, max: 64}
      pad_token_id: null           # where the model's config names none and batches are padded
      validation:
        prompts: null              # .safetensors/.npz with input_ids [N, T] (+ attention_mask); else random
        samples: 4                 # prompts compared with eager greedy generate
        max_new_tokens: 16
        perplexity_rel_tol: null   # |ppl - eager ppl| / eager ppl, on the prompts; null: by precision
                                   # (PERPLEXITY_REL_TOL: fp32 1e-4, fp16 2e-3, bf16 1.6e-2)

The entry compiles into two programs (``compiler.generation.step``): a request per program
(``GenerationPlan.program``) goes through export, partition, build and assemble like any model, and the
two are validated and packaged together (flows/generation.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pydantic import Field, model_validator

from zoo.settings import _Strict

if TYPE_CHECKING:  # a plan is data; torch only where the model is loaded
    import torch

    from compiler.generation.spec import GenerationSpec

TASK = "text-generation"
PROGRAMS = ("prefill", "decode")
# Perplexity's default tolerance by precision: about two units in the last place of the format's
# mantissa (fp16 eps 9.8e-4, bf16 7.8e-3), fp32 as tight as its sums allow. Measured on the H100: a
# random-weight GPT-2 in fp16 was 2.6e-4 off eager, well inside 2e-3 (1e-4 for every precision failed it).
PERPLEXITY_REL_TOL = {"fp32": 1e-4, "fp16": 2e-3, "bf16": 1.6e-2}


class PromptLength(_Strict):
    min: int = Field(default=1, ge=1)
    max: int = Field(ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> PromptLength:
        if self.min > self.max:
            raise ValueError(f"prompt_length min {self.min} > max {self.max}; set min <= max")
        return self


class GenerationValidation(_Strict):
    prompts: str | None = Field(
        default=None, description="recorded prompts: input_ids [N, T] (+ attention_mask), left-padded"
    )
    samples: int = Field(default=4, ge=1, description="prompts compared with eager greedy generate")
    max_new_tokens: int = Field(default=16, ge=1)
    perplexity_rel_tol: float | None = Field(
        default=None, gt=0, description="None: by the entry's precision (PERPLEXITY_REL_TOL)"
    )


class GenerationOptions(_Strict):
    max_batch: int = Field(default=8, ge=1, le=1024)
    max_cache_len: int = Field(ge=2, le=1 << 20, description="static KV cache positions: prompt + new tokens")
    prompt_length: PromptLength
    pad_token_id: int | None = Field(default=None, ge=0, description="where the model's config has none")
    validation: GenerationValidation = Field(default_factory=GenerationValidation)

    @model_validator(mode="after")
    def _room(self) -> GenerationOptions:
        if self.max_cache_len <= self.prompt_length.max:
            raise ValueError(
                f"max_cache_len {self.max_cache_len} leaves no room for new tokens after a prompt of "
                f"{self.prompt_length.max}; raise generation.max_cache_len above prompt_length.max"
            )
        return self

    def plan(self, prompts: str | None = None, precision: str = "fp32") -> GenerationPlan:
        v = self.validation
        tolerance = v.perplexity_rel_tol or PERPLEXITY_REL_TOL[precision]
        return GenerationPlan(
            self.max_batch,
            self.max_cache_len,
            self.prompt_length.min,
            self.prompt_length.max,
            self.pad_token_id,
            prompts if prompts is not None else v.prompts,
            v.samples,
            v.max_new_tokens,
            tolerance,
        )


@dataclass(frozen=True)
class GenerationPlan:
    """What a request compiles for generation (the entry's block as data); ``program`` names which of
    the two programs a per-program request exports (None: the whole entry)."""

    max_batch: int
    max_cache_len: int
    prompt_min: int
    prompt_max: int
    pad_token_id: int | None = None
    prompts: str | None = None
    samples: int = 4
    max_new_tokens: int = 16
    perplexity_rel_tol: float = 1e-4
    program: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))

    def spec(self, lm: torch.nn.Module) -> GenerationSpec:
        """The compiled limits for ``lm`` (cache layout from the model; a GenerationError names why not)."""
        import dataclasses

        from compiler.generation.step import generation_spec

        spec = generation_spec(
            lm,
            max_batch=self.max_batch,
            max_cache_len=self.max_cache_len,
            prompt_min=self.prompt_min,
            prompt_max=self.prompt_max,
        )
        if self.pad_token_id is not None:
            spec = dataclasses.replace(spec, pad_token_id=self.pad_token_id)
        return spec
