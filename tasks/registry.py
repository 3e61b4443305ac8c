"""Prefect tasks over ``registry/``: record a validated package, and the steps of a release.

Thin on purpose: retries with back-off against the tracking server live in ``registry.config`` (so
the same policy holds outside Prefect), which is why these tasks set no Prefect retries. Results stay
in memory (loaded modules are not serialisable) and are never cached: a release must measure now.

The original model a release measures against comes from the compile request of the zoo file the
operator names (trusted input), never from a registry tag: tags are data, and reading them runs no
code (docs/security.md).
"""

from __future__ import annotations

from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

import compiler
from compiler.inputs.data import sample_inputs
from compiler.inputs.specs import check_inputs
from compiler.validation.report import Tolerances
from compiler.validation.validate import measure_latency
from registry import config
from registry.errors import ReleaseError
from registry.lookup import fetch_version, load_package
from registry.models import CHAMPION, TAG_REJECTED, all_versions, get_aliases
from registry.release import GateReport, ReleaseOutcome, apply_decision
from registry.tracking import record_package as _record_package
from registry.transfer import ProgressCallback
from registry.zoo_runs import current_zoo_run, end_run, zoo_run_for
from zoo.request import CompileRequest


def _prefect_zoo_parent() -> str | None:
    """The MLflow zoo run of the Prefect flow run this one is nested in (e.g. recompile-zoo), if any."""
    from prefect.runtime import flow_run

    root, current = flow_run.root_flow_run_id, flow_run.id
    if not root or not current or str(root) == str(current):
        return None  # a model compiled on its own (kiln compile): no zoo run to nest under
    return zoo_run_for(str(root), f"zoo-{str(root)[:8]}")


@task(name="record-package", cache_policy=NO_CACHE, persist_result=False, tags=["mlflow"])
def record_package(
    package_dir: str,
    request: CompileRequest,
    *,
    parent_run_id: str | None = None,
    on_progress: ProgressCallback | None = None,
) -> dict:
    """Log ``package_dir`` to MLflow and register it (idempotent; a re-run completes an interrupted one).

    The run nests under ``parent_run_id``, else the :func:`registry.zoo_runs.zoo_run` of this context,
    else the zoo run of the enclosing Prefect flow run (found or created by its id). Raises
    ``RegistryUnavailableError`` when the server stays away: the package stays on disk and the run is
    marked failed; calling again later completes it. ``on_progress`` sees the upload file by file
    (:mod:`registry.transfer`); the task's log gets a line every 10 % or 5 s either way.
    """
    parent = parent_run_id or current_zoo_run()
    automatic = False
    if parent is None:
        parent = _prefect_zoo_parent()
        automatic = parent is not None
    result = _record_package(
        package_dir, model=request.name, request=request, parent_run_id=parent, on_progress=on_progress
    ).to_dict()
    if automatic:
        # Nobody else ends a zoo run found this way: it ends with its latest model (set again by each).
        end_run(parent, "FINISHED")
    return result


@task(name="resolve-candidate", cache_policy=NO_CACHE, persist_result=False)
def resolve_candidate(name: str, version: str | None) -> dict:
    """The version to release (given, else the newest neither champion nor rejected), and the champion."""
    mlclient = config.client()
    versions = all_versions(mlclient, name)
    if not versions:
        raise ReleaseError(f"{name} has no registered versions; record a package first (kiln zoo)")
    champion = get_aliases(mlclient, name).get(CHAMPION)
    by_number = {str(v.version): v for v in versions}
    if version is not None:
        if str(version) not in by_number:
            raise ReleaseError(f"{name} has no version {version}; registered: {sorted(by_number, key=int)}")
        chosen = str(version)
    else:
        open_ = [
            str(v.version) for v in versions if str(v.version) != champion and TAG_REJECTED not in v.tags
        ]
        if not open_:
            raise ReleaseError(
                f"{name} has no candidate: every version is the champion ({champion}) or rejected; "
                "name one with --version"
            )
        chosen = open_[0]
    return {"name": name, "candidate": chosen, "champion": champion, "tags": dict(by_number[chosen].tags)}


@task(name="fetch-and-load", cache_policy=NO_CACHE, persist_result=False)
def fetch_and_load(name: str, version: str, allowed_modules: tuple[str, ...] = ()) -> Any:
    """Download a version, verify every checksum and its content hash, load it (importing only the
    custom-op modules the zoo file's request trusts)."""
    package_dir, _, _ = fetch_version(config.client(), name, version)
    return load_package(package_dir, allowed_modules=allowed_modules)


@task(name="rebuild-original", cache_policy=NO_CACHE, persist_result=False)
def rebuild_original(request: CompileRequest) -> torch.nn.Module:
    """The original eager model, built from the zoo file's request exactly as the zoo flow built it."""
    return request.load_case().model


@task(name="accuracy-gate", cache_policy=NO_CACHE, persist_result=False)
def accuracy_gate(
    original: Any,
    candidate: Any,
    tolerances: Tolerances,
    samples: int = 3,
    seed: int = 0,
    data: str | compiler.ValidationData | None = None,
) -> dict:
    """A compiled version vs the original model: on ``data`` (the entry's recorded inputs, a file or
    read for this version's specs: ``ValidationPlan.dataset``) when given, else on fresh inputs inside
    the spec ranges (min, max, random)."""
    result = compiler.validate(original, candidate, samples=samples, warmup=1, runs=3, seed=seed, data=data)
    failures = [f for f in result.failures(tolerances) if not f.startswith("latency")]
    report = result.to_dict()
    return {
        "max_rel_l2": report["max_rel_l2"],
        "min_cosine": report["min_cosine"],
        "tolerances": tolerances.to_dict(),
        "outputs": report["outputs"],
        "shapes": report["shapes"],
        "data_source": report["data_source"],
        "failures": failures,
        "passed": not failures,
    }


@task(name="latency-gate", cache_policy=NO_CACHE, persist_result=False)
def latency_gate(
    candidate: Any, champion: Any | None, max_ratio: float, warmup: int = 5, runs: int = 30, seed: int = 0
) -> dict:
    """Candidate vs champion, same process, same inputs, interleaved runs; ratio of medians."""
    if champion is None:
        return {"passed": True, "note": "no champion yet: nothing to compare against", "max_ratio": max_ratio}
    generator = torch.Generator().manual_seed(seed)
    flat = sample_inputs(candidate.input_specs, "opt", generator)
    try:
        check_inputs(champion.input_specs, flat)
    except Exception:
        # The candidate's opt shape is outside the champion's ranges: time at the champion's opt.
        flat = sample_inputs(champion.input_specs, "opt", generator)
        check_inputs(candidate.input_specs, flat)
    # Where both run (a CUDA version's inputs on its GPU: sample_inputs makes them on the CPU).
    flat = [t.to(candidate.device) for t in flat]
    with torch.no_grad():
        timed = measure_latency(
            {"candidate": lambda: candidate.run_flat(flat), "champion": lambda: champion.run_flat(flat)},
            warmup=warmup,
            runs=runs,
        )
    cand, champ = timed["candidate"], timed["champion"]
    ratio = cand.median_ms / champ.median_ms if champ.median_ms else float("inf")
    return {
        "candidate_median_ms": cand.median_ms,
        "candidate_p95_ms": cand.p95_ms,
        "champion_median_ms": champ.median_ms,
        "champion_p95_ms": champ.p95_ms,
        "ratio": ratio,
        "max_ratio": max_ratio,
        "runs": runs,
        "shapes": [list(t.shape) for t in flat],
        "passed": ratio <= max_ratio,
    }


@task(name="apply-release-decision", cache_policy=NO_CACHE, persist_result=False)
def decide(report: GateReport, live: dict | None = None) -> ReleaseOutcome:
    """``live``: a Triton server to move with the champion (``serving.triton.live.TritonRelease``'s
    arguments: url, repository, model, target, timeout, tracking_uri)."""
    from serving.triton.live import triton_release

    return apply_decision(report, live=triton_release(live))
