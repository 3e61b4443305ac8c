"""``kiln serve triton export|run``: a Triton model repository from the registry, and a server on it.

Exit codes as everywhere: 0 ok, 1 a model failed to export (each model's outcome is printed; the
others were exported, and the failed one's folder is as it was), 2 unusable input (bad options, a
repository that cannot be used, no server binary, a server that would not start).
"""

from __future__ import annotations

import json
import signal
import sys

import typer
from rich.markup import escape

from flows.cli.options import (
    Address,
    EngineTarget,
    ExportAllowOpModule,
    ExportTrackingUri,
    GrpcPort,
    HttpPort,
    Instances,
    JsonOut,
    MetricsPort,
    Models,
    QueueDelayUs,
    Repository,
    ServeAllowOpModule,
    StreamTokens,
    Threads,
    bad_input,
)
from flows.render import console

serve_app = typer.Typer(help="Serve registered versions (Triton Inference Server).", no_args_is_help=True)
triton_app = typer.Typer(
    help="Triton model repositories from the registry, and a server on one.", no_args_is_help=True
)
serve_app.add_typer(triton_app, name="triton")


@triton_app.command("export")
def export_cmd(
    models: Models,
    repository: Repository,
    engine_target: EngineTarget = None,
    queue_delay_us: QueueDelayUs = 1000,
    instances: Instances = 0,
    threads: Threads = 0,
    stream_tokens: StreamTokens = False,
    allow_op_module: ExportAllowOpModule = None,
    tracking_uri: ExportTrackingUri = None,
    as_json: JsonOut = False,
) -> None:
    """Write each model's champion (and previous, for rollbacks) into REPOSITORY as Triton versions,
    with config.pbtxt from what the package records (input and output specs) and kiln's Python
    backend. Each model is all or nothing: one that fails leaves its folder as it was."""
    from compiler.errors import KilnError
    from serving.triton.repository import ExportFailure, export

    try:
        results = export(
            models,
            repository,
            engine_target=engine_target,
            tracking_uri=tracking_uri,
            queue_delay_us=queue_delay_us,
            instances=instances,
            threads=threads,
            stream=stream_tokens,
            allowed_modules=allow_op_module or None,
        )
    except KilnError as exc:
        raise bad_input(f"{type(exc).__name__}: {exc}") from None
    failed = [r for r in results if isinstance(r, ExportFailure)]
    if as_json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
        if failed:
            raise typer.Exit(1)
        return
    for r in results:
        if isinstance(r, ExportFailure):
            console.print(
                f"[red]{escape(r.model)}: not exported[/red] ({escape(r.error)}: {escape(r.message)}); its "
                "folder in the repository is as it was",
                soft_wrap=True,
            )
            continue
        previous = f", previous {r.previous}" if r.previous else ""
        console.print(
            f"[green]{escape(r.model)}[/green]: champion {r.champion}{previous} of "
            f"{escape(r.registered_model)} in {escape(str(r.model_dir))}"
            + (f" (downloaded {', '.join(r.staged)})" if r.staged else ""),
            soft_wrap=True,
        )
    if failed:
        console.print(f"{len(failed)} of {len(results)} models failed to export", soft_wrap=True)
        raise typer.Exit(1)
    console.print(f"serve it: kiln serve triton run --repository {escape(str(repository))}", soft_wrap=True)


@triton_app.command("run")
def run_cmd(
    repository: Repository,
    http_port: HttpPort = 8000,
    grpc_port: GrpcPort = 8001,
    address: Address = "127.0.0.1",
    metrics_port: MetricsPort = None,
    allow_op_module: ServeAllowOpModule = None,
) -> None:
    """Run tritonserver in the foreground on REPOSITORY: explicit model control, every model loaded,
    bound to 127.0.0.1 unless --address says otherwise. Ctrl-C stops it."""
    from compiler.errors import KilnError
    from compiler.program.module_policy import ALLOWED_MODULES_ENV, configured_prefixes
    from serving.triton.server import TritonServer

    # The server's packages may import these for their custom ops (the operator's word, never a file's).
    env = (
        {ALLOWED_MODULES_ENV: ",".join([*configured_prefixes(), *allow_op_module])}
        if allow_op_module
        else None
    )
    try:
        server = TritonServer(
            repository,
            http_port=http_port,
            grpc_port=grpc_port,
            address=address,
            metrics_port=metrics_port,
            inherit_output=True,
            env=env,
        )
    except KilnError as exc:
        raise bad_input(f"{type(exc).__name__}: {exc}") from None
    # The server's own log goes to the terminal; SIGTERM/SIGINT stop it and its stubs.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        console.print(_trust_line(server.trust), soft_wrap=True, highlight=False)
        server.start()
        console.print(
            f"[green]serving {escape(str(server.repository))}[/green]: HTTP {server.http_url}, gRPC "
            f"{server.grpc_url}",
            soft_wrap=True,
        )
        code = server.wait()
    except KilnError as exc:
        raise bad_input(f"{type(exc).__name__}: {exc}") from None
    except KeyboardInterrupt:
        code = 0
    finally:
        server.stop()
    raise typer.Exit(code)


def _trust_line(trust: object) -> str:
    """What the server's loads will trust (docs/security.md): said before its models load."""
    from compiler.package.signing import PUBLIC_KEY_ENV

    if trust is not None:
        return (
            f"packages are verified against {escape(trust.describe())}: unsigned or altered ones are "
            "refused, signed ones run their engines as built"
        )
    return (
        f"no {PUBLIC_KEY_ENV} set: packages load untrusted (their Inductor engines are compiled at load; "
        "`kiln signing init` sets up signing)"
    )


def register_commands(app: typer.Typer) -> None:
    app.add_typer(serve_app, name="serve")
