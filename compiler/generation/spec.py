"""GenerationSpec: what a generation package was compiled for, as data (no torch).

A package compiled for text generation holds two programs over one copy of the weights: *prefill*
(the prompt: ``input_ids``, ``attention_mask`` -> logits at every prompt position and the filled
key/value cache) and *decode* (one token per row against the cache -> its logits and the updated
cache). The cache is static: one ``[batch, kv_heads, max_cache_len, head_dim]`` tensor of keys and one
of values per layer, passed in and returned (functional), so both programs compile through the same
pipeline as any forward pass. This record says the limits a call is checked against (batch, prompt
length, cache length), the cache's layout and the token ids generation needs; it is
``generation.json`` in the package, listed (and so hashed and signed) with the prefill package's files.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from compiler.backends.capabilities import capabilities
from compiler.errors import GenerationError, PackageCorruptError, PackageVersionError
from compiler.typed_json import ANY, ListOf, Opt, Record, check

GENERATION_FILE = "generation.json"
DECODE_DIR = "decode"  # the decode program's package, inside the prefill package's directory
GENERATION_FORMAT = 1

_SCHEMA = Record(
    {
        "format": int,
        "max_batch": int,
        "max_cache_len": int,
        "prompt_min": int,
        "prompt_max": int,
        "layers": int,
        "kv_heads": int,
        "head_dim": int,
        "cache_dtype": str,
        "vocab_size": int,
        "pad_token_id": Opt(int),
        "eos_token_id": ListOf(int),
        "model_type": str,
        "decode_content_hash": str,
        "validation": ANY,
    },
    required=frozenset(
        {"format", "max_batch", "max_cache_len", "prompt_min", "prompt_max", "layers", "kv_heads", "head_dim"}
    ),
)


@dataclass(frozen=True)
class GenerationSpec:
    """The limits and cache layout of a generation package (see the module docstring)."""

    max_batch: int
    max_cache_len: int
    prompt_min: int
    prompt_max: int
    layers: int
    kv_heads: int
    head_dim: int
    cache_dtype: str = "float32"
    vocab_size: int = 0
    pad_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    model_type: str = ""
    decode_content_hash: str = ""  # the decode package's manifest hash: binds it to this package
    validation: dict[str, Any] = field(default_factory=dict)  # compiler.generation.validate's report

    def __post_init__(self) -> None:
        problems = []
        if self.max_batch < 1:
            problems.append(f"max_batch is {self.max_batch}; at least 1 (generation.max_batch)")
        if not 1 <= self.prompt_min <= self.prompt_max:
            problems.append(
                f"prompt length range [{self.prompt_min}, {self.prompt_max}] needs 1 <= min <= max "
                "(generation.prompt_length)"
            )
        if self.max_cache_len <= self.prompt_max:
            problems.append(
                f"max_cache_len {self.max_cache_len} leaves no room to generate after a prompt of "
                f"{self.prompt_max} tokens; raise generation.max_cache_len above generation.prompt_length.max"
            )
        if problems:
            raise GenerationError("; ".join(problems))
        object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    def cache_shape(self, batch: int) -> tuple[int, int, int, int]:
        """One layer's key (or value) cache for ``batch`` rows."""
        return (batch, self.kv_heads, self.max_cache_len, self.head_dim)

    def cache_bytes(self, batch: int) -> int:
        """Bytes of the whole cache (keys and values of every layer) at ``batch`` rows."""
        itemsize = {"float32": 4, "float16": 2, "bfloat16": 2}.get(self.cache_dtype, 4)
        b, h, c, d = self.cache_shape(batch)
        return 2 * self.layers * b * h * c * d * itemsize

    def check_call(self, batch: int, prompt: int, max_new_tokens: int) -> None:
        """A generate call fits the compiled limits: else a GenerationError naming the limit and field."""
        if batch > self.max_batch:
            raise GenerationError(
                f"batch of {batch} prompts is over max_batch {self.max_batch}; split the batch, or raise "
                "generation.max_batch and recompile"
            )
        if prompt > self.prompt_max:
            raise GenerationError(
                f"prompt of {prompt} tokens is longer than the compiled range [{self.prompt_min}, "
                f"{self.prompt_max}]; shorten it, or raise generation.prompt_length.max and recompile"
            )
        if prompt < self.prompt_min:
            raise GenerationError(
                f"prompt of {prompt} tokens is shorter than the compiled range [{self.prompt_min}, "
                f"{self.prompt_max}]; pad it (left, with the attention mask), or lower "
                "generation.prompt_length.min and recompile"
            )
        if max_new_tokens < 1:
            raise GenerationError(f"max_new_tokens is {max_new_tokens}; ask for at least 1")
        if prompt + max_new_tokens > self.max_cache_len:
            raise GenerationError(
                f"a prompt of {prompt} tokens and max_new_tokens {max_new_tokens} need a cache of "
                f"{prompt + max_new_tokens} positions; the cache holds {self.max_cache_len}: ask for at most "
                f"{self.max_cache_len - prompt} new tokens, or raise generation.max_cache_len and recompile"
            )

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["eos_token_id"] = list(self.eos_token_id)
        return {"format": GENERATION_FORMAT, **data}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> GenerationSpec:
        """Checked against the schema first (a PackageCorruptError names a field of the wrong type)."""
        check(data, _SCHEMA, "generation")
        if data["format"] > GENERATION_FORMAT:
            raise PackageVersionError(
                f"{GENERATION_FILE} is format {data['format']}; this kiln reads up to {GENERATION_FORMAT}: "
                "upgrade kiln"
            )
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["eos_token_id"] = tuple(values.get("eos_token_id", ()))
        values["validation"] = dict(values.get("validation") or {})
        try:
            return cls(**values)
        except GenerationError as exc:  # limits no compile writes: the file is not what kiln wrote
            raise PackageCorruptError(f"{GENERATION_FILE}: {exc}") from None


def program_options(program: str, backend: str, device: str, options: Mapping[str, Any]) -> dict[str, Any]:
    """The compile options one generation program is built with (``backend_options`` and ``profiles``
    of :class:`compiler.options.CompileOptions`): the operator's ``options``, and for the decode program
    its backend's settings for bandwidth-bound programs on this device kind where the operator set none
    (its record's ``decode_options``: Inductor autotunes its GEMMs on CUDA, batch 1 specialized)."""
    chosen = {
        "backend_options": dict(options.get("backend_options") or {}),
        "profiles": options.get("profiles") or (),
    }
    if program == "decode":
        defaults = capabilities(backend).decode_options.get(device.split(":")[0], {})
        given = chosen["backend_options"]
        given.update({k: v for k, v in defaults.get("backend_options", {}).items() if k not in given})
        chosen["profiles"] = tuple(chosen["profiles"]) or tuple(defaults.get("profiles", ()))
    return chosen
