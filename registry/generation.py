"""What a generation package adds to its MLflow run: the generation report as metrics (no torch).

``generation.token_agreement`` (share of prompt batches whose greedy tokens equal eager ``generate``'s),
``generation.first_divergence`` (where they differ), ``generation.max_step_logits_error``,
``generation.perplexity`` / ``generation.eager_perplexity`` / ``generation.perplexity_rel_error``,
``ttft_ms.prompt<N>`` (time to first token at two prompt lengths, batch 1) and
``decode_tokens_per_s.batch<B>`` (batch 1 and 8), each also for the eager programs (``eager_...``).
"""

from __future__ import annotations

from pathlib import Path

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
        f"generation.{k}": float(report[k])
        for k in (*_REPORT, "perplexity_rel_error")
        if report.get(k) is not None
    }
    metrics.update(
        {"generation.max_batch": float(spec.max_batch), "generation.max_cache_len": float(spec.max_cache_len)}
    )
    for key, value in (report.get("speed") or {}).items():
        for side in ("compiled", "eager"):
            prefix = "" if side == "compiled" else "eager_"
            if key.startswith(f"{side}_ttft_ms_prompt"):
                metrics[f"{prefix}ttft_ms.prompt{key.rsplit('prompt', 1)[1]}"] = float(value)
            elif key.startswith(f"{side}_decode_tokens_per_s_batch"):
                metrics[f"{prefix}decode_tokens_per_s.batch{key.rsplit('batch', 1)[1]}"] = float(value)
    return metrics
