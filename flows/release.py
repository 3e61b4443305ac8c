"""The ``release`` flow: re-validate a candidate version, then promote it or reject it.

    resolve candidate + champion -> fetch, verify, load both -> rebuild the original from the zoo file
    -> accuracy gate (candidate vs original) -> latency gate (candidate vs champion, side by side)
    -> promote (champion -> candidate, previous -> old champion) or tag it rejected with the reasons

Both modules are measured in this one process on this one machine, interleaved, so the latency
ratio compares like with like. The registry changes all-or-nothing (``registry.release``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from prefect import flow, get_run_logger

from registry import config
from registry.errors import (
    ArtifactMissingError,
    ArtifactVerificationError,
    ReleaseError,
    UnknownEngineTargetError,
)
from registry.release import GateReport, champion_or_broken
from registry.targets import registered_targets, resolve_target, resolved_model_name
from tasks.generation import generation_gates
from tasks.registry import (
    accuracy_gate,
    decide,
    fetch_and_load,
    latency_gate,
    rebuild_original,
    resolve_candidate,
)
from zoo.config import ZooEntry
from zoo.errors import ZooConfigError
from zoo.request import CompileRequest
from zoo.zoo_file import Zoo, load_zoo

DEFAULT_MAX_LATENCY_RATIO = 1.10


def _entry(zoo_path: str, model: str) -> tuple[Zoo, ZooEntry]:
    zoo = load_zoo(zoo_path)
    entries = [e for e in zoo.entries if e.name == model]
    if not entries:
        invalid = [i.error for i in zoo.invalid if i.name == model]
        raise ZooConfigError(
            invalid[0]
            if invalid
            else f"{zoo_path} has no model {model!r} (it has {zoo.names}); name the zoo file that compiled "
            "it with --zoo"
        )
    return zoo, entries[0]


def release_target(
    zoo_path: str, model: str, engine_target: str | None, tracking_uri: str | None = None
) -> str:
    """The registered engine target a release of ``model`` is for: ``engine_target`` (``--target``), else
    the device the zoo entry lists (``devices: [cuda]``: ``cuda``), resolved by ``registry.targets`` (``cuda``
    -> ``cuda_sm_90``). An entry listing several device families takes the one with registered versions;
    a ReleaseError naming ``--target`` when that is not exactly one."""
    registered = registered_targets(config.client(tracking_uri), model)
    if engine_target is not None:
        return resolve_target(model, engine_target, registered)
    _, entry = _entry(zoo_path, model)
    families = list(dict.fromkeys(device.split(":")[0] for device in entry.devices))
    if len(families) == 1:
        return resolve_target(model, families[0], registered)
    chosen = {}
    for family in families:
        try:
            chosen[family] = resolve_target(model, family, registered)
        except UnknownEngineTargetError:
            continue  # this device has nothing registered: not the one to release
    if len(chosen) != 1:
        raise ReleaseError(
            f"models[{model}] in {zoo_path} lists devices {families}, and "
            + ("none has" if not chosen else f"{sorted(chosen.values())} all have")
            + f" registered versions (registered targets: {', '.join(registered) or 'none'}); name the "
            "engine target to release with --target"
        )
    return next(iter(chosen.values()))


def release_request(zoo_path: str, model: str, engine_target: str) -> CompileRequest:
    """The zoo file's request for ``model`` on the device family of ``engine_target`` (trusted input)."""
    zoo, entry = _entry(zoo_path, model)
    family = engine_target.split(":")[0].split("_")[0]
    requests = [r for r in zoo.requests(entry) if r.device.split(":")[0] == family]
    if not requests:
        raise ReleaseError(
            f"{model} in {zoo_path} lists no {family} device; the registered engine target is "
            f"{engine_target!r}"
        )
    return requests[0]


@flow(name="release", log_prints=True)
def release(
    model: str,
    version: str | None = None,
    engine_target: str = "cpu",
    zoo_path: str = "deploy/zoo.yaml",
    max_latency_ratio: float = DEFAULT_MAX_LATENCY_RATIO,
    rel_l2: float | None = None,
    samples: int = 3,
    runs: int = 30,
    tracking_uri: str | None = None,
    force_replace_broken: bool = False,
    live: dict | None = None,
) -> dict:
    """Release ``version`` (default: the newest open candidate) of ``kiln.<model>.<engine_target>``.

    ``max_latency_ratio``: the candidate's median latency may be at most this times the champion's.
    ``rel_l2``: accuracy tolerance vs the original model (default: the zoo entry's, by precision).
    ``zoo_path``: the zoo file whose entry builds the original model (never a registry tag).
    ``force_replace_broken``: release even when the champion fails verification (recorded on both).
    ``live``: a Triton server and repository that must serve the new champion before the aliases move
    (``TritonRelease``'s arguments: url, repository, model, engine_target, timeout); checked before anything
    is measured, so a server that does not answer costs no measurement and moves nothing.
    Returns the outcome (``promoted``, ``champion``, ``previous``, ``reasons``, the measured report).
    """
    logger = get_run_logger()
    config.configure(tracking_uri)
    name = resolved_model_name(config.client(tracking_uri), model, engine_target)
    if live:
        from serving.triton.live import triton_release

        live = {**live, "tracking_uri": tracking_uri}
        triton_release(live).check()
    resolved = resolve_candidate(name, version)
    candidate_version, champion_version = resolved["candidate"], resolved["champion"]
    if candidate_version == champion_version:
        logger.info("%s version %s is already the champion; nothing to do", name, candidate_version)
        return {
            "registered_model": name,
            "version": candidate_version,
            "promoted": False,
            "champion": champion_version,
            "previous": None,
            "reasons": ["already the champion"],
            "report": {},
        }
    request = release_request(zoo_path, model, engine_target)
    tolerances = (
        request.tolerances if rel_l2 is None else dataclasses.replace(request.tolerances, rel_l2=rel_l2)
    )
    # The original first: building it imports the request's own (trusted) module, the only custom-op
    # module the packages below may then use.
    original = rebuild_original(request)
    trusted = request.trusted_modules
    try:
        candidate = fetch_and_load(name, candidate_version, trusted)
    except (ArtifactVerificationError, ArtifactMissingError) as exc:
        # A candidate that cannot be trusted is rejected, with the reason; the champion stays.
        report = GateReport(name, candidate_version, champion_version, {}, {}, [f"artifact refused: {exc}"])
        return decide(report).to_dict()
    champion, broken = (
        champion_or_broken(
            lambda: fetch_and_load(name, champion_version, trusted),
            name,
            champion_version,
            force_replace_broken=force_replace_broken,
        )
        if champion_version
        else (None, None)
    )
    if request.generation is not None:  # generated tokens, perplexity and decode speed: tasks/generation.py
        gates = generation_gates(
            request, original.lm, candidate, champion, champion_version, max_latency_ratio, runs=runs
        )
    else:
        gates = _forward_gates(
            request,
            original,
            candidate,
            champion,
            champion_version,
            tolerances,
            samples,
            runs,
            max_latency_ratio,
        )
    reasons = gates["reasons"]
    report = GateReport(
        name,
        candidate_version,
        champion_version,
        gates["accuracy"],
        gates["latency"],
        reasons,
        replaced_broken_champion=broken,
        failed_measures=gates["failed_measures"],
    )
    outcome = decide(report, live)
    verdict = "promoted to champion" if outcome.promoted else f"rejected: {'; '.join(reasons)}"
    logger.info("%s version %s %s", name, candidate_version, verdict)
    return outcome.to_dict()


def _forward_gates(
    request: CompileRequest,
    original: Any,
    candidate: Any,
    champion: Any | None,
    champion_version: str | None,
    tolerances: Any,
    samples: int,
    runs: int,
    max_latency_ratio: float,
) -> dict[str, Any]:
    """Accuracy (candidate vs the original) and latency (candidate vs the champion) of a forward pass:
    ``accuracy``, ``latency``, ``reasons`` and ``failed_measures`` (``accuracy``, ``latency``)."""
    # Candidate and champion are measured against the original on the same data (the entry's
    # recorded inputs, when it has them); only the candidate's numbers gate the release.
    # Read for each version's own specs: the entry's validation.ignore_fields applies to both.
    plan = request.validation
    data = plan.dataset(candidate.input_specs)
    accuracy = accuracy_gate(original, candidate, tolerances, samples=samples, data=data)
    if champion is not None:
        data = plan.dataset(champion.input_specs)
        accuracy["champion"] = accuracy_gate(original, champion, tolerances, samples=samples, data=data)
    latency = latency_gate(candidate, champion, max_latency_ratio, runs=runs)
    reasons = []
    reasons += [f"{reason} vs the original model" for reason in accuracy["failures"]]
    if not latency["passed"]:
        reasons.append(
            f"latency: median {latency['candidate_median_ms']:.3f} ms is {latency['ratio']:.2f}x the "
            f"champion's (v{champion_version}, {latency['champion_median_ms']:.3f} ms); "
            f"the limit is {max_latency_ratio:.2f}x"
        )
    failed = ["accuracy"] * bool(accuracy["failures"]) + ["latency"] * (not latency["passed"])
    return {"accuracy": accuracy, "latency": latency, "reasons": reasons, "failed_measures": failed}
