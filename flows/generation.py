"""The stages of a text-generation entry inside ``compile_model``: each program (prefill, decode) goes
through export, partition, engine builds, assemble and its own forward-pass validation (with repair,
as any model), then the two are checked together against eager ``generate`` and packaged as one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from prefect import unmapped

from flows import progress
from flows.results import package_path
from tasks.generation import check_generation, package_generation
from tasks.refs import EngineRef, PackageRef, PlanRef, ValidatedRef
from zoo.generation import PROGRAMS
from zoo.request import CompileRequest


@dataclass(frozen=True)
class Compiled:
    """What compile_model reports of a compile: the (prefill) plan, every engine, the validated prefill
    program (the package's forward-pass validation) and the package."""

    plan: PlanRef
    engines: list[EngineRef]
    validated: ValidatedRef
    package: PackageRef
    generation: dict[str, Any] | None = None


def compile_generation(
    request: CompileRequest, stages: Any, workspace: str, engine_cache: str | None, out_dir: str
) -> Compiled:
    name, device = request.name, request.device
    plans, engines, validated = {}, [], {}
    for program in PROGRAMS:
        sub = request.for_program(program)
        progress.emit("model", name, device, f"{program}: export")
        key = stages.resolve_source(sub)
        exported = stages.export_program(sub, key, workspace)
        plan = stages.partition_program(exported, sub.options, workspace)
        progress.emit("model", name, device, f"{program}: build {len(plan.fingerprints)} engines")
        builds = stages.build_engine.map(
            unmapped(plan), plan.fingerprints, unmapped(workspace), unmapped(engine_cache)
        )
        built = [b.result() for b in builds]
        engines += built
        staged = stages.assemble_engines(plan, built, workspace)
        progress.emit("model", name, device, f"{program}: validate")
        validated[program] = stages.validate_package(sub, staged, workspace, engine_cache)
        plans[program] = plan
    progress.emit("model", name, device, "validate generation")
    report = check_generation(request, validated["prefill"], validated["decode"], workspace)
    progress.emit("model", name, device, "package")
    package = package_generation(
        validated["prefill"],
        validated["decode"],
        report,
        package_path(out_dir, request),
        workspace,
        request.identity(),
    )
    return Compiled(plans["prefill"], engines, validated["prefill"], package, report)
