"""Prefect tasks over ``registry/``: record a validated package, and the steps of a release.

Thin on purpose: retries with back-off against the tracking server live in ``registry.config`` (so
the same policy holds outside Prefect), which is why these tasks set no Prefect retries. Results stay
in memory (loaded modules are not serialisable) and are never cached: a release must measure now.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Mapping
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NO_CACHE

from compiler.validate import DEFAULT_REL_L2  # the precision defaults, when the zoo entry sets none
from registry import config
from registry.errors import ReleaseError
from registry.lookup import fetch_version, load_package
from registry.models import CHAMPION, TAG_REJECTED, all_versions, get_aliases
from registry.release import GateReport, ReleaseOutcome, apply_decision
from registry.tracking import current_zoo_run, end_run, zoo_run_for
from registry.tracking import record_package as _record_package


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
    entry: Any = None,
    report: Mapping[str, Any] | None = None,
    *,
    parent_run_id: str | None = None,
) -> dict:
    """Log ``package_dir`` to MLflow and register it (idempotent; a re-run completes an interrupted one).

    The run nests under ``parent_run_id``, else the :func:`registry.tracking.zoo_run` of this context,
    else the zoo run of the enclosing Prefect flow run (found or created by its id). Raises
    ``RegistryUnavailableError`` when the server stays away: the package stays on disk and the run is
    marked failed; calling again later completes it.
    """
    parent = parent_run_id or current_zoo_run()
    automatic = False
    if parent is None:
        parent = _prefect_zoo_parent()
        automatic = parent is not None
    result = _record_package(package_dir, entry, report, parent_run_id=parent).to_dict()
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
def fetch_and_load(name: str, version: str) -> Any:
    """Download a version, verify every checksum and its content hash, load it."""
    package_dir, _, tags = fetch_version(config.client(), name, version)
    return load_package(package_dir, tags)


def build_original(tags: Mapping[str, str]) -> Any:
    """Rebuild the original eager model from the version's zoo entry (factory, kwargs, seed).

    Built exactly as the zoo flow built it (``tasks.model_case.load_case``), so the weights match.
    """
    from flows.zoo_config import ZooEntry, resolve_factory

    entry = json.loads(tags["zoo_entry"]) if tags.get("zoo_entry") else {}
    factory_path = entry.get("factory") or tags.get("factory")
    if not factory_path:
        raise ReleaseError(
            "the version carries no 'factory' tag (it was not recorded from a zoo entry), so its accuracy "
            "cannot be re-validated against the original model"
        )
    try:
        parsed = ZooEntry.model_validate(
            {"name": tags.get("model", "model"), **entry, "factory": factory_path}
        )
    except Exception:  # an entry written by another kiln version: rebuild from its plain fields below
        parsed = None
    if parsed is not None:
        from tasks.model_case import load_case

        return load_case(parsed).model
    factory = resolve_factory(factory_path)
    kwargs = dict(entry.get("factory_kwargs") or {})
    seed = int(entry.get("seed", 0))
    try:
        if "seed" in inspect.signature(factory).parameters and "seed" not in kwargs:
            kwargs["seed"] = seed
    except (TypeError, ValueError):
        pass
    torch.manual_seed(seed)
    case = factory(**kwargs)
    model = getattr(case, "model", case[0] if isinstance(case, tuple) else case)
    return model.eval() if hasattr(model, "eval") else model


@task(name="rebuild-original", cache_policy=NO_CACHE, persist_result=False)
def rebuild_original(tags: Mapping[str, str]) -> Any:
    return build_original(tags)


def tolerance_for(tags: Mapping[str, str], override: float | None = None) -> float:
    """The accuracy tolerance the zoo entry asks for (rel L2), else the precision's default."""
    if override is not None:
        return float(override)
    entry = json.loads(tags["zoo_entry"]) if tags.get("zoo_entry") else {}
    try:
        from flows.zoo_config import ZooEntry

        return float(ZooEntry.model_validate(entry).rel_l2())
    except Exception:  # an entry from another kiln version: fall back to its fields, then defaults
        explicit = (entry.get("tolerances") or {}).get("rel_l2")
        return float(explicit) if explicit else DEFAULT_REL_L2.get(tags.get("precision", "fp32"), 1e-4)


@task(name="accuracy-gate", cache_policy=NO_CACHE, persist_result=False)
def accuracy_gate(original: Any, candidate: Any, tolerance: float, samples: int = 3, seed: int = 0) -> dict:
    """Candidate vs the original model on fresh inputs inside the spec ranges (min, max, random)."""
    import compiler

    result = compiler.validate(original, candidate, samples=samples, warmup=1, runs=3, seed=seed)
    failures = result.failures(compiler.Tolerances(rel_l2=tolerance))
    report = result.to_dict()
    return {
        "max_rel_l2": report["max_rel_l2"],
        "min_cosine": report["min_cosine"],
        "tolerance_rel_l2": tolerance,
        "outputs": report["outputs"],
        "shapes": report["shapes"],
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
    from compiler.specs import check_inputs
    from compiler.validate import measure_latency, sample_inputs

    generator = torch.Generator().manual_seed(seed)
    flat = sample_inputs(candidate.input_specs, "opt", generator)
    try:
        check_inputs(champion.input_specs, flat)
    except Exception:
        # The candidate's opt shape is outside the champion's ranges: time at the champion's opt.
        flat = sample_inputs(champion.input_specs, "opt", generator)
        check_inputs(candidate.input_specs, flat)
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
def decide(report: GateReport) -> ReleaseOutcome:
    return apply_decision(report)
