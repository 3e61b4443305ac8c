"""Every option and argument of every ``kiln`` command, as one ``Annotated`` alias each (a command's
parameter names the alias: its flags, help and type are read here), and the helpers the command modules
share (quieting Prefect, the exit for bad input, parsing flags that carry structure, the deprecated
device spelling ``--target`` on zoo and compile).

Two words, one idea each: a **device** is where a model runs (``--device``; the ``Device`` and
``Devices`` options), an **engine target** is what an engine is built for (``--target``; the
``EngineTarget`` options). Parameters carry the same words (``device``, ``engine_target``)."""

from __future__ import annotations

import logging
import os
import warnings
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.markup import escape

from compiler.backends.base import FLOAT_PRECISIONS, QUANTIZED_PRECISIONS
from compiler.backends.capabilities import backend_help, precision_help, quantization_help
from flows.render import EXIT_BAD_INPUT, console

Verbose = Annotated[bool, typer.Option("--verbose", "-v", help="show Prefect's task logs")]
JsonOut = Annotated[bool, typer.Option("--json", help="print the summary as JSON on stdout (for scripts)")]


def flow_environment(verbose: bool) -> dict[str, str]:
    """What a flow command (zoo, compile, deploy, webhook serve) puts in its environment, where unset,
    before it imports Prefect and MLflow: both read it at import."""
    quiet = {
        "PREFECT_LOGGING_LEVEL": "CRITICAL",
        "DASK_LOGGING__DISTRIBUTED": "warning",
        "MLFLOW_LOGGING_LEVEL": "ERROR",  # mlflow resets its logger on import
    }
    return {
        **({} if verbose else quiet),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # The temporary API server migrates a fresh database first: 20 s is not enough on a busy 2-core box.
        "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        "PREFECT_SERVER_LOGGING_LEVEL": "WARNING",
    }


def quiet_prefect(verbose: bool) -> None:
    # Must run before Prefect is imported: its logging settings are read at import.
    for name, value in flow_environment(verbose).items():
        os.environ.setdefault(name, value)
    if not verbose:
        warnings.filterwarnings("ignore")
        logging.getLogger("mlflow").setLevel(logging.ERROR)  # tracking chatter; failures still show


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
DevicesAsTarget = Annotated[list[str] | None, typer.Option("--target", "-t", hidden=True)]
DeviceAsTarget = Annotated[str | None, typer.Option("--target", "-t", hidden=True)]


def devices_with_deprecated_target(command: str, devices: Any, device_as_target: Any) -> Any:
    """``--device`` plus what the deprecated ``--target``/``-t`` spelling gave (a list, or one device)."""
    if not device_as_target:
        return devices
    typer.echo(f"warning: {TARGET_AS_DEVICE.format(command=command)}", err=True)
    if isinstance(device_as_target, list):
        return [*(devices or []), *device_as_target]
    return devices or device_as_target


# ---- every option and argument of every command, by the name its commands use
ZooFile = Annotated[
    Path,
    typer.Argument(
        help="zoo file (YAML): models, input ranges, precision, backend, targets", show_default=True
    ),
]
OutDir = Annotated[
    Path | None,
    typer.Option("--out", "-o", help="where packages go (default: the zoo's settings.out_dir, 'out')"),
]
Devices = Annotated[
    list[str] | None,
    typer.Option("--device", "-d", help="only these devices (repeatable): cpu, cuda:0, ..."),
]
TaskRunner = Annotated[
    str | None,
    typer.Option(
        "--task-runner", help="thread (default) or dask: where engine builds run", show_default=False
    ),
]
DaskAddress = Annotated[
    str | None,
    typer.Option(
        "--dask-address", help="Dask scheduler, e.g. tcp://10.0.0.5:8786 (implies --task-runner dask)"
    ),
]
Workspace = Annotated[
    Path | None, typer.Option("--workspace", help="stage outputs and Prefect's task cache (.kiln/workspace)")
]
EngineCacheDir = Annotated[
    str | None,
    typer.Option(
        "--engine-cache",
        help="persistent engine cache: a directory (.kiln/engine-cache) or a URL shared by workers (s3://...)",
    ),
]
Tracking = Annotated[
    bool | None,
    typer.Option(
        "--tracking/--no-tracking",
        help="record packages in MLflow (default: the zoo's setting; on when the registry is installed)",
        show_default=False,
    ),
]
Model = Annotated[
    list[str] | None, typer.Option("--model", "-m", help="only these models (repeatable), by name")
]
Check = Annotated[
    bool,
    typer.Option("--check", help="only validate the zoo file and preflight each model; build nothing"),
]
CompileModel = Annotated[
    str,
    typer.Argument(
        help="a model name from the zoo file (e.g. bert), a source (hf:./my-bert, pt2:model.pt2, "
        "models:/fraud@champion, factory:zoo.models:tiny_gpt2) or a factory 'module:function'"
    ),
]
CompileZooFile = Annotated[Path, typer.Option("--zoo", help="zoo file to take the model and settings from")]
Device = Annotated[str | None, typer.Option("--device", "-d", help="where the model runs: cpu, cuda, cuda:N")]
Backend = Annotated[
    str | None,
    typer.Option("--backend", "-b", help=backend_help()),
]
Precision = Annotated[
    str | None,
    typer.Option(
        "--precision",
        "-p",
        help=precision_help(FLOAT_PRECISIONS, QUANTIZED_PRECISIONS),
    ),
]
Quantization = Annotated[
    str | None,
    typer.Option("--quantization", help=quantization_help()),
]
CalibrationData = Annotated[
    Path | None,
    typer.Option("--calibration-data", help="int8 static: recorded inputs (.safetensors/.npz)"),
]
CalibrationSamples = Annotated[
    int | None, typer.Option("--calibration-samples", help="int8 static: samples to calibrate on")
]
CalibrationMethod = Annotated[
    str | None, typer.Option("--calibration-method", help="int8 static: minmax, entropy or percentile")
]
StripWeights = Annotated[
    bool | None,
    typer.Option(
        "--strip-weights/--keep-weights",
        help="build weight-stripped engines (refitted at load). Packages store ONNX Runtime and Inductor "
        "engines stripped either way (their weights are in the package once); this decides TensorRT's "
        "and the engine cache's",
    ),
]
MinBlockSize = Annotated[int | None, typer.Option("--min-block-size", help="smallest engine (ops)")]
TorchExecutedOp = Annotated[
    list[str] | None,
    typer.Option("--torch-executed-op", help="keep this op in PyTorch, e.g. aten.gelu.default (repeatable)"),
]
SplitModule = Annotated[
    list[str] | None,
    typer.Option("--split-module", help="each instance of this class its own engine, or 'auto' (repeatable)"),
]
WorkspaceBytes = Annotated[
    int | None, typer.Option("--workspace-bytes", help="TensorRT builder workspace limit")
]
OptimizationLevel = Annotated[
    int | None, typer.Option("--optimization-level", help="TensorRT builder optimization level")
]
BackendOption = Annotated[
    list[str] | None,
    typer.Option("--backend-option", help="backend setting KEY=VALUE (repeatable), as backend_options"),
]
OnBuildFailure = Annotated[
    str | None,
    typer.Option("--on-build-failure", help="a failed engine build: torch, onnxruntime or error"),
]
Name = Annotated[str | None, typer.Option("--name", help="package name (for a source or factory)")]
Task = Annotated[
    str | None, typer.Option("--task", help="hf: sources: sequence-classification, causal-lm, ...")
]
Revision = Annotated[str | None, typer.Option("--revision", help="hf: hub ids: branch, tag or commit")]
TrustRemoteCode = Annotated[
    bool | None,
    typer.Option("--trust-remote-code", help="hf: run the model's own code (only if you trust it)"),
]
OnAccuracyFailure = Annotated[
    str | None,
    typer.Option(
        "--on-accuracy-failure",
        help="int8/fp16/bf16 missing its tolerances: repair (default) or error",
    ),
]
CudaGraphs = Annotated[
    str | None,
    typer.Option("--cuda-graphs", help="replay as CUDA graphs: auto (default: CUDA devices), on, off"),
]
Profile = Annotated[
    list[str] | None,
    typer.Option("--profile", help="a shape profile DIM=SIZE[,DIM=SIZE] (repeatable), e.g. batch=8"),
]
PadToProfile = Annotated[
    str | None,
    typer.Option(
        "--pad-to-profile", help="pad a batch up to the next profile where validation allows: auto, off"
    ),
]
ValidationData = Annotated[
    Path | None,
    typer.Option("--validation-data", help="recorded inputs (.safetensors/.npz, one array per input)"),
]
TrackingUri = Annotated[
    str | None,
    typer.Option(
        "--tracking-uri",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite:///<cwd>/mlflow.db)",
        show_default=False,
    ),
]
# The engine target (what engines are built for), as every registry command takes it; registry.targets
# resolves it against the targets registered for the model.
ENGINE_TARGET_HELP = (
    "engine target of the registered versions: cpu, cuda (this machine's GPU; on a host without one, the "
    "model's only CUDA target) or cuda:sm_90"
)
EngineTarget = Annotated[
    str | None,
    typer.Option(
        "--target",
        help=ENGINE_TARGET_HELP + " (default: the model's one registered target; with several, cuda on a "
        "host with a GPU, else cpu)",
        show_default=False,
    ),
]
ReleaseEngineTarget = Annotated[
    str | None,
    typer.Option(
        "--target",
        help=ENGINE_TARGET_HELP + " (default: the device the zoo entry lists: devices: [cuda] -> cuda)",
        show_default=False,
    ),
]
TritonUrl = Annotated[
    str | None,
    typer.Option(
        "--triton",
        help="a running Triton server (http://127.0.0.1:8000) that must serve the new champion before the "
        "aliases move; with --repository",
        show_default=False,
    ),
]
TritonRepository = Annotated[
    str | None,
    typer.Option(
        "--repository", help="the server's model repository (kiln serve triton export)", show_default=False
    ),
]
TritonTimeout = Annotated[
    float, typer.Option("--triton-timeout", help="seconds to wait for the server to answer a call")
]
LookupModel = Annotated[str, typer.Argument(help="model name as in the zoo file, e.g. tiny_bert")]
Shape = Annotated[
    list[str] | None,
    typer.Option(
        "--shape",
        "-s",
        help="input shape, repeat per input: 4,64 or input_ids=2,16 (optional with --source)",
    ),
]
LookupBackend = Annotated[str | None, typer.Option(help="onnxruntime, tensorrt, ... (default: any)")]
LookupPrecision = Annotated[str | None, typer.Option(help="fp32, fp16, bf16 (default: any)")]
Version = Annotated[str | None, typer.Option(help="pin a version number")]
Source = Annotated[
    str | None,
    typer.Option(
        "--source",
        help="only versions compiled from this source: models:/NAME@ALIAS (the version the alias "
        "points at now, or compiled under that exact URI), models:/NAME/N, hf:..., factory:...",
    ),
]
Dst = Annotated[str | None, typer.Option(help="download the package here (default: the kiln cache)")]
AllowOpModule = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-op-module",
        help="module (prefix) the package may import for its custom ops, e.g. zoo.models; repeatable "
        "(adds to $KILN_ALLOWED_OP_MODULES)",
    ),
]
AsJson = Annotated[bool, typer.Option("--json", help="print the result as JSON")]
ReleaseModel = Annotated[str, typer.Argument(help="model name as in the zoo file")]
ReleaseVersion = Annotated[
    str | None, typer.Option(help="version to release (default: newest not champion, not rejected)")
]
MaxLatencyRatio = Annotated[
    float, typer.Option(help="candidate median latency may be at most this times the champion's")
]
RelL2 = Annotated[
    float | None, typer.Option(help="accuracy tolerance vs the original (default: the zoo entry's)")
]
Runs = Annotated[int, typer.Option(help="timed runs per module for the latency gate")]
ReleaseZooFile = Annotated[
    str | None,
    typer.Option(
        "--zoo",
        help="the zoo file whose entry builds the original model (trusted input; default: the zoo file "
        "of the last kiln zoo run in this directory)",
        show_default=False,
    ),
]
ForceReplaceBroken = Annotated[
    bool,
    typer.Option(
        "--force-replace-broken",
        help="release even if the champion fails verification (recorded on both versions)",
    ),
]
ReleaseAsJson = Annotated[bool, typer.Option("--json", help="print the outcome as JSON")]
To = Annotated[
    str | None,
    typer.Option("--to", help="version to make the champion (default: the 'previous' alias)"),
]
PrefectFile = Annotated[Path, typer.Argument(help="the prefect.yaml to register")]
DeployName = Annotated[
    list[str] | None, typer.Option("--name", "-n", help="only these deployments (repeatable)")
]
Repo = Annotated[
    Path | None,
    typer.Option("--repo", help="checkout the workers run from (sets $KILN_REPO; default: current dir)"),
]
Package = Annotated[Path, typer.Argument(help="a .kiln package directory")]
Data = Annotated[
    Path | None,
    typer.Option("--data", help="recorded inputs (.safetensors/.npz); default: random in range"),
]
Samples = Annotated[int, typer.Option(help="random input sets when no --data is given")]
DebugCompareRuns = Annotated[int, typer.Option(help="timed passes for each partition's latency share")]
ReportPackage = Annotated[
    str, typer.Argument(help="a .kiln package directory, or a model name in the registry (its package)")
]
Out = Annotated[
    Path | None, typer.Option("--out", "-o", help="the HTML file (default: <package name>.report.html)")
]
ReportVersion = Annotated[str | None, typer.Option(help="registry: this version number")]
ReportTrackingUri = Annotated[str | None, typer.Option(help="registry: MLflow tracking URI")]
WebhookServeZooFile = Annotated[
    Path, typer.Option("--zoo", help="zoo file whose entries name models:/ sources")
]
Deployment = Annotated[str, typer.Option(help="the Prefect deployment to start for the affected entries")]
Host = Annotated[str, typer.Option(help="address to listen on")]
Port = Annotated[int, typer.Option(help="port to listen on")]
State = Annotated[
    Path, typer.Option(help="file keeping the ids of accepted deliveries (each is accepted once)")
]
RequestTimeout = Annotated[
    float,
    typer.Option(help="seconds a client has to send its whole request (line, headers, body)", min=0.1),
]
MaxConnections = Annotated[
    int, typer.Option(help="requests handled at once; a connection beyond them is answered 503", min=1)
]
Url = Annotated[str, typer.Argument(help="where kiln webhook serve listens, as MLflow reaches it")]
WebhookRegisterName = Annotated[str, typer.Option(help="the webhook's name in MLflow")]
WebhookRegisterTrackingUri = Annotated[str | None, typer.Option(help="MLflow tracking server")]
Repository = Annotated[
    Path, typer.Option("--repository", "-r", help="the Triton model repository (a directory)")
]
Models = Annotated[list[str], typer.Argument(help="kiln model names (as in the zoo file), e.g. tiny_bert")]
QueueDelayUs = Annotated[
    int, typer.Option("--queue-delay-us", help="dynamic batching: how long a request may wait for others")
]
Instances = Annotated[
    int, typer.Option("--instances", help="model instances per server (0: two per GPU, one on the CPU)")
]
Threads = Annotated[
    int,
    typer.Option(
        "--threads",
        help="intra-op threads per instance (0: the serving machine's cores less one, shared by the "
        "instances)",
    ),
]
StreamTokens = Annotated[
    bool,
    typer.Option(
        "--stream-tokens",
        help="generation versions answer with one response per generated token (Triton's decoupled "
        "mode: gRPC streaming clients only); a model that is not a generation version fails to export",
    ),
]
ExportAllowOpModule = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-op-module",
        help="module (prefix) a package may import for its custom ops; needed only to export a package "
        "written before kiln recorded output specs (it is run once to learn them)",
    ),
]
ServeAllowOpModule = Annotated[
    list[str] | None,
    typer.Option(
        "--allow-op-module",
        help="module (prefix) the served packages may import for their custom ops (added to "
        "$KILN_ALLOWED_OP_MODULES in the server's environment)",
    ),
]
ExportTrackingUri = Annotated[str | None, typer.Option("--tracking-uri", help="MLflow tracking URI")]
HttpPort = Annotated[int, typer.Option("--http-port")]
GrpcPort = Annotated[int, typer.Option("--grpc-port")]
Address = Annotated[
    str, typer.Option("--address", help="where HTTP and gRPC listen (0.0.0.0: every interface)")
]
MetricsPort = Annotated[
    int | None,
    typer.Option("--metrics-port", help="serve Prometheus metrics on this port (default: off)"),
]
Location = Annotated[
    str | None,
    typer.Argument(
        help="a cache directory or URL (s3://bucket/prefix); default: $KILN_CACHE_DIR, "
        "else .kiln/engine-cache",
        show_default=False,
    ),
]
Evict = Annotated[
    bool, typer.Option("--evict", help="delete every bad entry (it is rebuilt when next needed)")
]
MaxBytes = Annotated[
    str | None, typer.Option("--max-bytes", help="keep at most this much per layer (10G, 512M, bytes)")
]
OlderThan = Annotated[
    str | None, typer.Option("--older-than", help="remove entries unused for longer (30m, 12h, 7d, 2w)")
]
SigningDir = Annotated[
    str,
    typer.Option(
        "--dir", help="where the key pair is written (a folder only the pipeline's account can read)"
    ),
]
SigningName = Annotated[str, typer.Option("--name", help="file names: NAME.pem (private), NAME.pub (public)")]
