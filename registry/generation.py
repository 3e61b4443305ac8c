"""What a generation package adds to its MLflow run: the generation report as metrics (no torch).

``generation.token_agreement`` (share of prompt batches whose greedy tokens equal eager ``generate``'s),
``generation.first_divergence`` (where they differ), ``generation.max_step_logits_error``,
``generation.perplexity`` / ``generation.eager_perplexity`` / ``generation.perplexity_rel_error``,
``ttft_ms.prompt<N>`` (time to first token at two prompt lengths, batch 1) and
``decode_tokens_per_s.batch<B>`` (batch 1 and 8) and, on CUDA, ``peak_gpu_memory_bytes``, each also for
the eager programs (``eager_...``).

And the logged model's signature, which says how to call it: ``generate`` (:func:`generation_signature`).
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

from compiler import json_reader
from compiler.errors import PackageJsonError
from compiler.generation.spec import GENERATION_FILE, GenerationSpec
from compiler.package.check import read_verified
from compiler.package.manifest import Manifest

_REPORT = ("token_agreement", "first_divergence", "max_step_logits_error", "perplexity", "eager_perplexity")


def generation_metrics(package_dir: Path, manifest: Manifest) -> dict[str, float]:
    """The run's generation metrics; none for a package that is not a generation package."""
    if GENERATION_FILE not in manifest.files:
        return {}
    where = f"{package_dir}/{GENERATION_FILE}"
    raw = read_verified(package_dir, GENERATION_FILE, manifest)
    spec = GenerationSpec.from_json(json_reader.loads(raw, where, error=PackageJsonError))
    report = spec.validation
    metrics = {
        f"generation.{k}": _number(report[k], where, f"validation.{k}")
        for k in (*_REPORT, "perplexity_rel_error")
        if report.get(k) is not None
    }
    metrics.update(
        {"generation.max_batch": float(spec.max_batch), "generation.max_cache_len": float(spec.max_cache_len)}
    )
    metrics.update(speed_metrics(report.get("speed") or {}, where))
    return metrics


def speed_metrics(speed: Any, where: str = "the generation report") -> dict[str, float]:
    """The run's metrics from a generation report's ``speed`` (what ``measure_speed`` in
    compiler.generation.validate measured): the compiled programs' measures under their own names, the
    eager programs' with ``eager_``. A measure that is not a finite number (a package rewritten after
    its compile) is a PackageJsonError naming it and ``where``."""
    if not isinstance(speed, dict):
        raise PackageJsonError(f"{where}: validation.speed is {type(speed).__name__}, not an object")
    metrics: dict[str, float] = {}
    for key, value in speed.items():
        for side in ("compiled", "eager"):
            prefix = "" if side == "compiled" else "eager_"
            if key.startswith(f"{side}_ttft_ms_prompt"):
                name = f"{prefix}ttft_ms.prompt{key.rsplit('prompt', 1)[1]}"
            elif key.startswith(f"{side}_decode_tokens_per_s_batch"):
                name = f"{prefix}decode_tokens_per_s.batch{key.rsplit('batch', 1)[1]}"
            elif key == f"{side}_peak_gpu_memory_bytes":
                name = f"{prefix}peak_gpu_memory_bytes"
            else:
                continue
            metrics[name] = _number(value, where, f"validation.speed.{key}")
    return metrics


def _number(value: Any, where: str, field: str) -> float:
    """``value`` as a metric: a finite int or float (not a bool), else PackageJsonError naming ``field``."""
    number = math.inf
    if isinstance(value, int | float) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):  # an int past float's range stays inf
            number = float(value)
    if not math.isfinite(number):
        raise PackageJsonError(f"{where}: {field} is {str(value)[:80]!r}, not a finite number")
    return number


def read_spec(package_dir: Path, manifest: Manifest) -> GenerationSpec | None:
    """The package's generation spec (checked against the manifest), or None for another package."""
    if GENERATION_FILE not in manifest.files:
        return None
    raw = read_verified(package_dir, GENERATION_FILE, manifest)
    return GenerationSpec.from_json(
        json_reader.loads(raw, f"{package_dir}/{GENERATION_FILE}", error=PackageJsonError)
    )


def generate_params(spec: GenerationSpec) -> dict[str, Any]:
    """``generate``'s settings as the logged model takes them (``predict(..., params=...)``), with
    their defaults: ``top_k`` 0 and ``top_p`` 1.0 leave sampling unlimited."""
    return {
        "max_new_tokens": 16,
        "do_sample": False,
        "temperature": 1.0,
        "top_k": 0,
        "top_p": 1.0,
        "seed": 0,
        "eos_token_id": list(spec.eos_token_id),
    }


def generation_signature(spec: GenerationSpec) -> Any:
    """The MLflow signature of a generation package: ``input_ids`` and ``attention_mask`` int64
    [batch, prompt] in, ``output_ids`` int64 [batch, prompt + new] out (what ``generate`` returns), the
    settings as parameters (:func:`generate_params`)."""
    import numpy as np
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ParamSchema, ParamSpec, Schema, TensorSpec

    ids = np.dtype("int64")
    inputs = Schema([TensorSpec(ids, (-1, -1), "input_ids"), TensorSpec(ids, (-1, -1), "attention_mask")])
    kinds = {"max_new_tokens": "long", "do_sample": "boolean", "temperature": "double", "top_k": "long",
             "top_p": "double", "seed": "long", "eos_token_id": "long"}  # fmt: skip
    params = ParamSchema(
        [
            ParamSpec(name, kinds[name], value, (-1,) if isinstance(value, list) else None)
            for name, value in generate_params(spec).items()
        ]
    )
    return ModelSignature(
        inputs=inputs, outputs=Schema([TensorSpec(ids, (-1, -1), "output_ids")]), params=params
    )


def generation_example(spec: GenerationSpec) -> tuple[dict[str, Any], dict[str, Any]]:
    """The logged model's input example (MLflow runs it once when the model is logged): the shortest
    prompt, one new token."""
    import numpy as np

    ids = np.zeros((1, spec.prompt_min), dtype=np.int64)
    return {"input_ids": ids, "attention_mask": np.ones_like(ids)}, {"max_new_tokens": 1}
