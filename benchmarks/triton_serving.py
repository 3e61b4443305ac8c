"""Serving one registered version three ways, side by side in one run (issue 33):

* Triton + kiln: ``kiln serve triton export`` + ``tritonserver`` with kiln's Python backend;
* ``mlflow models serve`` of the same registered version (kiln's pyfunc flavour, MLflow's defaults);
* Triton + eager PyTorch: the same backend runtime (request checks, dynamic batching, DLPack) around
  the eager module, without kiln (``benchmarks/triton_eager_backend.py``).

Concurrent clients (1, 4, 16; one request of batch 1 each at a time, each on its own keep-alive
connection) for ``--seconds`` per cell after ``--warmup`` seconds of the same load unmeasured:
throughput and p50/p99 latency. Every arm is driven by the same client: one asyncio loop in this
process (keep-alive HTTP/1.1 on asyncio streams) with the garbage collector paused, so on a 2-core
machine the client costs one lean thread, not 16 threads contending for the GIL and the cores (their
waits showed as the servers' latency).
Triton takes the V2 protocol with the input as binary data (as tritonclient sends it), MLflow its
JSON. Then a release under load: the run's most clients on Triton + kiln while
``registry.release.apply_decision`` makes version 2 the champion through the server (failed requests;
seconds from the call until the server answers from version 2, and where they went: staging, the
server's load call, and inside it the stub's torch import, verify and load, and warm-up from its log).
Targets: Triton + kiln >= 3x ``mlflow models serve`` at 16 clients, its p99 within 2x its p50, 0
failed requests in the release, a release serving in <= 10 s. The machine is shared: the JSON names
the CPU and the load average at the start and end; ``--quiet-below`` waits (up to
``--quiet-wait`` s) for the 1-minute load average to drop below it before starting.

``--device cuda`` (issue 41, item 5): the same version compiled with Inductor fp16 on the GPU and
signed with a key made for the run (so Triton's and MLflow's loads verify it and run its engines as
built), served with ``KIND_GPU``; one more arm, ``in_process``: the package loaded in this process,
timed at the very batch sizes Triton's dynamic batcher executed in each Triton + kiln cell (its
statistics' ``batch_stats``), so its requests per second are the package's own at the same batch mix.
Targets there: Triton + kiln >= 5x mlflow and >= 0.6x in-process at 16 clients, p99/p50 <= 2, a release
live within 10 s. The JSON names the GPU and the host CPU.

    python3 -m benchmarks.triton_serving [--seconds 8] [--clients 1 4 16]
    python3 -m benchmarks.triton_serving --device cuda --out triton_serving_cuda_h100
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import numpy as np
import torch
from torch.export import Dim

from benchmarks._common import print_table, write_json
from benchmarks.machine import cpu_model, gpu_machine
from serving.triton.config import DEFAULT_QUEUE_DELAY_US

ROOT = Path(__file__).resolve().parents[1]
FEATURES, HIDDEN, CLASSES = 256, 1024, 16
# --model: which model every arm serves. The env var carries the choice into Triton's stub process,
# where benchmarks/triton_eager_backend.py rebuilds the eager module with bench_model.
MODEL_ENV = "KILN_BENCH_SERVING_MODEL"
MODELS = {
    "mlp": f"MLP {FEATURES}-{HIDDEN}-{HIDDEN}-{CLASSES}",
    # BERT-base-sized classifier: GPU work per batch large enough that the in-process ratio measures
    # serving overhead against real work, not against a 60-microsecond MLP
    "bert": "BERT 12x768 classifier (vocab 30522, random weights), sequence 256",
    "bert-tiny": "BERT 2x128 classifier (vocab 30522, random weights), sequence 256 (trying the script)",
}
BERT_SEQ, BERT_VOCAB = 256, 30522
MODEL = "bench_mlp"  # the registered / served name (kept for both models: the results' history uses it)
INPUT = {"name": "x"}  # the exported program's input name, read from the repository once exported


def model_kind() -> str:
    return os.environ.get(MODEL_ENV, "mlp")


class _Classifier(torch.nn.Module):
    """Token ids and mask in, logits out (positional: the exported inputs keep these names)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits


def bench_model(seed: int) -> torch.nn.Module:
    """``mlp``: an MLP large enough that batching pays, 256 -> 1024 -> 1024 -> 16. ``bert``: a
    BERT-base-sized sequence classifier from its config, random weights."""
    torch.manual_seed(seed)
    if model_kind().startswith("bert"):
        from transformers import BertConfig, BertForSequenceClassification

        tiny = dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=2, intermediate_size=256)
        config = BertConfig(num_labels=CLASSES, **(tiny if model_kind() == "bert-tiny" else {}))
        return _Classifier(BertForSequenceClassification(config)).eval()
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, HIDDEN),
        torch.nn.GELU(),
        torch.nn.Linear(HIDDEN, CLASSES),
    ).eval()


def example_inputs(batch: int, device: str = "cpu", seed: int | None = None) -> dict[str, torch.Tensor]:
    """One batch of the served model's inputs, by input name."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    if model_kind().startswith("bert"):
        ids = torch.randint(0, BERT_VOCAB, (batch, BERT_SEQ), generator=gen)
        return {"input_ids": ids.to(device), "attention_mask": torch.ones_like(ids, device=device)}
    return {"x": torch.randn(batch, FEATURES, generator=gen).to(device)}


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


SERVED = {"registered": f"kiln.{MODEL}.cpu", "target": "cpu", "device": "cpu"}  # set by build()


def build(root: Path, device: str = "cpu", sign: bool = False) -> dict:
    """Versions 1 and 2 (other weights) of kiln.bench_mlp.<target> in an embedded store; champion -> 1.
    On CUDA: Inductor fp16. ``sign``: signed with a key pair made here; its public key is then set in
    this process's environment, which the servers inherit."""
    import compiler
    from compiler.package.signing import PRIVATE_KEY_ENV, PUBLIC_KEY_ENV, new_key_pair
    from registry import config
    from registry.models import CHAMPION, registered_model_name, set_alias
    from registry.tracking import record_package

    uri = f"sqlite:///{root / 'mlflow.db'}"
    keys = new_key_pair(root / "keys") if sign else None
    if keys:
        os.environ[PRIVATE_KEY_ENV] = str(keys[0])
    example = tuple(example_inputs(8, device).values())
    batch = Dim("batch", min=1, max=32)
    program = compiler.export(
        bench_model(0).to(device), example, dynamic_shapes=tuple({0: batch} for _ in example)
    )
    settings = {"backend": "inductor", "precision": "fp16", "device": device} if device != "cpu" else {}
    compiled = compiler.compile(
        program, profiles=({"batch": 1}, {"batch": 8}, {"batch": 16}, {"batch": 32}), **settings
    )
    v1 = compiler.save(compiled, root / "v1.kiln").path
    # Version 2: other weights, same engines (refit in this process, where the engines are trusted).
    v2 = compiler.save(
        compiled.refit({k: v * 1.01 if v.is_floating_point() else v for k, v in compiled.weights.items()}),
        root / "v2.kiln",
    ).path
    with contextlib.chdir(root):
        for path in (v1, v2):
            record_package(path, MODEL, {"name": MODEL}, tracking_uri=uri)
    target = compiler.read_manifest(v1).engine_target
    SERVED.update(registered=registered_model_name(MODEL, target), target=target, device=device)
    set_alias(config.client(uri), SERVED["registered"], CHAMPION, "1")
    if keys:
        del os.environ[PRIVATE_KEY_ENV]
        os.environ[PUBLIC_KEY_ENV] = str(keys[1])
    return {"uri": uri, "v1": v1, "signed": bool(keys)}


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


def v2_request(inputs: dict[str, np.ndarray]) -> tuple[bytes, dict[str, str]]:
    """A V2 infer request with every input as binary data (the binary tensor extension)."""
    names = {"float32": "FP32", "float16": "FP16", "int64": "INT64", "int32": "INT32", "bool": "BOOL"}
    described, payload = [], b""
    for name, value in inputs.items():
        data = np.ascontiguousarray(value).tobytes()
        described.append(
            {
                "name": name,
                "shape": list(value.shape),
                "datatype": names[str(value.dtype)],
                "parameters": {"binary_data_size": len(data)},
            }
        )
        payload += data
    header = json.dumps({"inputs": described}).encode()
    headers = {
        "Inference-Header-Content-Length": str(len(header)),
        "Content-Type": "application/octet-stream",
    }
    return header + payload, headers


def request_arrays() -> dict[str, np.ndarray]:
    """One batch-1 request, by the served input names (in the exported order)."""
    values = [t.numpy() for t in example_inputs(1, seed=0).values()]
    return dict(zip(INPUT["names"], values, strict=True))


def triton_arm(base: str, model: str) -> tuple[str, bytes, dict[str, str]]:
    body, headers = v2_request(request_arrays())
    return f"{base}/v2/models/{model}/infer", body, headers


def mlflow_arm(base: str) -> tuple[str, bytes, dict[str, str]]:
    arrays = request_arrays()
    by_name = {k: v.tolist() for k, v in arrays.items()}
    inputs = by_name[INPUT["name"]] if len(by_name) == 1 else by_name
    return (
        f"{base}/invocations",
        json.dumps({"inputs": inputs}).encode(),
        {"Content-Type": "application/json"},
    )


class Connection:
    """One keep-alive HTTP/1.1 connection on asyncio streams, posting one prepared request: a few tens
    of microseconds of Python per request (aiohttp's machinery cost several times that, on the cores
    the servers need)."""

    def __init__(self, url: str, body: bytes, headers: dict[str, str]):
        parts = urllib.parse.urlsplit(url)
        self.host, self.port = parts.hostname, parts.port
        head = [f"POST {parts.path} HTTP/1.1", f"Host: {parts.netloc}", f"Content-Length: {len(body)}"]
        head += [f"{k}: {v}" for k, v in headers.items()]
        self.request = ("\r\n".join(head) + "\r\n\r\n").encode() + body
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def post(self) -> bytes:
        """The response body; RuntimeError unless the status is 200."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        status = head[9:12]
        length = re.search(rb"(?i)\r\ncontent-length: *([0-9]+)", head)
        if length is None:
            raise RuntimeError(f"no Content-Length in {head[:200]!r}")
        body = await self.reader.readexactly(int(length.group(1)))
        if status != b"200":
            raise RuntimeError(f"HTTP {status.decode()}: {body[:300]!r}")
        return body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


async def _client_loop(conn: Connection, until: float, out: list[float] | None, failures: list) -> None:
    while (start := time.perf_counter()) < until:
        try:
            await conn.post()
            if out is not None:
                out.append(time.perf_counter() - start)
        except Exception as exc:
            failures[0] += 1
            if len(failures) == 1:  # the first failure's reason, for the results
                failures.append(f"{type(exc).__name__}: {str(exc)[:300]}")
            conn.close()


async def _drive(arm: tuple[str, bytes, dict[str, str]], clients: int, seconds: float, warmup: float) -> dict:
    latencies: list[list[float]] = [[] for _ in range(clients)]
    failures = [0]
    conns = [Connection(*arm) for _ in range(clients)]
    try:
        # Warm-up: the same load, unmeasured (connections, the server's batcher, allocations per size).
        until = time.perf_counter() + warmup
        await asyncio.gather(*(_client_loop(c, until, None, [0]) for c in conns))
        gc.collect()
        gc.disable()
        try:
            until = time.perf_counter() + seconds
            await asyncio.gather(
                *(_client_loop(c, until, latencies[i], failures) for i, c in enumerate(conns))
            )
        finally:
            gc.enable()
    finally:
        for c in conns:
            c.close()
    flat = np.array([v for per in latencies for v in per]) * 1000
    return {
        "clients": clients,
        "requests": int(flat.size),
        "failed": failures[0],
        **({"first_failure": failures[1]} if len(failures) > 1 else {}),
        "throughput_rps": round(flat.size / seconds, 1),
        "p50_ms": round(float(np.percentile(flat, 50)), 3) if flat.size else None,
        "p99_ms": round(float(np.percentile(flat, 99)), 3) if flat.size else None,
    }


def drive(arm: tuple[str, bytes, dict[str, str]], clients: int, seconds: float, warmup: float = 2.0) -> dict:
    """``clients`` concurrent requesters, one request at a time each, for ``seconds`` after ``warmup``."""
    return asyncio.run(_drive(arm, clients, seconds, warmup))


@contextlib.contextmanager
def mlflow_serve(uri: str, root: Path):
    port = free_port()
    log = open(root / "mlflow-serve.log", "wb")  # noqa: SIM115 - the child's
    # mlflow runs `uvicorn` by name: this interpreter's scripts first, as in an activated venv, then a
    # `uvicorn` that is this interpreter's module (a host whose packages come through PYTHONPATH, as the
    # GPU machine's carried wheels do, has no uvicorn script).
    shim = root / "bin"
    shim.mkdir(exist_ok=True)
    (shim / "uvicorn").write_text(f'#!/bin/sh\nexec "{sys.executable}" -m uvicorn "$@"\n')
    (shim / "uvicorn").chmod(0o755)
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", ""), str(shim)])
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "PATH": path}
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/{SERVED['registered']}/1",
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
    """``clients`` clients on Triton + kiln while version 2 is released through the server."""
    from registry.release import GateReport, apply_decision
    from serving.triton.live import TritonRelease

    url, body, headers = triton_arm(server.http_url, MODEL)
    seen: dict[str, int] = {}
    first_v2: list[float] = []
    stop = threading.Event()

    async def one() -> None:
        conn = Connection(url, body, headers)
        while not stop.is_set():
            try:
                version = json.loads(await conn.post())["model_version"]
            except Exception as exc:
                version = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                conn.close()
            seen[version] = seen.get(version, 0) + 1
            if version == "2" and not first_v2:
                first_v2.append(time.monotonic())
        conn.close()

    async def load() -> None:
        await asyncio.gather(*(one() for _ in range(clients)))

    loader = threading.Thread(target=asyncio.run, args=(load(),))
    loader.start()
    time.sleep(1.0)
    log_before = len(server.log_tail(10**9))
    started = time.monotonic()
    live = TritonRelease(server.http_url, repo, MODEL, SERVED["target"], tracking_uri=uri)
    apply_decision(GateReport(SERVED["registered"], "2", "1", {}, {}), tracking_uri=uri, live=live)
    returned = time.monotonic() - started
    time.sleep(1.0)
    stop.set()
    loader.join()
    stub = re.search(
        r"kiln: \S+ version 2 ready in ([0-9.]+) s \(torch ([0-9.]+) s, verify and load ([0-9.]+) s, "
        r"warm-up ([0-9.]+) s",
        server.log_tail(10**9)[log_before:],
    )
    names = ("stub_total", "stub_torch_import", "stub_verify_and_load", "stub_warm_up")
    stub_steps = dict(zip(names, (float(g) for g in stub.groups()), strict=True)) if stub else {}
    return {
        "clients": clients,
        "failed_requests": sum(n for k, n in seen.items() if k.startswith("failed")),
        "answers_by_version": seen,
        "release_call_s": round(returned, 2),
        "release_to_serving_s": round(first_v2[0] - started, 2) if first_v2 else None,
        "steps_s": {
            "stage": live.timings.get("stage"),
            "server_load_call": live.timings.get("load"),
            **stub_steps,
        },
    }


def server_side(server, model: str | None, before: dict | None = None) -> dict:
    """Triton's own statistics of ``model`` (since ``before``): requests per executed batch, and the
    mean milliseconds a request spent queued and in the backend's execute (warm-up included)."""
    if model is None:
        return {}
    from serving.triton.control import TritonControl

    stats = TritonControl(server.http_url).statistics(model)["model_stats"][0]
    now = {
        "inferences": stats["inference_count"],
        "executions": stats["execution_count"],
        "queue_ns": stats["inference_stats"]["queue"]["ns"],
        "infer_ns": stats["inference_stats"]["compute_infer"]["ns"],
        # executions per batch size: the batch mix the backend ran
        **{f"batch_{b['batch_size']}": b["compute_infer"]["count"] for b in stats.get("batch_stats") or []},
    }
    if before is None:
        return now
    d = {k: now[k] - before.get(k, 0) for k in now}
    n = max(d["inferences"], 1)
    return {
        "requests_per_batch": round(d["inferences"] / max(d["executions"], 1), 2),
        "mean_queue_ms": round(d["queue_ns"] / n / 1e6, 3),
        "mean_execute_ms": round(d["infer_ns"] / n / 1e6, 3),
        "batch_mix": {k.removeprefix("batch_"): v for k, v in d.items() if k.startswith("batch_") and v},
    }


def in_process(package: Path, mixes: dict[int, dict[str, int]], device: str, runs: int = 50) -> dict:
    """The package loaded here, timed at each batch size Triton + kiln's batcher executed (median of
    ``runs`` calls each, synchronized): requests per second at each cell's batch mix."""
    import compiler

    module = compiler.load(package, device=device)
    sizes = sorted({int(b) for mix in mixes.values() for b in mix})
    median_s = {}
    with torch.inference_mode():
        for size in sizes:
            x = tuple(example_inputs(size, device).values())
            for _ in range(5):
                module(*x)
            times = []
            for _ in range(runs):
                if device != "cpu":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                module(*x)
                if device != "cpu":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            median_s[size] = float(np.median(times))
    cells = {}
    for clients, mix in mixes.items():
        requests = sum(int(b) * c for b, c in mix.items())
        seconds = sum(median_s[int(b)] * c for b, c in mix.items())
        cells[clients] = {
            "throughput_rps": round(requests / seconds, 1) if seconds else None,
            "batch_mix": mix,
        }
    return {
        "trusted": module.trust_engine_code,
        "median_ms_by_batch": {b: round(t * 1000, 4) for b, t in median_s.items()},
        "cells": cells,
    }


def wait_for_quiet(below: float, patience: float) -> None:
    """Wait up to ``patience`` s for the 1-minute load average to drop below ``below``."""
    deadline = time.monotonic() + patience
    while os.getloadavg()[0] >= below and time.monotonic() < deadline:
        time.sleep(5)


ARMS = ("triton_kiln", "mlflow_serve", "triton_eager", "in_process")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the version runs")
    parser.add_argument("--model", choices=tuple(MODELS), default="mlp", help="what every arm serves")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per cell")
    parser.add_argument("--warmup", type=float, default=2.0, help="unmeasured seconds of the same load first")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--arms", nargs="+", choices=ARMS, default=None, help="default: all but in_process "
                        "on the CPU (it contends with the servers for 2 cores), all on CUDA")  # fmt: skip
    parser.add_argument("--queue-delay-us", type=int, default=DEFAULT_QUEUE_DELAY_US, help="export's setting")
    parser.add_argument("--instances", type=int, default=0, help="export's setting (0: automatic)")
    parser.add_argument("--threads", type=int, default=0, help="export's setting (0: kiln's automatic)")
    parser.add_argument("--no-release", action="store_true", help="skip the release under load")
    parser.add_argument(
        "--no-sign", action="store_true", help="CUDA: leave the versions unsigned (untrusted loads)"
    )
    parser.add_argument("--quiet-below", type=float, default=1.5, help="start once the load average is below")
    parser.add_argument("--quiet-wait", type=float, default=None, help="... or after this many seconds "
                        "(default 300 on the CPU, 0 on CUDA: the GPU host is not shared)")  # fmt: skip
    parser.add_argument("--out", default=None, help="results: a name under benchmarks/results/ or a path "
                        "ending in .json (default triton_serving, triton_serving_cuda)")  # fmt: skip
    parser.add_argument("--no-json", action="store_true", help="print only (trying settings)")
    args = parser.parse_args()
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    os.environ[MODEL_ENV] = args.model
    arms = args.arms or [a for a in ARMS if cuda or a != "in_process"]
    quiet_wait = args.quiet_wait if args.quiet_wait is not None else (0.0 if cuda else 300.0)

    from serving.triton.repository import export
    from serving.triton.server import TritonServer

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    root = Path(tempfile.mkdtemp(prefix="kiln-triton-bench-"))
    release, inproc, steps_s = None, None, {}
    started = time.perf_counter()
    try:
        store = build(root, args.device, sign=cuda and not args.no_sign)
        steps_s["build"] = round(time.perf_counter() - started, 2)
        repo = root / "repository"
        results = export(
            [MODEL],
            repo,
            engine_target=SERVED["target"],
            tracking_uri=store["uri"],
            queue_delay_us=args.queue_delay_us,
            instances=args.instances,
            threads=args.threads,
        )
        if not hasattr(results[0], "model_dir"):
            raise SystemExit(f"export failed: {results[0]}")
        served_inputs = json.loads((repo / MODEL / "1" / "kiln.json").read_text())["inputs"]
        INPUT.update(name=served_inputs[0]["name"], names=[i["name"] for i in served_inputs])
        if "triton_eager" in arms:
            add_eager(repo)
        cells = {}
        mark = time.perf_counter()
        server = TritonServer(repo, http_port=free_port(), grpc_port=free_port()).start()
        steps_s["triton_start_to_ready"] = round(time.perf_counter() - mark, 2)
        stubs = re.findall(r"kiln: \S+ version \S+ ready in [^\n]*", server.log_tail(10**9))
        mlflow = mlflow_serve(store["uri"], root) if "mlflow_serve" in arms else contextlib.nullcontext()
        try:
            with mlflow as mlflow_url:
                wait_for_quiet(args.quiet_below, quiet_wait)
                load_at_start = os.getloadavg()
                drivers = {
                    "triton_kiln": triton_arm(server.http_url, MODEL),
                    "triton_eager": triton_arm(server.http_url, f"{MODEL}_eager"),
                    "mlflow_serve": mlflow_arm(mlflow_url) if mlflow_url else None,
                }
                # Side by side: every arm at one client count before the next count.
                for clients in args.clients:
                    for arm in arms:
                        if arm == "in_process":
                            continue
                        model = {"triton_kiln": MODEL, "triton_eager": f"{MODEL}_eager"}.get(arm)
                        before = server_side(server, model)
                        cells[(arm, clients)] = drive(drivers[arm], clients, args.seconds, args.warmup)
                        if model:
                            cells[(arm, clients)]["server_side"] = server_side(server, model, before)
                        print(arm, cells[(arm, clients)], flush=True)
            if any(c.get("failed") for (arm, _), c in cells.items() if arm == "mlflow_serve"):
                print(
                    "mlflow models serve's log, last lines:\n"
                    + (root / "mlflow-serve.log").read_text()[-4000:]
                )
            if "in_process" in arms:  # the servers idle meanwhile: the package alone on the device
                mixes = {
                    c: cells[("triton_kiln", c)]["server_side"]["batch_mix"]
                    for c in args.clients
                    if ("triton_kiln", c) in cells
                }
                inproc = in_process(store["v1"], mixes, SERVED["device"])
                for clients, cell in inproc["cells"].items():
                    cells[("in_process", clients)] = {"clients": clients, **cell}
                print("in_process", inproc, flush=True)
            if not args.no_release:
                release = release_under_load(server, repo, store["uri"], clients=max(args.clients))
            load_at_end = os.getloadavg()
        finally:
            server.stop()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows = []
    for clients in args.clients:
        for arm in arms:
            c = cells.get((arm, clients))
            if c:
                rows.append(
                    [clients, arm, c["throughput_rps"], c.get("p50_ms"), c.get("p99_ms"), c.get("failed")]
                )
    columns = ["clients", "server", "req/s", "p50 ms", "p99 ms", "failed"]
    print_table(f"serving one version on {args.device}, batch-1 requests", columns, rows)
    top = max(args.clients)
    summary: dict = {"release": release}
    kiln_top, mlflow_top = cells.get(("triton_kiln", top)), cells.get(("mlflow_serve", top))
    inproc_top = cells.get(("in_process", top))
    if kiln_top:
        summary[f"triton_kiln_p99_over_p50_at_{top}"] = round(kiln_top["p99_ms"] / kiln_top["p50_ms"], 2)
    if kiln_top and mlflow_top and mlflow_top["throughput_rps"]:
        summary[f"triton_kiln_vs_mlflow_throughput_at_{top}"] = round(
            kiln_top["throughput_rps"] / mlflow_top["throughput_rps"], 2
        )
    if kiln_top and inproc_top and inproc_top["throughput_rps"]:
        summary[f"triton_kiln_vs_in_process_throughput_at_{top}"] = round(
            kiln_top["throughput_rps"] / inproc_top["throughput_rps"], 2
        )
    summary["targets"] = {
        "throughput_vs_mlflow": f">= {5 if cuda else 3}x at 16 clients",
        **({"throughput_vs_in_process": ">= 0.6x at 16 clients, same batch mix"} if cuda else {}),
        "p99_over_p50": "<= 2",
        "release_failed_requests": 0,
        "release_to_serving_s": "<= 10",
    }
    print(json.dumps(summary, indent=2))
    if args.no_json:
        return
    model = f"{MODELS[args.model]}, batch-1 requests, " + (
        "Inductor fp16 on CUDA (AOTInductor), signed" if cuda and not args.no_sign else
        "Inductor fp16 on CUDA, unsigned" if cuda else "fp32, ORT engines"
    )  # fmt: skip
    payload = {
        **({"gpu_machine": gpu_machine()} if cuda else {}),
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "device": args.device,
        "load_average_at_start": load_at_start,
        "load_average_at_end": load_at_end,
        "seconds_per_cell": args.seconds,
        "warmup_seconds_per_cell": args.warmup,
        "settings": {
            "queue_delay_us": args.queue_delay_us,
            "instances": args.instances,
            "threads": args.threads,
        },
        "client": "one asyncio loop, a keep-alive HTTP/1.1 connection per client, GC paused",
        "model": model,
        "registered_model": SERVED["registered"],
        "steps_s": steps_s,
        "stub_ready_lines": stubs,
        "in_process": inproc,
        "cells": [{"server": arm, **c} for (arm, _), c in cells.items()],
        **summary,
    }
    name = args.out or ("triton_serving_cuda" if cuda else "triton_serving")
    if name.endswith(".json"):
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        Path(name).write_text(
            json.dumps({"machine": {"torch": torch.__version__}, **payload}, indent=2, sort_keys=True)
        )
        print(f"\nwrote {name}")
    else:
        write_json(name, payload)


if __name__ == "__main__":
    main()
