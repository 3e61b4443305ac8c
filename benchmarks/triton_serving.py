"""Serving one registered version three ways, side by side in one run (issue 33):

* Triton + kiln: ``kiln serve triton export`` + ``tritonserver`` with kiln's Python backend;
* ``mlflow models serve`` of the same registered version (kiln's pyfunc flavour, MLflow's defaults);
* Triton + eager PyTorch: the same backend runtime (request checks, dynamic batching, DLPack) around
  the eager module, without kiln (``benchmarks/triton_eager_backend.py``).

Concurrent clients (1, 4, 16 threads, one request of batch 1 each at a time, each with its own
connection) for ``--seconds`` per cell: throughput and p50/p99 latency. Then a release under load: 4
clients on Triton + kiln while ``registry.release.apply_decision`` makes version 2 the champion through
the server (failed requests; seconds from the call until the server answers from version 2).
Targets: Triton + kiln >= 3x ``mlflow models serve`` at 16 clients, its p99 within 2x its p50, 0
failed requests in the release, a release serving in <= 10 s. JSON names the CPU
(``benchmarks/results/triton_serving.json``).

    python3 -m benchmarks.triton_serving [--seconds 8]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.export import Dim

from benchmarks._common import print_table, write_json
from benchmarks.machine import cpu_model

ROOT = Path(__file__).resolve().parents[1]
FEATURES, HIDDEN, CLASSES = 256, 1024, 16
MODEL = "bench_mlp"
INPUT = {"name": "x"}  # the exported program's input name, read from the repository once exported


def bench_model(seed: int) -> torch.nn.Module:
    """An MLP large enough that batching pays: 256 -> 1024 -> 1024 -> 16."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    ).eval()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def build(root: Path) -> dict:
    """Versions 1 and 2 (other weights) of kiln.bench_mlp.cpu in an embedded store; champion -> 1."""
    import compiler
    from registry import config
    from registry.models import CHAMPION, set_alias
    from registry.tracking import record_package

    uri = f"sqlite:///{root / 'mlflow.db'}"
    program = compiler.export(
        bench_model(0), (torch.randn(8, FEATURES),), dynamic_shapes=({0: Dim("batch", min=1, max=32)},)
    )
    compiled = compiler.compile(program, profiles=({"batch": 1}, {"batch": 8}, {"batch": 16}, {"batch": 32}))
    v1 = compiler.save(compiled, root / "v1.kiln").path
    v2 = root / "v2.kiln"
    shutil.copytree(v1, v2)
    compiler.refit_package(v2, {k: v * 1.01 for k, v in compiler.load(v2).weights.items()})
    with contextlib.chdir(root):
        for path in (v1, v2):
            record_package(path, MODEL, {"name": MODEL}, tracking_uri=uri)
    set_alias(config.client(uri), f"kiln.{MODEL}.cpu", CHAMPION, "1")
    return {"uri": uri}


def add_eager(repo: Path) -> None:
    """``bench_mlp_eager``: a copy of the kiln version folder whose model.py runs the eager module."""
    from serving.triton.config import SERVED_FILE, ServedModel, render_config

    source = repo / MODEL / "1"
    folder = repo / f"{MODEL}_eager"
    shutil.copytree(source, folder / "1")
    shutil.copyfile(ROOT / "benchmarks" / "triton_eager_backend.py", folder / "1" / "model.py")
    served = json.loads((source / SERVED_FILE).read_text())
    served["name"] = f"{MODEL}_eager"
    (folder / "1" / SERVED_FILE).write_text(json.dumps(served))
    record = ServedModel.from_json(json.dumps(served), "eager")
    (folder / "config.pbtxt").write_text(render_config(record, queue_delay_us=1000))


def triton_client(url: str, model: str) -> Callable[[np.ndarray], object]:
    import tritonclient.http as http

    client = http.InferenceServerClient(url)

    def call(x: np.ndarray) -> object:
        tensor = http.InferInput(INPUT["name"], list(x.shape), "FP32")
        tensor.set_data_from_numpy(x)
        return client.infer(model, [tensor])

    return call


def mlflow_client(url: str) -> Callable[[np.ndarray], object]:
    import requests

    session = requests.Session()

    def call(x: np.ndarray) -> object:
        response = session.post(f"{url}/invocations", json={"inputs": x.tolist()}, timeout=60)
        response.raise_for_status()
        return response.json()

    return call


def drive(make_client: Callable[[], Callable], clients: int, seconds: float) -> dict:
    """``clients`` threads, each with its own connection, one request at a time, for ``seconds``."""
    x = np.random.default_rng(0).standard_normal((1, FEATURES)).astype(np.float32)
    latencies: list[list[float]] = [[] for _ in range(clients)]
    failures = [0] * clients
    start_at = time.monotonic() + 1.0  # each thread warms its connection first
    stop_at = start_at + seconds

    def run(i: int) -> None:
        call = make_client()
        with contextlib.suppress(Exception):  # a failing server shows in the counted requests below
            call(x)
        while time.monotonic() < start_at:
            time.sleep(0.001)
        while (now := time.perf_counter()) and time.monotonic() < stop_at:
            try:
                call(x)
                latencies[i].append(time.perf_counter() - now)
            except Exception:
                failures[i] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = np.array([v for per in latencies for v in per]) * 1000
    return {
        "clients": clients,
        "requests": int(flat.size),
        "failed": sum(failures),
        "throughput_rps": round(flat.size / seconds, 1),
        "p50_ms": round(float(np.percentile(flat, 50)), 3) if flat.size else None,
        "p99_ms": round(float(np.percentile(flat, 99)), 3) if flat.size else None,
    }


@contextlib.contextmanager
def mlflow_serve(uri: str, root: Path):
    port = free_port()
    log = open(root / "mlflow-serve.log", "wb")  # noqa: SIM115 - the child's
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/kiln.{MODEL}.cpu/1",
         "--env-manager", "local", "--host", "127.0.0.1", "-p", str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=root,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError((root / "mlflow-serve.log").read_text()[-3000:])
            with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/ping", timeout=2) as response:
                if response.status == 200:
                    break
            time.sleep(0.3)
        yield url
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
        log.close()


def release_under_load(server, repo: Path, uri: str, clients: int = 4) -> dict:
    """4 clients on Triton + kiln while version 2 is released through the server."""
    from registry.release import GateReport, apply_decision
    from serving.triton.live import TritonRelease

    x = np.random.default_rng(1).standard_normal((1, FEATURES)).astype(np.float32)
    stop = threading.Event()
    seen: dict[str, int] = {}
    first_v2: list[float] = []
    lock = threading.Lock()

    def run() -> None:
        call = triton_client(server.http_url.removeprefix("http://"), MODEL)
        while not stop.is_set():
            try:
                version = call(x).get_response()["model_version"]
            except Exception as exc:
                version = f"failed: {type(exc).__name__}"
            with lock:
                seen[version] = seen.get(version, 0) + 1
                if version == "2" and not first_v2:
                    first_v2.append(time.monotonic())

    threads = [threading.Thread(target=run) for _ in range(clients)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    started = time.monotonic()
    live = TritonRelease(server.http_url, repo, MODEL, tracking_uri=uri)
    apply_decision(GateReport(f"kiln.{MODEL}.cpu", "2", "1", {}, {}), tracking_uri=uri, live=live)
    returned = time.monotonic() - started
    time.sleep(1.0)
    stop.set()
    for t in threads:
        t.join()
    return {
        "clients": clients,
        "failed_requests": sum(n for k, n in seen.items() if k.startswith("failed")),
        "answers_by_version": seen,
        "release_call_s": round(returned, 2),
        "release_to_serving_s": round(first_v2[0] - started, 2) if first_v2 else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    args = parser.parse_args()

    from serving.triton.repository import export
    from serving.triton.server import TritonServer

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    root = Path(tempfile.mkdtemp(prefix="kiln-triton-bench-"))
    try:
        store = build(root)
        repo = root / "repository"
        export([MODEL], repo, tracking_uri=store["uri"])
        INPUT["name"] = json.loads((repo / MODEL / "1" / "kiln.json").read_text())["inputs"][0]["name"]
        add_eager(repo)
        rows, cells = [], {}
        server = TritonServer(repo, http_port=free_port(), grpc_port=free_port()).start()
        try:
            url = server.http_url.removeprefix("http://")
            for clients in args.clients:
                cells[("triton_kiln", clients)] = drive(
                    lambda: triton_client(url, MODEL), clients, args.seconds
                )
                cells[("triton_eager", clients)] = drive(
                    lambda: triton_client(url, f"{MODEL}_eager"), clients, args.seconds
                )
            with mlflow_serve(store["uri"], root) as mlflow_url:
                for clients in args.clients:
                    cells[("mlflow_serve", clients)] = drive(
                        lambda: mlflow_client(mlflow_url), clients, args.seconds
                    )
            release = release_under_load(server, repo, store["uri"])
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    for clients in args.clients:
        for arm in ("triton_kiln", "mlflow_serve", "triton_eager"):
            c = cells[(arm, clients)]
            rows.append([clients, arm, c["throughput_rps"], c["p50_ms"], c["p99_ms"], c["failed"]])
    columns = ["clients", "server", "req/s", "p50 ms", "p99 ms", "failed"]
    print_table("serving one version, batch-1 requests", columns, rows)
    top = max(args.clients)
    kiln16, mlflow16 = cells[("triton_kiln", top)], cells[("mlflow_serve", top)]
    summary = {
        f"triton_kiln_vs_mlflow_throughput_at_{top}": round(
            kiln16["throughput_rps"] / mlflow16["throughput_rps"], 2
        ),
        f"triton_kiln_p99_over_p50_at_{top}": round(kiln16["p99_ms"] / kiln16["p50_ms"], 2),
        "release": release,
        "targets": {
            "throughput_vs_mlflow": ">= 3x at 16 clients",
            "p99_over_p50": "<= 2",
            "release_failed_requests": 0,
            "release_to_serving_s": "<= 10",
        },
    }
    print(json.dumps(summary, indent=2))
    write_json(
        "triton_serving",
        {
            "cpu": cpu_model(),
            "cpu_cores": os.cpu_count(),
            "load_average_at_end": os.getloadavg(),
            "seconds_per_cell": args.seconds,
            "model": f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES} fp32, batch-1 requests, ORT engines",
            "cells": [{"server": arm, **c} for (arm, _), c in cells.items()],
            **summary,
        },
    )


if __name__ == "__main__":
    main()
