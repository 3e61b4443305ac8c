"""Register the deployments of ``deploy/prefect.yaml`` on the Prefect server (``kiln deploy``).

``prefect deploy --prefect-file deploy/prefect.yaml`` reads the same file; in Prefect 3.8.8 it creates
the deployment and then fails while listing the pool's workers (the client sends ``limit: null``,
which the server rejects), so scripts cannot trust its exit code. This registrar reads the file and
creates (or updates) each deployment through the client API, with the same fields: entrypoint,
parameters, cron schedules, work pool and queue, job variables, pull steps, tags, concurrency limit.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import Any
from uuid import UUID

import yaml

from zoo.errors import ZooConfigError

_ENV_TEMPLATE = re.compile(r"\{\{\s*\$(\w+)\s*\}\}")


def _resolve_env(value: Any, where: str) -> Any:
    """Replace ``{{ $VAR }}`` with the environment's value, as ``prefect deploy`` does."""
    if isinstance(value, str):

        def sub(match: re.Match) -> str:
            name = match.group(1)
            if name not in os.environ:
                raise ZooConfigError(f"{where}: uses ${name}, which is not set; export it first")
            return os.environ[name]

        return _ENV_TEMPLATE.sub(sub, value)
    if isinstance(value, dict):
        return {k: _resolve_env(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_env(v, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def read_deployments(prefect_file: str | Path, names: list[str] | None = None) -> list[dict[str, Any]]:
    """The deployment entries of a prefect.yaml (env templates resolved, pull steps filled in)."""
    path = Path(prefect_file)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ZooConfigError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("deployments"), list):
        raise ZooConfigError(f"{path}: expected a mapping with a 'deployments' list")
    pull = data.get("pull") or []
    entries = []
    for i, dep in enumerate(data["deployments"]):
        if names and dep.get("name") not in names:
            continue
        for required in ("name", "entrypoint", "work_pool"):
            if not dep.get(required):
                raise ZooConfigError(f"{path}: deployments[{i}].{required} is missing; add it")
        dep = {**dep, "pull": dep.get("pull", pull)}
        entries.append(_resolve_env(dep, f"{path}: deployments[{i}]"))
    if names and (missing := sorted(set(names) - {e["name"] for e in entries})):
        raise ZooConfigError(f"{path}: no deployment named {missing}")
    return entries


def register(prefect_file: str | Path, names: list[str] | None = None) -> dict[str, UUID]:
    """Create or update each deployment (optionally only ``names``); returns 'flow/name' -> id."""
    from prefect import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate
    from prefect.client.schemas.schedules import CronSchedule
    from prefect.flows import load_flow_from_entrypoint
    from prefect.utilities.callables import parameter_schema

    registered = {}
    with get_client(sync_client=True) as client:
        for dep in read_deployments(prefect_file, names):
            _ensure_pool(client, dep["work_pool"]["name"])
            flow = load_flow_from_entrypoint(dep["entrypoint"])
            flow_id = client.create_flow_from_name(flow.name)
            schedules = [
                DeploymentScheduleCreate(
                    schedule=CronSchedule(cron=s["cron"], timezone=s.get("timezone", "UTC")),
                    active=s.get("active", True),
                )
                for s in dep.get("schedules") or []
            ]
            pool = dep["work_pool"]
            deployment_id = client.create_deployment(
                flow_id=flow_id,
                name=dep["name"],
                description=dep.get("description"),
                entrypoint=dep["entrypoint"],
                parameters=dep.get("parameters") or {},
                parameter_openapi_schema=parameter_schema(flow).model_dump_for_openapi(),
                schedules=schedules,
                work_pool_name=pool["name"],
                work_queue_name=pool.get("work_queue_name"),
                job_variables=pool.get("job_variables") or {},
                pull_steps=dep.get("pull") or [],
                tags=dep.get("tags") or [],
                concurrency_limit=dep.get("concurrency_limit"),
                enforce_parameter_schema=True,
            )
            registered[f"{flow.name}/{dep['name']}"] = deployment_id
    return registered


def _ensure_pool(client: Any, name: str) -> None:
    """Create a missing work pool as a process pool (what deploy/create-work-pools.sh makes)."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    try:
        client.read_work_pool(name)
    except ObjectNotFound:
        with contextlib.suppress(ObjectAlreadyExists):  # another registrar made it meanwhile
            client.create_work_pool(WorkPoolCreate(name=name, type="process"))
