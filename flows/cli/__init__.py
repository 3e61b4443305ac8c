"""The ``kiln`` command line (the ``kiln`` console script is ``flows.cli:app``).

Every command group, one module each, listed once in :data:`GROUPS`; every option they take is an
``Annotated`` alias in :mod:`flows.cli.options`:

- :mod:`flows.cli.compile`: ``zoo``, ``compile``;
- :mod:`flows.cli.registry`: ``lookup``, ``release``, ``rollback``, ``versions``;
- :mod:`flows.cli.ops`: ``deploy``, ``report``, ``debug``, ``webhook``;
- :mod:`flows.cli.cache`: ``cache ls|verify|gc``;
- :mod:`flows.cli.serve`: ``serve triton export|run``;
- :mod:`flows.cli.signing`: ``signing init|check``.

Only typer and rich are imported here: ``kiln --help`` answers without torch, Prefect or MLflow
(issue 21); each command imports what it uses. Exit codes: 0 all models ok, 1 a model failed,
2 unusable input.
"""

from __future__ import annotations

import gc

import typer

from flows.cli import cache, compile, ops, registry, serve, signing
from registry.terminal import sanitize_logs

sanitize_logs()  # every log line and warning the commands print shows control characters as escapes
# A kiln command is a batch job whose compile makes millions of long-lived objects (exported programs,
# FX graphs, fake tensors). At CPython's default thresholds (700, 10, 10) `kiln zoo deploy/zoo.yaml` ran
# ~4,200 young and 14 full collections, 5.7 of its 29.5 CPU-s on the 2-core CPU here; collecting the
# young generation every 10,000 allocations instead: 2.6 s, and the command's CPU 11% lower. Every
# generation is still collected (a webhook receiver runs for days), only less often.
COLLECTOR_THRESHOLDS = (10_000, 10, 10)
gc.set_threshold(*COLLECTOR_THRESHOLDS)

app = typer.Typer(
    name="kiln",
    no_args_is_help=True,
    add_completion=False,
    rich_markup_mode="rich",
    help=(
        "Compile PyTorch models into validated inference-engine packages (ONNX Runtime by default; "
        "TensorRT, TensorRT-RTX and Inductor optionally).\n\n"
        "Start here:  [bold]kiln zoo deploy/zoo.yaml --out out/[/bold]  compiles the example zoo and "
        "prints where the packages are.\n\n"
        "Exit codes: 0 all models ok, 1 a model failed, 2 unusable input."
    ),
)

# Every command group of kiln, in the order `kiln --help` lists their commands.
GROUPS = (compile, registry, ops, cache, serve, signing)
for _group in GROUPS:
    _group.register_commands(app)


def main() -> None:
    app()
