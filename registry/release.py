"""Release bookkeeping in the registry: promote, reject, roll back, all-or-nothing.

The measuring (accuracy against the original model, latency against the champion) happens in the
Prefect flow ``flows/release.py``; this module applies its decision. Every change is a list of steps
with an undo each: if any step fails, the steps already done are undone in reverse, so a release
either moves ``champion``/``previous`` and writes its report, or leaves the registry as it found it.
A file lock per registered model serialises releases on one host, and the champion is re-read
before the first write: if another release moved it since the gates were measured, this one aborts.

A corrupt champion never strands the operator: :func:`champion_or_broken` refuses to release against
a champion that fails verification unless ``force_replace_broken`` is given, and then the release
records it (``replaced_broken_champion`` on the new champion, ``broken`` on the old one, and in the
release report); ``rollback(..., to_version=...)`` moves the champion to any version that was not
rejected, with or without a ``previous`` alias.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from mlflow import MlflowClient
from mlflow.exceptions import MlflowException

from registry import config
from registry.config import RetryPolicy, call_with_retry
from registry.errors import ArtifactMissingError, ArtifactVerificationError, ReleaseError
from registry.models import (
    CHAMPION,
    PREVIOUS,
    TAG_ALIAS_INTENT,
    TAG_BROKEN,
    TAG_REJECTED,
    TAG_RELEASE_REPORT,
    TAG_REPLACED_BROKEN,
    TAG_ROLLED_BACK,
    alias_intent,
    clear_alias_intent,
    get_aliases,
    registry_lock,
    set_alias,
)
from registry.targets import resolved_model_name

log = logging.getLogger("kiln.registry")


@dataclass
class GateReport:
    """What a release measured, and its verdict. Stored on the version as the ``release_report`` tag."""

    registered_model: str
    candidate: str
    champion: str | None
    accuracy: dict[str, Any]
    latency: dict[str, Any]
    reasons: list[str] = field(default_factory=list)
    measured_at: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    # Why the champion could not be loaded, when the release was forced past it (force_replace_broken).
    replaced_broken_champion: str | None = None
    # The measures that refused it, by name: "accuracy", "latency"; a generation version's
    # "generation.token_agreement", "generation.perplexity", "decode_tokens_per_s" (tasks/generation.py).
    failed_measures: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.reasons

    def to_dict(self) -> dict:
        data = asdict(self)
        data["passed"] = self.passed
        return data


@dataclass(frozen=True)
class ReleaseOutcome:
    registered_model: str
    version: str
    promoted: bool
    champion: str | None  # champion after the release
    previous: str | None  # previous after the release
    reasons: list[str]
    report: dict
    replaced_broken_champion: str | None = None  # the old champion's failure, when forced past it

    def to_dict(self) -> dict:
        return asdict(self)


Step = tuple[str, Callable[[], None], Callable[[], None]]


class GoLive(Protocol):
    """A server that must follow the champion (``serving.triton.live.TritonRelease``). Its steps join
    the release's all-or-nothing list: ``before`` run ahead of the alias moves (a server that refuses the
    new champion stops the release before any alias moves, and is undone if a later step fails),
    ``after`` once the aliases moved. ``hold()`` is held for the whole release, beside the registry lock."""

    def hold(self) -> AbstractContextManager[Any]: ...

    def steps(self, champion: str, previous: str | None) -> tuple[list[Step], list[Step]]: ...


def _live_hold(live: GoLive | None) -> AbstractContextManager[Any]:
    return live.hold() if live is not None else contextlib.nullcontext()


def _run_steps(steps: list[Step], policy: RetryPolicy | None) -> None:
    done: list[Step] = []
    try:
        for step in steps:
            call_with_retry(step[1], step[0], policy)
            done.append(step)
    except BaseException as exc:
        for what, _, undo in reversed(done):
            try:
                call_with_retry(undo, f"undo: {what}", policy)
            except Exception as undo_exc:  # report, and keep undoing the rest
                log.error("could not undo %r after a failed release: %s", what, undo_exc)
        if isinstance(exc, ReleaseError):
            raise
        raise ReleaseError(
            f"release aborted at step {len(done) + 1} ({steps[len(done)][0]}); the "
            f"{len(done)} earlier step(s) were undone: {type(exc).__name__}: {exc}"
        ) from exc


def _tag_steps(mlclient: MlflowClient, name: str, version: str, key: str, value: str | None) -> Step:
    """Set (or, with None, delete) a version tag; the undo restores what was there."""
    old = mlclient.get_model_version(name, version).tags.get(key)

    def put(v: str | None) -> None:
        if v is None:
            try:
                mlclient.delete_model_version_tag(name, version, key)
            except MlflowException as exc:
                if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
        else:
            mlclient.set_model_version_tag(name, version, key, v)

    return (f"tag {name}/{version} {key}", lambda: put(value), lambda: put(old))


def _alias_step(mlclient: MlflowClient, name: str, alias: str, version: str | None, old: str | None) -> Step:
    return (
        f"alias {name}@{alias} -> {version}",
        lambda: set_alias(mlclient, name, alias, version),
        lambda: set_alias(mlclient, name, alias, old),
    )


def _alias_moves(mlclient: MlflowClient, name: str, op: str, moves: list[Step], targets: dict) -> list[Step]:
    """``moves`` between recording their intent and clearing it: a kill in between leaves the intent,
    and the next reader of the aliases (``get_aliases``) finishes them. ``targets``: alias -> version."""
    record: Step = (
        f"record the alias moves of {name}",
        lambda: mlclient.set_registered_model_tag(name, TAG_ALIAS_INTENT, alias_intent(op, targets)),
        lambda: clear_alias_intent(mlclient, name),
    )
    clear: Step = (
        f"clear the alias moves of {name}",
        lambda: clear_alias_intent(mlclient, name),
        lambda: None,
    )
    return [record, *moves, clear]


def _compact_json(data: dict, limit: int = 4900) -> str:
    """The report as JSON within a registry tag's size: per-output detail goes first, never validity."""
    text = json.dumps(data, sort_keys=True, default=str)
    if len(text) <= limit:
        return text
    slim = json.loads(text)
    for gate in ("accuracy", "latency"):
        for key in ("outputs", "shapes"):
            slim.get(gate, {}).pop(key, None)
    text = json.dumps(slim, sort_keys=True)
    if len(text) <= limit:
        return text
    summary = {
        "passed": data.get("passed"),
        "failed_measures": data.get("failed_measures", []),
        "reasons": [r[:300] for r in data.get("reasons", [])][:5],
        "max_rel_l2": data.get("accuracy", {}).get("max_rel_l2"),
        "latency_ratio": data.get("latency", {}).get("ratio"),
    }
    return json.dumps(summary, sort_keys=True, default=str)[:limit]


def apply_decision(
    report: GateReport,
    *,
    tracking_uri: str | None = None,
    policy: RetryPolicy | None = None,
    live: GoLive | None = None,
) -> ReleaseOutcome:
    """Promote (gates passed) or reject (tag ``rejected`` with the reasons); all-or-nothing.

    ``live``: a server that must serve the new champion before the aliases move (see :class:`GoLive`);
    a rejection leaves it alone."""
    mlclient = config.client(tracking_uri)
    name, version = report.registered_model, report.candidate
    report_json = _compact_json(report.to_dict())
    with registry_lock(mlclient, name), _live_hold(live):
        aliases = get_aliases(mlclient, name, policy)
        champion = aliases.get(CHAMPION)
        if champion != report.champion:
            raise ReleaseError(
                f"{name}: champion moved from {report.champion} to {champion} while version {version} was "
                "being measured; nothing was changed, run the release again"
            )
        steps: list[Step] = [
            call_with_retry(
                lambda: _tag_steps(mlclient, name, version, TAG_RELEASE_REPORT, report_json),
                "read tags",
                policy,
            )
        ]
        broken = report.replaced_broken_champion
        if report.passed:
            steps.append(
                call_with_retry(
                    lambda: _tag_steps(mlclient, name, version, TAG_REJECTED, None), "read tags", policy
                )
            )
            if broken and champion and champion != version:
                # Recorded on both: the new champion replaced a broken one; the old one is broken. A
                # broken version is no rollback target, so `previous` stays where it was.
                note = f"v{champion}: {broken}"[:1000]
                steps.append(
                    call_with_retry(
                        lambda: _tag_steps(mlclient, name, version, TAG_REPLACED_BROKEN, note),
                        "read tags",
                        policy,
                    )
                )
                steps.append(
                    call_with_retry(
                        lambda: _tag_steps(mlclient, name, champion, TAG_BROKEN, broken[:1000]),
                        "read tags",
                        policy,
                    )
                )
            moves, targets = [], {}
            if not broken and champion and champion != version:
                moves.append(_alias_step(mlclient, name, PREVIOUS, champion, aliases.get(PREVIOUS)))
                targets[PREVIOUS] = champion
            moves.append(_alias_step(mlclient, name, CHAMPION, version, champion))
            targets[CHAMPION] = version
            before, after = (
                live.steps(version, targets.get(PREVIOUS, aliases.get(PREVIOUS))) if live else ([], [])
            )
            steps += before + _alias_moves(mlclient, name, "release", moves, targets) + after
        else:
            reasons = json.dumps([r[:1000] for r in report.reasons][:4])
            steps.append(
                call_with_retry(
                    lambda: _tag_steps(mlclient, name, version, TAG_REJECTED, reasons), "read tags", policy
                )
            )
        _run_steps(steps, policy)
        after = get_aliases(mlclient, name, policy)
    return ReleaseOutcome(
        name,
        version,
        report.passed,
        after.get(CHAMPION),
        after.get(PREVIOUS),
        report.reasons,
        report.to_dict(),
        report.replaced_broken_champion,
    )


def champion_or_broken(
    load: Callable[[], Any], name: str, version: str, *, force_replace_broken: bool = False
) -> tuple[Any | None, str | None]:
    """``(module, None)`` when the champion loads; ``(None, reason)`` when it fails verification and
    ``force_replace_broken`` is set (put the reason in ``GateReport.replaced_broken_champion``);
    otherwise ReleaseError saying how to proceed. ``load``: fetches, verifies and loads the champion."""
    try:
        return load(), None
    except (ArtifactVerificationError, ArtifactMissingError) as exc:
        if not force_replace_broken:
            raise ReleaseError(
                f"{name}: the champion, version {version}, fails verification, so nothing can be measured "
                f"against it: {exc}. Nothing was changed. To release a candidate in its place, run again "
                "with --force-replace-broken (recorded on both versions and in the release report), or "
                "move the champion with `kiln rollback --to VERSION`"
            ) from exc
        log.warning("%s: releasing past broken champion %s: %s", name, version, exc)
        return None, f"{type(exc).__name__}: {exc}"


def rollback(
    model: str,
    engine_target: str = "cpu",
    *,
    to_version: str | None = None,
    tracking_uri: str | None = None,
    policy: RetryPolicy | None = None,
    live: GoLive | None = None,
) -> ReleaseOutcome:
    """Move ``champion`` back: to ``previous`` (default) or to ``to_version``; the demoted champion is
    tagged ``rolled_back``. ``live``: a server that must serve it first (see :class:`GoLive`).

    Without ``to_version``, ``previous`` is removed (there is no older champion on record to point it
    at), so a second rollback without a release in between is refused rather than bouncing back to the
    bad version. With ``to_version`` (any version not rejected by a release), ``previous`` is removed
    only if it named that version; this works with a broken champion and without a ``previous``.
    """
    mlclient = config.client(tracking_uri)
    name = resolved_model_name(mlclient, model, engine_target, policy)
    with registry_lock(mlclient, name), _live_hold(live):
        aliases = get_aliases(mlclient, name, policy)
        champion, previous = aliases.get(CHAMPION), aliases.get(PREVIOUS)
        target_version = previous if to_version is None else str(to_version)
        if target_version is None:
            raise ReleaseError(
                f"{name} has no 'previous' alias (champion: {champion or 'none'}); nothing to roll back to; "
                "name a version with --to VERSION"
            )
        if to_version is not None:
            _check_rollback_target(mlclient, name, target_version, champion, policy)
        elif previous == champion:
            # Only an older kiln, killed between its alias moves, left this; removing 'previous' would
            # leave the version it once named behind no alias, so nothing is changed.
            raise ReleaseError(
                f"{name}: 'previous' and 'champion' both name version {champion}; nothing to roll back to "
                "and nothing was changed; name a version with --to VERSION"
            )
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        steps: list[Step] = []
        if champion:
            steps.append(
                call_with_retry(
                    lambda: _tag_steps(
                        mlclient, name, champion, TAG_ROLLED_BACK, f"{stamp} to v{target_version}"
                    ),
                    "read tags",
                    policy,
                )
            )
        # A version rolled back from earlier serves again: it is no longer "rolled back".
        steps.append(
            call_with_retry(
                lambda: _tag_steps(mlclient, name, target_version, TAG_ROLLED_BACK, None), "read tags", policy
            )
        )
        moves = [_alias_step(mlclient, name, CHAMPION, target_version, champion)]
        targets: dict[str, str | None] = {CHAMPION: target_version}
        if previous is not None and (to_version is None or previous == target_version):
            moves.append(_alias_step(mlclient, name, PREVIOUS, None, previous))
            targets[PREVIOUS] = None
        before, after = live.steps(target_version, targets.get(PREVIOUS, previous)) if live else ([], [])
        steps += before + _alias_moves(mlclient, name, "rollback", moves, targets) + after
        _run_steps(steps, policy)
        after = get_aliases(mlclient, name, policy)
    return ReleaseOutcome(
        name,
        target_version,
        True,
        after.get(CHAMPION),
        after.get(PREVIOUS),
        [],
        {"rolled_back_from": champion, "to": target_version, "explicit": to_version is not None},
    )


def _check_rollback_target(
    mlclient: MlflowClient, name: str, version: str, champion: str | None, policy: RetryPolicy | None
) -> None:
    def read() -> dict[str, str] | None:
        try:
            return dict(mlclient.get_model_version(name, version).tags)
        except MlflowException as exc:
            if exc.error_code == "RESOURCE_DOES_NOT_EXIST":
                return None
            raise

    tags = call_with_retry(read, f"read {name}/{version}", policy)
    if tags is None:
        raise ReleaseError(f"{name} has no version {version}; nothing was changed")
    if version == champion:
        raise ReleaseError(f"{name} version {version} is already the champion; nothing was changed")
    if TAG_REJECTED in tags:
        raise ReleaseError(
            f"{name} version {version} was rejected by a release ({tags[TAG_REJECTED][:300]}); "
            "rolling back to it is refused; release it again to re-measure it"
        )
