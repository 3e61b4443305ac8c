"""``kiln lookup``, ``kiln release``, ``kiln rollback`` and ``kiln versions``: the registry from the shell.

Mounted on the main CLI by ``register_commands(app)``. Exit codes: 0 success (found / promoted /
rolled back), 1 a decision against (no fitting version / candidate rejected), 2 an error (artifact
refused, server unreachable, bad arguments).
"""

from __future__ import annotations

import json

import typer

from flows.cli.options import (
    AllowOpModule,
    AsJson,
    Dst,
    EngineTarget,
    ForceReplaceBroken,
    LookupBackend,
    LookupModel,
    LookupPrecision,
    MaxLatencyRatio,
    ReleaseAsJson,
    ReleaseEngineTarget,
    ReleaseModel,
    ReleaseVersion,
    ReleaseZooFile,
    RelL2,
    Runs,
    Shape,
    Source,
    To,
    TrackingUri,
    TritonRepository,
    TritonTimeout,
    TritonUrl,
    Version,
)
from registry.terminal import SafeConsole

console = SafeConsole()  # shows tags and package fields with control characters escaped


def _live(
    model: str,
    engine_target: str,
    triton: str | None,
    repository: str | None,
    timeout: float,
    tracking_uri: str | None,
) -> dict | None:
    """TritonRelease's arguments, checked now: both flags or neither."""
    if (triton is None) != (repository is None):
        raise typer.BadParameter("--triton and --repository go together: the server and its model repository")
    if triton is None:
        return None
    return {
        "url": triton,
        "repository": repository,
        "model": model,
        "engine_target": engine_target,
        "timeout": timeout,
        "tracking_uri": tracking_uri,
    }


def parse_shapes(values: list[str]) -> tuple[int, ...] | list[tuple[int, ...]] | dict[str, tuple[int, ...]]:
    """``["4,64"]``: one shape; ``["4,16", "4,16"]``: per input in order; ``["ids=4,16", ...]``: by name."""

    def dims(text: str) -> tuple[int, ...]:
        try:
            shape = tuple(int(d) for d in text.replace("x", ",").split(",") if d.strip())
        except ValueError:
            raise typer.BadParameter(
                f"shape {text!r} must be integers separated by commas, e.g. 4,64"
            ) from None
        if not shape:
            raise typer.BadParameter(f"shape {text!r} is empty; give e.g. 4,64")
        return shape

    if not values:
        raise typer.BadParameter(
            "give at least one --shape, e.g. --shape 4,64 or --shape input_ids=2,16 (or a --source)"
        )
    named = [v for v in values if "=" in v]
    if named and len(named) != len(values):
        raise typer.BadParameter("either name every --shape (name=4,16) or none")
    if named:
        return {k.strip(): dims(v) for k, v in (item.split("=", 1) for item in values)}
    shapes = [dims(v) for v in values]
    return shapes[0] if len(shapes) == 1 else shapes


def _fail(message: str, code: int = 2) -> typer.Exit:
    console.print(f"[red]error:[/red] {message}", soft_wrap=True)
    return typer.Exit(code)


def lookup_cmd(
    model: LookupModel,
    shape: Shape = None,
    backend: LookupBackend = None,
    engine_target: EngineTarget = None,
    precision: LookupPrecision = None,
    version: Version = None,
    source: Source = None,
    dst: Dst = None,
    allow_op_module: AllowOpModule = None,
    as_json: AsJson = False,
    tracking_uri: TrackingUri = None,
) -> None:
    """Find the champion (else newest) version, whose input ranges cover SHAPE when one is given (and,
    with --source, that was compiled from that source); download, verify, load it.

    A version that fails verification is skipped for the next that fits, and the output says so."""
    from registry.errors import KilnError, NoMatchingVersionError
    from registry.lookup import describe_result, lookup

    # A shape (alone or with a source) has to fit the ranges; without one, the champion (else newest).
    shapes = parse_shapes(shape) if shape else None
    # A package of hundreds of MB: a terminal shows a progress bar as the files come (registry.transfer).
    try:
        result = lookup(
            model,
            shapes,
            backend=backend,
            engine_target=engine_target,
            precision=precision,
            version=version,
            source=source,
            dst=dst,
            allowed_modules=allow_op_module or None,
            tracking_uri=tracking_uri,
            # It verifies and loads; nothing here calls the module: its output types (transformers'
            # ModelOutput, seconds to import) are checked, not imported.
            defer_output_types=True,
        )
    except NoMatchingVersionError as exc:
        if as_json:
            print(json.dumps({"error": str(exc), "candidates": exc.candidates}, indent=2))
        raise _fail(str(exc), 1) from None
    except KilnError as exc:
        raise _fail(f"{type(exc).__name__}: {exc}") from None
    summary = describe_result(result)
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    aliases = f" ({', '.join(result.aliases)})" if result.aliases else ""
    console.print(f"[green]{result.name}[/green] version {result.version}{aliases}: verified and loaded")
    if result.fell_back:
        broken = ", ".join(result.fell_back_from)
        console.print(
            f"[yellow]warning:[/yellow] served instead of broken version(s) {broken}", soft_wrap=True
        )
    if result.source_match:
        console.print(f"  source: {_source_text(result.source_match)}", soft_wrap=True)
    for key in ("backend", "precision", "engine_target", "input_ranges", "package_dir", "engine_code"):
        console.print(f"  {key}: {summary[key]}", soft_wrap=True)
    for row in result.skipped:
        console.print(f"  skipped v{row['version']}: {row['reason']}", soft_wrap=True)


def _source_text(match: dict) -> str:
    """``models:/x@production -> version 3 now; matched: alias (compiled from models:/x/3)``."""
    requested = match["requested"]
    if match.get("alias_version"):
        requested += f" -> version {match['alias_version']} now"
    recorded = match["recorded_uri"]
    if match.get("recorded_version"):
        recorded += f" version {match['recorded_version']}"
    text = f"{requested}; matched: {match['how']} (compiled from {recorded})"
    return text + (f"; {match['note']}" if match.get("note") else "")


def release_cmd(
    model: ReleaseModel,
    version: ReleaseVersion = None,
    engine_target: ReleaseEngineTarget = None,
    max_latency_ratio: MaxLatencyRatio = 1.10,
    rel_l2: RelL2 = None,
    runs: Runs = 30,
    zoo_file: ReleaseZooFile = None,
    force_replace_broken: ForceReplaceBroken = False,
    as_json: ReleaseAsJson = False,
    tracking_uri: TrackingUri = None,
    triton: TritonUrl = None,
    repository: TritonRepository = None,
    triton_timeout: TritonTimeout = 10.0,
) -> None:
    """Re-validate a candidate against the original model and the champion; promote it or reject it.

    The original model comes from the zoo entry of --zoo, else of the zoo file the last kiln zoo run in
    this directory read; the engine target from --target, else the entry's device (devices: [cuda]: the
    version built for this machine's GPU, or the only CUDA one registered).

    With --triton and --repository the server serves the new champion before the aliases move; if it
    refuses, nothing moves."""
    from flows.release import release, release_target
    from flows.server import prefect_api
    from registry.errors import KilnError
    from zoo.last_run import zoo_file_for

    try:  # checked before Prefect starts: a bad zoo file or target is one line, not a flow's traceback
        zoo_file = zoo_file_for(model, zoo_file)
        engine_target = release_target(zoo_file, model, engine_target, tracking_uri)
    except KilnError as exc:
        raise _fail(f"{type(exc).__name__}: {exc}") from None
    live = _live(model, engine_target, triton, repository, triton_timeout, tracking_uri)
    try:
        with prefect_api():  # a temporary API server that dies with this process, even by SIGKILL
            outcome = release(
                model,
                version=version,
                engine_target=engine_target,
                max_latency_ratio=max_latency_ratio,
                rel_l2=rel_l2,
                runs=runs,
                zoo_path=zoo_file,
                tracking_uri=tracking_uri,
                force_replace_broken=force_replace_broken,
                live=live and {k: v for k, v in live.items() if k != "tracking_uri"},
            )
    except KilnError as exc:
        raise _fail(f"{type(exc).__name__}: {exc}") from None
    if as_json:
        print(json.dumps(outcome, indent=2, default=str))
    elif outcome["promoted"]:
        console.print(
            f"[green]{outcome['registered_model']} version {outcome['version']} is the champion[/green]"
            f" (previous: {outcome['previous'] or 'none'})"
        )
    else:
        console.print(
            f"[yellow]{outcome['registered_model']} version {outcome['version']} not promoted:[/yellow]"
        )
        for reason in outcome["reasons"]:
            console.print(f"  - {reason}", soft_wrap=True)
    if not outcome["promoted"]:
        raise typer.Exit(1)


def rollback_cmd(
    model: ReleaseModel,
    engine_target: EngineTarget = None,
    to: To = None,
    tracking_uri: TrackingUri = None,
    triton: TritonUrl = None,
    repository: TritonRepository = None,
    triton_timeout: TritonTimeout = 10.0,
) -> None:
    """Move the champion alias back to the previous champion, or to the version given with --to.

    With --triton and --repository the server serves it before the aliases move; if it refuses, nothing
    moves."""
    from registry import config
    from registry.errors import KilnError
    from registry.release import rollback
    from registry.targets import resolve_engine_target
    from serving.triton.live import triton_release

    try:  # the server's repository is checked against the resolved registered name
        engine_target = resolve_engine_target(config.client(tracking_uri), model, engine_target)
    except KilnError as exc:
        raise _fail(f"{type(exc).__name__}: {exc}") from None
    live = _live(model, engine_target, triton, repository, triton_timeout, tracking_uri)
    try:
        server = triton_release(live)
        if server is not None:
            server.check()  # the server answers before anything moves
        outcome = rollback(model, engine_target, to_version=to, tracking_uri=tracking_uri, live=server)
    except KilnError as exc:
        raise _fail(f"{type(exc).__name__}: {exc}") from None
    console.print(
        f"[green]{outcome.registered_model}: champion is version {outcome.champion} again[/green] "
        f"(version {outcome.report['rolled_back_from']} tagged rolled_back)"
    )


def versions_cmd(tracking_uri: TrackingUri = None) -> None:
    """List every registered kiln version with its aliases, backend, precision and input ranges."""
    from registry.errors import KilnError
    from registry.summary import print_registry_summary

    try:
        print_registry_summary(tracking_uri=tracking_uri, console=console)
    except KilnError as exc:
        raise _fail(f"{type(exc).__name__}: {exc}") from None


def register_commands(app: typer.Typer) -> None:
    """Add ``lookup``, ``release``, ``rollback`` and ``versions`` to the ``kiln`` CLI."""
    app.command("lookup")(lookup_cmd)
    app.command("release")(release_cmd)
    app.command("rollback")(rollback_cmd)
    app.command("versions")(versions_cmd)


def build_app() -> typer.Typer:
    """A CLI with only the registry commands (``python -m flows.cli.registry``), for tests and debugging."""
    app = typer.Typer(no_args_is_help=True, add_completion=False, help="kiln registry commands")
    register_commands(app)
    return app


if __name__ == "__main__":
    build_app()()
