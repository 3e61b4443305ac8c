"""The ``kiln`` commands around compiling: register deployments, report on and look inside a package, receive
registry webhooks. (Compiling is ``flows.cli``; look-ups and releases ``flows.cli.registry``.)"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import typer
from rich.markup import escape

from flows.cli.options import (
    AllowOpModule,
    Data,
    DebugCompareRuns,
    Deployment,
    DeployName,
    EngineTarget,
    Host,
    JsonOut,
    MaxConnections,
    Out,
    Package,
    Port,
    PrefectFile,
    Repo,
    ReportPackage,
    ReportTrackingUri,
    ReportVersion,
    RequestTimeout,
    Samples,
    State,
    Url,
    Verbose,
    WebhookRegisterName,
    WebhookRegisterTrackingUri,
    WebhookServeZooFile,
    bad_input,
    quiet_prefect,
)
from flows.render import console

DEPLOY_HELP = (
    "Register the deployments of a prefect.yaml (default deploy/prefect.yaml: the nightly zoo recompile "
    "per device) on the Prefect server at PREFECT_API_URL; re-running updates them.\n\n"
    "Then start a worker for each pool:  [bold]prefect worker start --pool kiln-cpu[/bold]"
)


def deploy_cmd(
    prefect_file: PrefectFile = Path("deploy/prefect.yaml"),
    name: DeployName = None,
    repo: Repo = None,
    verbose: Verbose = False,
) -> None:
    quiet_prefect(verbose)
    from prefect.settings import PREFECT_API_URL

    from flows.deployments import register
    from zoo.errors import ZooConfigError

    if not PREFECT_API_URL.value():
        raise bad_input(
            "PREFECT_API_URL is not set: deployments need a running server. Start one "
            "(prefect server start) and export PREFECT_API_URL=http://127.0.0.1:4200/api"
        )
    os.environ["KILN_REPO"] = str((repo or Path(os.environ.get("KILN_REPO") or Path.cwd())).resolve())
    try:
        registered = register(prefect_file, name or None)
    except ZooConfigError as exc:
        raise bad_input(str(exc)) from None
    for full_name, deployment_id in registered.items():
        console.print(f"registered [bold]{escape(full_name)}[/bold] ({deployment_id})")
    console.print(f"run one now:  prefect deployment run {next(iter(registered), 'recompile-zoo/<name>')}")


debug_app = typer.Typer(help="Look inside a compiled package.")


@debug_app.command("compare")
def debug_compare(
    package: Package,
    data: Data = None,
    samples: Samples = 3,
    runs: DebugCompareRuns = 3,
    allow_op_module: AllowOpModule = None,
    as_json: JsonOut = False,
) -> None:
    """Each engine against its own PyTorch submodule, on the activations at its inputs: partition,
    fingerprint, precision, error, latency share. Where a reduced-precision compile loses accuracy."""
    import compiler
    from compiler.errors import KilnError

    try:
        compiled = compiler.load(package, allowed_modules=allow_op_module or None)
        inputs = compiler.validation_data(compiled.input_specs, data, samples=samples)
        table = compiler.compare_partitions(compiled, inputs.samples, runs=runs)
    except KilnError as exc:
        raise bad_input(f"{type(exc).__name__}: {exc}") from None
    if as_json:
        print(json.dumps(table.to_dict(), indent=2))
    else:
        console.print(f"{package} on {inputs.source} ({len(inputs)} samples)", soft_wrap=True)
        console.print(table.table(), highlight=False, soft_wrap=True)


REPORT_HELP = (
    "Write what a compile decided as one self-contained HTML page: the partitioned graph (engines vs "
    "PyTorch fallback, fingerprint, precision, why a partition fell back), partitions, dedup map, "
    "accuracy repair, input specs and engine profiles, validation, stage times, lineage. Opens offline.\n\n"
    "PACKAGE is a package directory, or a registered model name (its champion, else newest version, "
    "is downloaded and verified).\n\n"
    "Example:  [bold]kiln report out/bert.kiln[/bold]    [bold]kiln report bert --version 3[/bold]"
)


def report_cmd(
    package: ReportPackage,
    out: Out = None,
    engine_target: EngineTarget = None,
    version: ReportVersion = None,
    tracking_uri: ReportTrackingUri = None,
) -> None:
    from compiler.atomic import write_bytes_atomic
    from compiler.errors import KilnError
    from compiler.generation.report import render_package_report  # any package; generation's too
    from compiler.package.check import read_manifest

    try:
        if Path(package).is_dir():
            folder, title = Path(package), Path(package).name
            manifest = read_manifest(folder)  # verified like compiler.load: a damaged package is refused
        else:
            from registry.lookup import lookup

            found = lookup(
                package,
                None,
                engine_target=engine_target,
                version=version,
                load=False,
                tracking_uri=tracking_uri,
            )
            manifest, title = found.manifest, f"{found.name} version {found.version}"
            folder = found.package_dir
        # The map draws the whole dataflow from the split graph the package saved (checked first).
        page = render_package_report(folder, manifest, title)
    except KilnError as exc:
        raise bad_input(f"{type(exc).__name__}: {exc}") from None
    path = out or Path(f"{Path(folder).name.removesuffix('.kiln')}.report.html")
    write_bytes_atomic(path, page.encode())
    console.print(f"report: {path.resolve()}", soft_wrap=True)


webhook_app = typer.Typer(help="Recompile when a source model changes in the MLflow registry.")


@webhook_app.command("serve")
def webhook_serve(
    zoo_file: WebhookServeZooFile = Path("deploy/zoo.yaml"),
    deployment: Deployment = "recompile-zoo/zoo-nightly-cpu",
    host: Host = "127.0.0.1",
    port: Port = 8765,
    state: State = Path(".kiln/webhook-deliveries.json"),
    request_timeout: RequestTimeout = 10.0,
    max_connections: MaxConnections = 16,
    verbose: Verbose = False,
) -> None:
    """Receive MLflow registry webhooks (signed with $KILN_WEBHOOK_SECRET) and start recompiles."""
    quiet_prefect(verbose)
    from compiler.errors import KilnError
    from flows.webhook import DeliveryStateError, Receiver, secret_from_env, serve

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        receiver = Receiver(str(zoo_file.resolve()), deployment, secret_from_env(), str(state))
    except KilnError as exc:
        raise bad_input(str(exc)) from None
    try:
        receiver.deliveries.check()
    except DeliveryStateError as exc:  # served anyway: each delivery is refused with this reason
        logging.getLogger("kiln.webhook").error("%s", exc)
    server = serve(receiver, host, port, request_timeout=request_timeout, max_connections=max_connections)
    console.print(f"kiln webhook receiver on http://{host}:{server.server_port}/ for {zoo_file}")
    try:
        server.serve_forever()
    finally:
        server.server_close()


@webhook_app.command("register")
def webhook_register(
    url: Url,
    name: WebhookRegisterName = "kiln-recompile",
    tracking_uri: WebhookRegisterTrackingUri = None,
) -> None:
    """Create the MLflow webhook (new versions, moved aliases) that calls the receiver at URL."""
    from compiler.errors import KilnError
    from flows.webhook import EVENTS, secret_from_env
    from registry import config

    try:
        hook = config.client(tracking_uri).create_webhook(
            name=name, url=url, events=list(EVENTS), secret=secret_from_env()
        )
    except KilnError as exc:
        raise bad_input(str(exc)) from None
    console.print(f"registered MLflow webhook {hook.webhook_id} -> {url} ({', '.join(EVENTS)})")


def register_commands(app: typer.Typer) -> None:
    """Add ``deploy``, ``report``, ``debug`` and ``webhook`` to the kiln app."""
    app.command("deploy", help=DEPLOY_HELP)(deploy_cmd)
    app.command("report", help=REPORT_HELP)(report_cmd)
    app.add_typer(debug_app, name="debug")
    app.add_typer(webhook_app, name="webhook")
