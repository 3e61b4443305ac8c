"""The two tasks a text-generation entry adds after its programs are validated one by one.

``check_generation`` runs ``generate`` over the two staged programs against the eager model
(greedy tokens, perplexity: ``compiler.generation.validate``) and measures time to first token and
decode tokens/s; ``package_generation`` writes the one package holding both programs over one copy of
the weights (``compiler.generation.package``). Both keep their results in the workspace under content
keys, as every stage does.
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from filelock import FileLock
from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from compiler.package.manifest import SourceRecord
from tasks.refs import PackageRef, ValidatedRef, ValidationFailedError
from tasks.stages import torch_lock
from tasks.workspace import Workspace, code_version, content_hash
from zoo.request import CompileRequest
from zoo.sources.base import SourceIdentity


def _module(prefill: ValidatedRef, decode: ValidatedRef, spec: Any) -> Any:
    from compiler.generation.module import GenerationModule

    return GenerationModule(prefill.staged.load(), decode.staged.load(), spec)


@task(name="validate-generation", cache_policy=NO_CACHE, persist_result=False)
def check_generation(
    request: CompileRequest, prefill: ValidatedRef, decode: ValidatedRef, workspace: str
) -> dict[str, Any]:
    """Greedy tokens (fp32: identical) and perplexity against eager ``generate`` on the entry's recorded
    prompts (else random ones in the range), then speed. ValidationFailedError names each miss."""
    key = content_hash(
        "generation",
        code_version(),
        request.cache_identity(),
        prefill.staged.cache_identity(),
        decode.staged.cache_identity(),
    )
    ws = Workspace(workspace)
    found = ws.get_result("generation", key)
    if found is not None:
        return found
    from compiler.generation.validate import check_agreement, measure_speed, random_prompts, recorded_prompts

    plan = request.generation
    with torch_lock():
        lm = request.load_model().model.to(request.device).eval()
        module = _module(prefill, decode, request.generation.spec(lm))
        prompts = (
            recorded_prompts(plan.prompts, module.spec, plan.samples)
            if plan.prompts is not None
            else random_prompts(module.spec, plan.samples, seed=request.validation.seed)
        )
        report = check_agreement(
            lm,
            module,
            prompts,
            max_new_tokens=plan.max_new_tokens,
            perplexity_rel_tol=plan.perplexity_rel_tol,
            exact_tokens=request.options.precision == "fp32",
        )
        if not report["passed"]:
            raise ValidationFailedError(f"{request.name}: " + "; ".join(report["failures"]))
        report["speed"] = measure_speed(module, lm, runs=request.validation.runs // 5 or 1)
        report["spec"] = module.spec.to_json()  # what the package records (the model is not loaded again)
    get_run_logger().info(
        "%s: greedy tokens agree on %d/%d prompt batches, perplexity %.5g (eager %.5g)",
        request.name,
        round(report["token_agreement"] * report["prompt_batches"]),
        report["prompt_batches"],
        report["perplexity"],
        report["eager_perplexity"],
    )
    ws.put_result("generation", key, report)
    return report


@task(name="package-generation", cache_policy=NO_CACHE, persist_result=False)
def package_generation(
    prefill: ValidatedRef,
    decode: ValidatedRef,
    report: dict[str, Any],
    out_path: str,
    workspace: str,
    source: SourceIdentity | None = None,
) -> PackageRef:
    """One package: the prefill program with generation.json and the decode program inside, written to
    this run's own copy first and then into place under a lock (as ``package_model``)."""
    from compiler.generation.package import save_generation
    from compiler.generation.spec import GenerationSpec

    start = time.perf_counter()
    mine = Workspace(workspace).dir(f"runs/{uuid.uuid4().hex}") / Path(out_path).name
    target = Path(out_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    lineage = (
        SourceRecord(source.uri, source.kind, source.version, source.digest, source.run_id)
        if source is not None
        else None
    )
    with torch_lock():
        validation = {k: v for k, v in report.items() if k != "spec"}
        module = _module(
            prefill, decode, GenerationSpec.from_json({**report["spec"], "validation": validation})
        )
        # The weights both programs' engines take at fp16/bf16 are stored so (compiler.save).
        final = {"validation": prefill.report, "source": lineage, "engine_precision_weights": True}
        info = save_generation(module, mine, **final)
        with FileLock(str(target.parent / f".{target.name}.lock")):
            save_generation(module, target, **final)
    get_run_logger().info("package %s (%d bytes, %.2fs)", target, info.bytes, time.perf_counter() - start)
    return PackageRef(str(target), info.content_hash, info.bytes, str(mine))


@task(name="generation-gates", cache_policy=NO_CACHE, persist_result=False)
def generation_gates(
    request: CompileRequest,
    lm: Any,
    candidate: Any,
    champion: Any | None,
    champion_version: str | None,
    max_ratio: float,
    runs: int = 30,
) -> dict[str, Any]:
    """A release's gates for a generation version: ``accuracy`` (greedy tokens and perplexity against
    the eager ``lm`` on the entry's prompts, as at compile), ``latency`` (time per decode step against
    the champion's, interleaved), ``reasons`` and ``failed_measures``: each reason starts with the
    measure it names (``generation.token_agreement``, ``generation.perplexity``,
    ``decode_tokens_per_s``; ``generation`` for a candidate that is no generation package)."""
    from compiler.generation.module import GenerationModule
    from compiler.generation.validate import (
        check_agreement,
        compare_decode_speed,
        random_prompts,
        recorded_prompts,
    )

    if not isinstance(candidate, GenerationModule):
        reason = (
            "generation: the candidate is not a generation package (no decode program); compile it from "
            "the zoo entry (task: text-generation)"
        )
        return {"accuracy": {}, "latency": {}, "reasons": [reason], "failed_measures": ["generation"]}
    plan = request.generation
    lm = lm.to(candidate.device).eval()
    prompts = (
        recorded_prompts(plan.prompts, candidate.spec, plan.samples)
        if plan.prompts is not None
        else random_prompts(candidate.spec, plan.samples, seed=request.validation.seed)
    )
    accuracy = check_agreement(
        lm,
        candidate,
        prompts,
        max_new_tokens=plan.max_new_tokens,
        perplexity_rel_tol=plan.perplexity_rel_tol,
        exact_tokens=request.options.precision == "fp32",
    )
    failed = [f"generation.{measure}" for measure in accuracy["failed_measures"]]
    reasons = [
        f"{measure}: {text} vs the original model"
        for measure, text in zip(failed, accuracy["failures"], strict=True)
    ]
    gates = {"accuracy": accuracy, "reasons": reasons, "failed_measures": failed}
    if champion is None or not isinstance(champion, GenerationModule):
        why = (
            "no champion yet" if champion is None else f"the champion (v{champion_version}) does not generate"
        )
        note = f"{why}: no decode speed to compare"
        return {**gates, "latency": {"passed": True, "note": note, "max_ratio": max_ratio}}
    try:
        speed = compare_decode_speed(candidate, champion, runs=max(1, runs // 5))
    except ValueError as exc:
        return {**gates, "latency": {"passed": True, "note": f"not compared: {exc}", "max_ratio": max_ratio}}
    slow = [b for b in speed["batches"] if not speed[f"ratio_batch{b}"] <= max_ratio]
    for batch in slow:
        mine, theirs = (
            speed[f"{side}_decode_tokens_per_s_batch{batch}"] for side in ("candidate", "champion")
        )
        reasons.append(
            f"decode_tokens_per_s: {mine:.1f} tokens/s at batch {batch}, a decode step "
            f"{speed[f'ratio_batch{batch}']:.2f}x the champion's (v{champion_version}, {theirs:.1f} "
            f"tokens/s); the limit is {max_ratio:.2f}x (--max-latency-ratio)"
        )
    speed.update(measure="decode_tokens_per_s", max_ratio=max_ratio, passed=not slow)
    failed += ["decode_tokens_per_s"] if slow else []
    return {**gates, "latency": speed}
