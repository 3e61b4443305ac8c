"""The README-zoo matrix, run as a user runs it (``python -m tests.matrix.driver ROOT``): in ROOT, which
holds ``zoo.yaml`` (deploy/zoo.yaml's models plus a keyword-input ``hf:`` model, tests/matrix), after
``kiln zoo zoo.yaml --out out`` compiled and recorded every model in ROOT's MLflow store, every user
command that takes a model runs on every model of the zoo file, through the CLI, in this one fresh
process (the packages are read back from disk and the registry; nothing of the compile is in memory).

Then Triton: ``kiln serve triton export`` of every model into one repository, ``kiln serve triton run``
as a foreground server in its own process, one infer per model with ``tritonclient`` compared with
``compiler.load`` of the same version; a second version of every model (the first's weights refitted,
as a retrain gives) released under the running server with ``kiln release --triton`` and answered,
then ``kiln rollback --triton`` and answered again by the first. Every step's outcome goes to
``ROOT/matrix.json``: {model: {step: {"exit": code, "output": tail, ...}}}, which the test reads.

Which commands: every CLI command whose argument names a model, a package or a registry target
(read from the CLI itself), run as :data:`INVOCATIONS` says, else as ``kiln <command> <model>``: a new
command is in the matrix without an edit here.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from tests.fixtures import preloaded
from tests.fixtures.triton_server import kiln_triton, triton_inputs

# How each per-model command runs in the matrix (the command path -> argument lists); a command not
# named here runs as `kiln <command> <model>`. "compile" recompiles what `kiln zoo` just compiled.
SKIPPED = {("compile",): "recompiles what `kiln zoo` compiled a step before"}
MODEL_ARGUMENTS = {"model", "models", "target", "package"}
ALLOW = ["zoo.models"]  # mlp-fallback's custom op: what a user passes as --allow-op-module
# The accuracy gate as the zoo says; the latency gate wide open: the same model's median on a busy 2-core
# machine moves by 2x between runs, and the gate itself is tested in tests/registry.
RELEASE_GATES = ["--runs", "3", "--max-latency-ratio", "100"]


def per_model_commands() -> list[tuple[str, ...]]:
    """Every CLI command whose first argument is a model, a package or a registry target."""
    import typer.main

    from flows.cli import app

    found: list[tuple[str, ...]] = []

    def walk(command: Any, path: tuple[str, ...]) -> None:
        if hasattr(command, "commands"):
            for name, sub in sorted(command.commands.items()):
                walk(sub, (*path, name))
            return
        arguments = [p.name for p in command.params if p.param_type_name == "argument"]
        if arguments and arguments[0] in MODEL_ARGUMENTS:
            found.append(path)

    walk(typer.main.get_command(app), ())
    return found


def invocations(model: str, root: Path) -> dict[tuple[str, ...], list[list[str]]]:
    """The argument lists of each command for ``model`` (several where a command has several uses)."""
    package = root / "out" / f"{model}.kiln"
    manifest = json.loads((package / "manifest.json").read_text())
    shape = [
        a for spec in manifest["input_specs"] for a in ("--shape", ",".join(map(str, spec["opt_shape"])))
    ]
    return {
        ("lookup",): [
            ["lookup", model, "--allow-op-module", *ALLOW, "--dst", str(root / "lookup" / model)],
            [
                "lookup",
                model,
                *shape,
                "--allow-op-module",
                *ALLOW,
                "--dst",
                str(root / "lookup-shape" / model),
            ],
        ],
        ("report",): [["report", model, "--out", str(root / "reports" / f"{model}.html")]],
        ("debug", "compare"): [
            ["debug", "compare", str(package), "--samples", "1", "--runs", "1", "--allow-op-module", *ALLOW]
        ],
        ("release",): [["release", model, "--zoo", "zoo.yaml", *RELEASE_GATES]],
        # after the release: one champion, no previous: the typed refusal names what to do
        ("rollback",): [["rollback", model]],
        ("serve", "triton", "export"): [
            ["serve", "triton", "export", model, "--repository", str(root / "repository-one")]
        ],
    }


# Commands that run Prefect flows go through a process of their own, as the console script runs them:
# Prefect's log handlers keep the stream of the first in-process call, which the next call closes. The
# process is forked from tests/fixtures/preloaded.py's server (torch and the like imported once). Every
# such process of the driver has the driver's environment, so its server also imports Prefect and MLflow,
# once instead of in each of the 12 releases: every release imports these (so a child has nothing
# imported that a fresh `kiln release` of the leanest model, mlp-fallback, would not). Transformers only
# where the release imports it anyway (HF_PRELOAD): mlp-fallback's never does, and a package's module
# policy lets an imported module pass.
OWN_PROCESS = {"release", "zoo", "compile", "webhook", "deploy"}
# zoo, compile, deploy and webhook set Prefect's and MLflow's logging variables (flows.cli.options.
# quiet_prefect) before importing them: a server that imported them first would not see those.
PRELOADED = {"release"}
FLOW_PRELOAD = (
    "prefect", "prefect.flows", "prefect.flow_engine", "prefect.task_engine",
    "mlflow", "mlflow.tracking", "mlflow.artifacts", "mlflow.entities", "mlflow.pyfunc",
    "mlflow.store.tracking.sqlalchemy_store", "mlflow.store.model_registry.sqlalchemy_store",
    "alembic.command", "alembic.migration", "typer", "graphviz", "cryptography",
)  # fmt: skip
# A release of a model whose package records transformers (its output types) imports transformers first
# anyway, rebuilding the original from it before it loads a package: ~2 CPU-s each, once in a server.
HF_PRELOAD = (
    *FLOW_PRELOAD, "transformers", "transformers.modeling_utils", "transformers.activations",
    "transformers.masking_utils", "transformers.modeling_layers",
)  # fmt: skip


def preload_for(args: list[str]) -> tuple[str, ...]:
    """What the fork server of ``args``' process has imported (run in the zoo's folder)."""
    if args[0] not in PRELOADED:
        return ()
    manifest = Path("out") / f"{args[1]}.kiln" / "manifest.json"
    recorded = json.loads(manifest.read_text())["op_modules"] if manifest.is_file() else []
    return HF_PRELOAD if any(m.split(".")[0] == "transformers" for m in recorded) else FLOW_PRELOAD


def kiln(args: list[str]) -> dict[str, Any]:
    """One CLI call as the console script runs it (in this process, or its own for a flow); its exit
    code and the tail of what it printed."""
    from typer.testing import CliRunner

    from flows.cli import app

    started = time.perf_counter()
    if args[0] in OWN_PROCESS:
        done = preloaded.run(
            [sys.executable, "-m", "flows.cli", *args],
            capture_output=True,
            text=True,
            preload=preload_for(args),
        )
        code, text = done.returncode, done.stdout + done.stderr
    else:
        result = CliRunner().invoke(app, args)
        code, text = result.exit_code, result.output
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            text += "".join(traceback.format_exception(result.exception))
    return {
        "args": args,
        "exit": code,
        "output": text[-3000:],
        "seconds": round(time.perf_counter() - started, 2),
    }


def inputs_for(specs: list[dict]) -> dict[str, Any]:
    """One request's inputs at the specs' opt shapes; index inputs inside their tables."""
    import numpy as np

    rng = np.random.default_rng(0)
    made = {}
    for spec in specs:
        shape = spec["opt_shape"]
        if spec["dtype"].startswith("float"):
            made[spec["name"]] = rng.standard_normal(shape).astype(spec["dtype"])
        else:
            high = spec.get("index_bound") or 2
            made[spec["name"]] = rng.integers(0, high, shape).astype(spec["dtype"])
    return made


def infer(url: str, model: str, feeds: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """tritonclient over HTTP: every output by name, and the version that answered."""
    import tritonclient.http as http

    # Closed after each request: a kept-alive connection holds the server's exit for its 10 s timeout.
    with http.InferenceServerClient(url) as client:
        answer = client.infer(model, triton_inputs(http, feeds))
    outputs = {o["name"]: answer.as_numpy(o["name"]) for o in answer.get_response()["outputs"]}
    return outputs, answer.get_response()["model_version"]


def expected(package: Path, feeds: dict[str, Any]) -> list[Any]:
    """``compiler.load`` of the package, called with keywords as a user calls it; flat outputs."""
    import torch
    from torch.utils import _pytree

    import compiler

    loaded = compiler.load(package, allowed_modules=ALLOW)
    with torch.no_grad():
        out = loaded(**{k: torch.from_numpy(v) for k, v in feeds.items()})
    return [t.numpy() for t in _pytree.tree_leaves(out)]


def compare(url: str, model: str, repository: Path, version: str, feeds: dict[str, Any]) -> dict[str, Any]:
    outputs, answered = infer(url, model, feeds)
    served = json.loads((repository / model / version / "kiln.json").read_text())
    want = expected(repository / model / version / "package", feeds)
    names = [o["name"] for o in served["outputs"]]
    diffs = {n: float(abs(outputs[n] - w).max()) for n, w in zip(names, want, strict=True)}
    return {"version": answered, "max_abs_diff": diffs, "outputs": sorted(outputs)}


def second_version(root: Path, model: str) -> str:
    """A retrained version: the package's weights scaled by 1 + 1e-6 (two units in the last place where
    they are stored at fp16/bf16: smaller changes vanish there, and the package stays the same), refitted
    and recorded."""

    import torch

    import compiler
    from registry.tracking import record_package

    path = root / "v2" / f"{model}.kiln"
    path.parent.mkdir(exist_ok=True)
    import shutil

    shutil.copytree(root / "out" / f"{model}.kiln", path)
    weights = compiler.load(path, allowed_modules=ALLOW).plan.program_weights
    state = {
        k: v * (1 + max(1e-6, 2 * torch.finfo(v.dtype).eps)) if v.is_floating_point() else v
        for k, v in weights.items()
    }
    compiler.refit_package(path, {k: v.contiguous() for k, v in state.items()}, allowed_modules=ALLOW)
    return record_package(path, model, {"name": model}).version


def step(results: dict, model: str, name: str, action: Callable[[], dict[str, Any]]) -> None:
    try:
        results.setdefault(model, {})[name] = action()
    except Exception as exc:  # the step's failure is the test's to report, with its cause
        results.setdefault(model, {})[name] = {
            "exit": -1,
            "output": "".join(traceback.format_exception(exc))[-3000:],
        }


def main(root: Path) -> None:
    os.chdir(root)  # the registry is ROOT's ./mlflow.db, as after `kiln zoo` run there
    models = [m["name"] for m in yaml.safe_load((root / "zoo.yaml").read_text())["models"]]
    results: dict[str, dict[str, Any]] = {}
    commands = per_model_commands()
    results["_commands"] = {
        "per_model": [" ".join(c) for c in commands],
        "skipped": {" ".join(k): v for k, v in SKIPPED.items()},
    }
    for model in models:
        table = invocations(model, root)
        for command in commands:
            if command in SKIPPED:
                continue
            for index, args in enumerate(table.get(command, [[*command, model]])):
                step(results, model, f"{' '.join(command)}#{index}", lambda a=args: kiln(a))
    repository = root / "repository"
    step(
        results,
        "_all",
        "serve triton export",
        lambda: kiln(["serve", "triton", "export", *models, "--repository", str(repository)]),
    )
    (root / "matrix.json").write_text(json.dumps(results, indent=1, default=str))
    try:  # the results so far are written whatever happens
        with kiln_triton(root, repository, allow_op_modules=ALLOW) as server:
            url = server.http
            for model in models:
                feeds = inputs_for(
                    json.loads((root / "out" / f"{model}.kiln" / "manifest.json").read_text())["input_specs"]
                )
                step(
                    results,
                    model,
                    "triton infer",
                    lambda m=model, f=feeds: compare(url, m, repository, _served(repository, m), f),
                )
                step(
                    results,
                    model,
                    "second version",
                    lambda m=model: {"exit": 0, "version": second_version(root, m)},
                )
                version = results[model]["second version"].get("version")
                live = ["--triton", f"http://{url}", "--repository", str(repository)]
                step(
                    results,
                    model,
                    "release --triton",
                    lambda m=model, v=version, t=live: kiln(
                        ["release", m, "--version", str(v), "--zoo", "zoo.yaml", *RELEASE_GATES, *t]
                    ),
                )
                step(
                    results,
                    model,
                    "triton infer after release",
                    lambda m=model, f=feeds: compare(url, m, repository, _served(repository, m), f),
                )
                step(results, model, "rollback --triton", lambda m=model, t=live: kiln(["rollback", m, *t]))
                step(
                    results,
                    model,
                    "triton infer after rollback",
                    lambda m=model, f=feeds: compare(url, m, repository, _served(repository, m), f),
                )
    finally:
        (root / "matrix.json").write_text(json.dumps(results, indent=1, default=str))


def _served(repository: Path, model: str) -> str:
    """The version the model's config serves now (its version policy)."""
    from serving.triton.repository import read_config, served_version

    return served_version(read_config(repository / model)) or ""


if __name__ == "__main__":
    main(Path(sys.argv[1]).resolve())
