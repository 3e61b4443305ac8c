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
        info = save_generation(module, mine, validation=prefill.report, source=lineage)
        with FileLock(str(target.parent / f".{target.name}.lock")):
            save_generation(module, target, validation=prefill.report, source=lineage)
    get_run_logger().info("package %s (%d bytes, %.2fs)", target, info.bytes, time.perf_counter() - start)
    return PackageRef(str(target), info.content_hash, info.bytes, str(mine))
