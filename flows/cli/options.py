"""Options and helpers every ``kiln`` command module shares."""

from __future__ import annotations

import logging
import os
import warnings
from typing import Annotated, Any

import typer
from rich.markup import escape

from flows.render import EXIT_BAD_INPUT, console

Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="show Prefect's task logs")]
JsonOut = Annotated[bool, typer.Option("--json", help="print the summary as JSON on stdout (for scripts)")]


def quiet_prefect(verbose: bool) -> None:
    # Must run before Prefect is imported: its logging settings are read at import.
    if not verbose:
        os.environ.setdefault("PREFECT_LOGGING_LEVEL", "CRITICAL")
        warnings.filterwarnings("ignore")
        os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")
        logging.getLogger("mlflow").setLevel(logging.ERROR)  # tracking chatter; failures still show
        os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "ERROR")  # mlflow resets its logger on import
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    # The temporary API server migrates a fresh database first: 20 s is not enough on a busy 2-core box.
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_LOGGING_LEVEL", "WARNING")


def bad_input(message: str) -> typer.Exit:
    console.print(f"[red]error:[/red] {escape(message)}", soft_wrap=True, highlight=False)
    return typer.Exit(EXIT_BAD_INPUT)


# Flag values that carry structure (kiln compile): parsed here, checked by the zoo schema.
def parse_profiles(texts: list[str] | None) -> list[dict[str, Any]] | None:
    """``--profile batch=8,seq=128`` (repeatable) -> [{"batch": 8, "seq": 128}]; a range ``batch=9:32``
    (min:max) or ``batch=9:16:32`` (min:opt:max) -> [9, 32]; the schema checks sizes."""
    if not texts:
        return None
    profiles = []
    for text in texts:
        profile: dict[str, Any] = {}
        for pair in text.split(","):
            name, sep, size = pair.partition("=")
            if not sep or not name.strip():
                raise bad_input(f"--profile {text!r}: use DIM=SIZE[,DIM=SIZE], e.g. batch=8 or batch=9:32")
            parts = [p.strip() for p in size.split(":")]
            sizes = [int(p) if p.isdigit() else p for p in parts]
            profile[name.strip()] = sizes[0] if len(sizes) == 1 else sizes
        profiles.append(profile)
    return profiles


def parse_backend_options(pairs: list[str] | None) -> dict[str, Any] | None:
    if not pairs:
        return None
    import yaml

    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise bad_input(f"--backend-option {pair!r}: use KEY=VALUE (VALUE as YAML: 3, true, [a, b])")
        options[key] = yaml.safe_load(text)
    return options


# --target names the engine target (what engines are built for: cpu, cuda:sm_90) on every command that
# takes it; where a model runs is --device. kiln zoo and kiln compile once took --target/-t for the
# device: both still work there, with a deprecation message on stderr.
TARGET_AS_DEVICE = (
    "--target/-t on kiln {command} names the device, which is --device now (--target names the engine "
    "target on lookup, release, rollback and report); it still works here, for now"
)
DeprecatedDevices = Annotated[list[str] | None, typer.Option("--target", "-t", hidden=True)]
DeprecatedDevice = Annotated[str | None, typer.Option("--target", "-t", hidden=True)]


def devices_with_deprecated_target(command: str, devices: Any, target: Any) -> Any:
    """``--device`` plus what the deprecated ``--target``/``-t`` spelling gave (a list, or one device)."""
    if not target:
        return devices
    typer.echo(f"warning: {TARGET_AS_DEVICE.format(command=command)}", err=True)
    if isinstance(target, list):
        return [*(devices or []), *target]
    return devices or target
