"""The tasks ``hf:`` sources load, apart from :mod:`zoo.sources.hf`: the zoo schema checks an entry's
``task`` with them, and reading a zoo file never imports torch (``zoo.sources.hf`` does, for its
models)."""

from __future__ import annotations

import re

from zoo.errors import ZooConfigError

# task -> (transformers Auto class, the modeling_auto table naming the model types that have it)
HF_TASKS: dict[str, tuple[str, str]] = {
    "feature-extraction": ("AutoModel", "MODEL_MAPPING_NAMES"),
    "sequence-classification": (
        "AutoModelForSequenceClassification",
        "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
    ),
    "token-classification": (
        "AutoModelForTokenClassification",
        "MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES",
    ),
    "image-classification": (
        "AutoModelForImageClassification",
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    ),
    "causal-lm": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
    # prefill and decode programs with a static KV cache (zoo.generation; also for factory: sources)
    "text-generation": ("AutoModelForCausalLM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES"),
}


def check_task(task: str | None) -> str:
    """The task, or a ZooConfigError naming the field and the tasks there are."""
    if task not in HF_TASKS:
        got = "none given" if task is None else repr(task)
        raise ZooConfigError(f"task: {got} is not a task kiln loads; use one of {', '.join(HF_TASKS)}")
    return task


# transformers' own attention implementations: none of them fetches code. flash_attention_<N> is
# checked apart (check_flash_attention): without its package, transformers fetches a hub kernel instead.
BUILT_IN_ATTENTION = ("eager", "sdpa", "flex_attention", "paged|eager")
_FLASH = re.compile(r"^flash_attention_\d+$")


def attention_problem(value: object) -> str | None:
    """Why an ``attn_implementation`` is refused, or None for transformers' built-in ones.

    Any other value makes transformers look for a kernel on the Hugging Face hub (``org/repo`` ids
    such as ``kernels-community/flash-attn``) and run it: code from outside the source the entry names,
    fetched at load time.
    """
    values = list(value.values()) if isinstance(value, dict) else [value]
    for one in values:
        if one is None or (isinstance(one, str) and (one in BUILT_IN_ATTENTION or _FLASH.match(one))):
            continue
        hub = isinstance(one, str) and "/" in one
        return (
            f"attn_implementation {one!r} is "
            + ("a Hugging Face hub kernel repository" if hub else "not one of transformers' built-in ones")
            + "; transformers would fetch a kernel from the hub and run it, and kiln compiles offline "
            f"from the files the entry names. Use one of {', '.join(BUILT_IN_ATTENTION)} (sdpa is "
            "transformers' default; eager exports everywhere)"
        )
    return None


def check_attention(value: object, where: str) -> None:
    """:func:`attention_problem` as a ZooConfigError starting with ``where``."""
    problem = attention_problem(value)
    if problem is not None:
        raise ZooConfigError(f"{where}: {problem}")
