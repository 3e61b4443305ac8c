"""The tasks ``hf:`` sources load, apart from :mod:`zoo.sources.hf`: the zoo schema checks an entry's
``task`` with them, and reading a zoo file never imports torch (``zoo.sources.hf`` does, for its
models)."""

from __future__ import annotations

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
}


def check_task(task: str | None) -> str:
    """The task, or a ZooConfigError naming the field and the tasks there are."""
    if task not in HF_TASKS:
        got = "none given" if task is None else repr(task)
        raise ZooConfigError(f"task: {got} is not a task kiln loads; use one of {', '.join(HF_TASKS)}")
    return task
