"""The GPU user's path, whole (issue 41, item 4): a CUDA zoo from ``kiln zoo`` to Triton, through the CLI.

deploy/zoo-cuda.yaml (five models: ``hf:`` BERT with token_type_ids, ``hf:`` ViT, ``hf:`` GPT-2 as a
decoder, a model with a fallback op, an int8 entry with its accuracy gate; Inductor fp16 on CUDA) is
copied into a work folder beside its ``hf:`` folders (random weights, save_pretrained), then, in order,
each step a ``kiln`` command as a user types it, timed:

  models      the hf: folders (GPT-2: 6 x 768, GPT-2's vocabulary: the issue's GPT-2-class version)
  signing     ``kiln signing init``: the private key for the compile, the public key for the rest
  zoo         ``kiln zoo`` (Prefect's temporary API, the embedded MLflow store), signed
  lookup      ``kiln lookup`` of each model: verified, trusted; its package answers like eager
  release     ``kiln release`` of each model (v1 becomes the champion)
  zoo_v2      new GPT-2 weights, ``kiln zoo -m gpt2``: version 2, not yet released
  export      ``kiln serve triton export`` of the five (KIND_GPU on a GPU)
  serve       ``kiln serve triton run`` with the public key: seconds to ready, each version's stub line
  tritonclient  tritonclient (gRPC) answers equal ``compiler.load``'s of the same package
  release_live  ``kiln release gpt2 --triton`` under 16 clients: failed requests, seconds until v2 answers
  rollback    ``kiln rollback gpt2 --triton`` under the same load: v1 answers again

The work folder persists, so the steps can be split across device calls (``--steps``); results merge
into one JSON (``--out``) naming the GPU and host CPU, written after every step. A failed step stops the
run with the command's output tail (exit 1). ``--device cpu --quick`` runs the same path on a CPU host
with tiny models on ONNX Runtime (the script's own check; no GPU numbers).

    python3 benchmarks/gpu_e2e.py --work /tmp/kiln-e2e --out $OUT/gpu_e2e_h100.json [--steps a,b,...]
    python3 benchmarks/gpu_e2e.py --device cpu --quick --work /tmp/kiln-e2e-cpu --out /tmp/e2e.json

On the GPU machine, step by step in device calls: benchmarks/gpu_issue41.sh. ``--target`` is what the
CLI is given (default ``cuda``: the version built for this machine's GPU); ``--models`` and ``--live``
narrow the run (a model that fails to compile for a reason outside this script).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.triton_serving import Connection, free_port, v2_request  # noqa: E402

STEPS = (
    "models", "signing", "zoo", "lookup", "release", "zoo_v2", "export", "serve", "tritonclient",
    "release_live", "rollback",
)  # fmt: skip
MODELS = ["bert", "vit", "gpt2", "mlp-fallback", "bert-int8"]  # --models narrows it
LIVE = ["gpt2"]  # the model released and rolled back under load (--live)
CLIENTS = 16
OP_MODULES = "transformers.modeling_outputs,transformers.cache_utils,zoo.models"  # mlp-fallback's op


class StepFailed(RuntimeError):
    pass


class Run:
    """The work folder, the results (merged with an earlier run's in the same folder), the server."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work = Path(args.work).resolve()
        self.work.mkdir(parents=True, exist_ok=True)
        (self.work / "logs").mkdir(exist_ok=True)
        self.state_file = self.work / "results.json"
        self.results = json.loads(self.state_file.read_text()) if self.state_file.is_file() else {}
        self.results.setdefault("steps", {})
        self.results["machine"] = machine(args.device)
        self.results["settings"] = {
            "device": args.device, "quick": args.quick, "target": args.target, "models": MODELS,
            "live": LIVE[0],
        }  # fmt: skip
        self.server: subprocess.Popen | None = None
        self.ports: dict[str, int] = {}

    @property
    def keys(self) -> dict:
        return self.results.get("signing") or {}

    def env(self, *, sign: bool = False, verify: bool = True) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_SIGNING_")}
        env.update(
            PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
            HF_HUB_OFFLINE="1",
            COLUMNS="200",
            KILN_ALLOWED_OP_MODULES=OP_MODULES,
            MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR="false",
        )
        if sign and self.keys:
            env["KILN_SIGNING_PRIVATE_KEY"] = self.keys["private_key"]
        if verify and self.keys:
            env["KILN_SIGNING_PUBLIC_KEY"] = self.keys["public_key"]
        return env

    def kiln(
        self, *args: str, sign: bool = False, verify: bool | None = None, timeout: float = 540,
        ok: tuple[int, ...] = (0,),
    ) -> str:  # fmt: skip
        """One ``kiln`` command in the work folder; its output logged; StepFailed with the tail unless its
        exit code is in ``ok``."""
        log = self.work / "logs" / f"{len(list((self.work / 'logs').iterdir())):02d}-{args[0]}.log"
        started = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-m", "flows.cli", *args],
            cwd=self.work,
            env=self.env(sign=sign, verify=not sign if verify is None else verify),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        log.write_text(f"$ kiln {' '.join(args)}\n{done.stdout}\n--- stderr\n{done.stderr}")
        print(f"  kiln {' '.join(args)}: exit {done.returncode} in {time.perf_counter() - started:.1f} s")
        if done.returncode not in ok:
            raise StepFailed(
                f"kiln {' '.join(args)} exited {done.returncode} ({log}):\n{done.stdout[-3000:]}\n"
                f"{done.stderr[-3000:]}"
            )
        return done.stdout

    def save(self) -> None:
        text = json.dumps(self.results, indent=2, sort_keys=True, default=str)
        self.state_file.write_text(text)
        if self.args.out:
            Path(self.args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(self.args.out).write_text(text)


def machine(device: str) -> dict:
    from benchmarks.machine import cpu_model, gpu_machine

    if device == "cuda":
        return gpu_machine()
    import platform

    import torch

    return {
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }


# ------------------------------------------------------------------------------------------ steps


def step_models(run: Run) -> dict:
    """The zoo file (deploy/zoo-cuda.yaml, or its CPU form) and its hf: folders."""
    zoo = yaml.safe_load((ROOT / "deploy" / "zoo-cuda.yaml").read_text())
    if run.args.device == "cpu":  # the same entries in fp32 on ONNX Runtime (or --backend inductor with
        # AOTInductor packages, as on CUDA); int8: ONNX Runtime's dynamic int8
        for entry in zoo["models"]:
            int8 = entry["name"] == "bert-int8"
            entry.update(devices=["cpu"], backend="onnxruntime" if int8 else run.args.backend)
            entry["precision"] = "int8" if int8 else "fp32"
            if entry["backend"] == "inductor":
                entry["backend_options"] = {"aot": True}
        zoo["settings"]["build_concurrency"] = {"cpu": 2}
    if run.args.quick:
        zoo["settings"]["validation"] = {"samples": 2, "warmup": 1, "runs": 3}
        for entry in zoo["models"]:
            if entry["name"] == "mlp-fallback":
                entry["factory_kwargs"] = {"width": 64}
            if entry["name"] == "bert-int8":
                entry["factory_kwargs"] = {"num_layers": 2, "hidden": 64}
    (run.work / "zoo.yaml").write_text(yaml.safe_dump(zoo, sort_keys=False))
    sizes = hf_folders(run.work / "models", quick=run.args.quick, seed=0)
    return {"zoo": str(run.work / "zoo.yaml"), "hf_models": sizes}


def hf_folders(
    root: Path, *, quick: bool, seed: int, only: tuple[str, ...] = ("bert", "vit", "gpt2")
) -> dict:
    import torch

    from compiler.quantization.torchao_guard import keep_torchao_out_of_transformers

    keep_torchao_out_of_transformers()  # transformers would import torchao, which nothing here uses
    import transformers as t

    small = quick
    made = {}
    for name in only:
        torch.manual_seed(seed)
        if name == "bert":
            config = t.BertConfig(
                vocab_size=1000 if small else 8192, hidden_size=64 if small else 256,
                num_hidden_layers=1 if small else 4, num_attention_heads=2 if small else 4,
                intermediate_size=128 if small else 1024, max_position_embeddings=128, type_vocab_size=2,
                num_labels=3,
            )  # fmt: skip
            model = t.BertForSequenceClassification(config)
        elif name == "vit":
            config = t.ViTConfig(
                image_size=32 if small else 64, patch_size=8, hidden_size=64 if small else 256,
                num_hidden_layers=1 if small else 4, num_attention_heads=2 if small else 4,
                intermediate_size=128 if small else 1024, num_labels=10,
            )  # fmt: skip
            model = t.ViTForImageClassification(config)
        else:  # GPT-2-class: 6 x 768 with GPT-2's vocabulary (the issue's 28 s unsigned Triton load)
            config = t.GPT2Config(
                vocab_size=1000 if small else 50257, n_embd=64 if small else 768,
                n_layer=1 if small else 6, n_head=2 if small else 12, n_positions=128,
                bos_token_id=0, eos_token_id=0,
            )  # fmt: skip
            model = t.GPT2Model(config)
        model.eval().save_pretrained(root / name)
        made[name] = {"parameters": sum(p.numel() for p in model.parameters())}
    return made


def step_signing(run: Run) -> dict:
    keys = run.work / "keys"
    if (keys / "kiln-signing.pem").is_file():  # a resumed run signs with the identity it made
        return run.keys
    made = json.loads(run.kiln("signing", "init", "--dir", str(keys), "--json"))
    run.results["signing"] = made
    checked = json.loads(run.kiln("signing", "check", "--json", sign=True, verify=True))
    if not checked["pair_verified"]:
        raise StepFailed(f"kiln signing check: the key pair was not verified: {checked}")
    return made


def step_zoo(run: Run, *only: str) -> dict:
    args = ["zoo", "zoo.yaml", "--out", "out", "--json"]
    for name in only or (MODELS if len(MODELS) < 5 else ()):
        args += ["-m", name]
    run.kiln(*args, sign=True, ok=(0, 1))
    summary = json.loads((run.work / "out" / "summary.json").read_text())
    rows = {
        m["name"]: {
            **{
                k: m.get(k)
                for k in ("status", "precision", "max_rel_l2", "latency_ratio", "seconds", "error")
            },
            "registered": (m.get("tracking") or {}).get("registered_model"),
            "version": (m.get("tracking") or {}).get("version"),
        }
        for m in summary["models"]
    }
    failed = {n: r for n, r in rows.items() if r["status"] != "ok"}
    for name in only or MODELS:
        if name in failed or name not in rows:
            raise StepFailed(f"kiln zoo: {name} failed: {json.dumps(rows.get(name))}")
        if not (run.work / "out" / f"{name}.kiln" / "model.sig").is_file():
            raise StepFailed(f"kiln zoo: out/{name}.kiln is not signed (model.sig missing)")
    return {"models": rows, "seconds": summary.get("seconds")}


def step_lookup(run: Run) -> dict:
    """Each model through ``kiln lookup`` (verified against the public key, engine code trusted), then
    its package answers like the eager model on the source's own example inputs."""
    import torch

    import compiler
    from compiler.validation.validate import compare
    from zoo.zoo_file import load_zoo

    os.environ.update({k: v for k, v in run.env().items() if k.startswith(("KILN_", "HF_"))})
    zoo = load_zoo(run.work / "zoo.yaml")
    entries = {e.name: e for e in zoo.entries}
    out = {}
    for name in MODELS:
        started = time.perf_counter()
        shapes = [a for spec in middle_shapes(run.work / "out" / f"{name}.kiln") for a in ("--shape", spec)]
        found = json.loads(
            run.kiln(
                "lookup", name, "--target", run.args.target, *shapes, "--dst", f"lookup/{name}", "--json"
            )
        )
        seconds = time.perf_counter() - started
        if not str(found.get("engine_code", "")).startswith("engine code trusted"):
            raise StepFailed(f"kiln lookup {name}: engine code not trusted: {found.get('engine_code')}")
        case = zoo.requests(entries[name])[0].source.load()
        device = run.args.device
        args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in case.args]
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.kwargs.items()}
        module = compiler.load(run.work / found["package_dir"])  # the path is relative to kiln's cwd
        with torch.inference_mode():
            eager = case.model.to(device).eval()(*args, **kwargs)
            got = module(*args, **kwargs)
        rows = compare(eager, got)
        out[name] = {
            "version": found["version"],
            "lookup_s": round(seconds, 2),
            "load_s": module.load_seconds.get("total"),
            "rel_l2_vs_eager": max(r.rel_l2 for r in rows),
            "dispatch": sorted(set(map(str, module.last_dispatch().values()))),  # "aot": ran natively
            "engine_code": found["engine_code"],
        }
        limit = 0.1 if name == "bert-int8" else 2e-2
        if not out[name]["rel_l2_vs_eager"] <= limit:
            raise StepFailed(
                f"{name}: the looked-up package answers rel L2 {out[name]['rel_l2_vs_eager']:.3g} > {limit}"
            )
        print(f"  {name}: v{found['version']} rel L2 vs eager {out[name]['rel_l2_vs_eager']:.2e}")
    return out


def middle_shapes(package: Path) -> list[str]:
    """``name=2,16``-style shapes inside each input's recorded range (batch 2, sequence 16)."""
    import compiler

    shapes = []
    for spec in compiler.read_manifest(package, verify=False).input_specs:
        bounds = zip(spec.min_shape, spec.max_shape, strict=True)
        dims = [max(lo, min(hi, 2 if axis == 0 else 16)) for axis, (lo, hi) in enumerate(bounds)]
        shapes.append(f"{spec.name}={','.join(map(str, dims))}")
    return shapes


def step_release(run: Run) -> dict:
    out = {}
    for name in MODELS:
        started = time.perf_counter()
        text = run.kiln(
            "release", name, "--zoo", "zoo.yaml", "--target", run.args.target, "--max-latency-ratio", "3",
            "--runs", "10", "--json",
        )  # fmt: skip
        out[name] = {"seconds": round(time.perf_counter() - started, 2), "result": _json_tail(text)}
    return out


def step_zoo_v2(run: Run) -> dict:
    """GPT-2 fine-tuned (here: other random weights), compiled and recorded: version 2, not released."""
    live = LIVE[0]
    if live in ("bert", "vit", "gpt2"):
        hf_folders(run.work / "models", quick=run.args.quick, seed=1, only=(live,))
    else:  # a factory model: another seed
        zoo = yaml.safe_load((run.work / "zoo.yaml").read_text())
        for entry in zoo["models"]:
            if entry["name"] == live:
                entry["seed"] = entry.get("seed", 0) + 1
        (run.work / "zoo.yaml").write_text(yaml.safe_dump(zoo, sort_keys=False))
    return step_zoo(run, live)


def step_export(run: Run) -> dict:
    repo = run.work / "repo"
    run.kiln(
        "serve", "triton", "export", *MODELS, "--target", run.args.target, "--repository", str(repo), "--json"
    )
    kinds = {}
    for name in MODELS:
        config = (served(run, name)[0] / "config.pbtxt").read_text()
        kinds[name] = re.findall(r"kind:\s*(KIND_\w+)", config)
    want = "KIND_GPU" if run.args.device == "cuda" else "KIND_CPU"
    if any(want not in k for k in kinds.values()):
        raise StepFailed(f"instance kinds {kinds}, expected {want} for every model")
    return {"instance_kinds": kinds}


def step_serve(run: Run) -> dict:
    """``kiln serve triton run`` in the background with the public key; ready when it says so."""
    run.ports = {"http": free_port(), "grpc": free_port()}
    log = run.work / "logs" / "tritonserver.log"
    started = time.monotonic()
    run.server = subprocess.Popen(
        [sys.executable, "-m", "flows.cli", "serve", "triton", "run", "--repository", str(run.work / "repo"),
         "--http-port", str(run.ports["http"]), "--grpc-port", str(run.ports["grpc"])],
        cwd=run.work, env=run.env(), stdout=open(log, "wb"), stderr=subprocess.STDOUT,  # noqa: SIM115
        start_new_session=True,
    )  # fmt: skip
    deadline = started + 300
    while time.monotonic() < deadline:
        text = log.read_text(errors="replace")
        if f"serving {run.work / 'repo'}" in text:
            break
        if run.server.poll() is not None:
            raise StepFailed(f"kiln serve triton run exited {run.server.returncode}:\n{text[-4000:]}")
        time.sleep(0.2)
    else:
        raise StepFailed(f"tritonserver not ready after 300 s:\n{log.read_text(errors='replace')[-4000:]}")
    ready = time.monotonic() - started
    text = log.read_text(errors="replace")
    stubs = stub_lines(text)
    untrusted = [m for m, s in stubs.items() if "engine code trusted" not in s["note"]]
    if untrusted:
        raise StepFailed(f"served untrusted: {untrusted}: {[stubs[m]['note'] for m in untrusted]}")
    return {
        "server_start_to_ready_s": round(ready, 2),
        "stubs": stubs,
        "target": "a GPT-2-class version ready within 8 s of server start, signed",
    }


def stub_lines(text: str) -> dict:
    """Each ``kiln: MODEL version N ready in X s (...); engine code ...`` line of the server's log."""
    found = {}
    for m in re.finditer(
        r"kiln: (\S+) version (\S+) ready in ([0-9.]+) s \(torch ([0-9.]+) s, verify and load ([0-9.]+) s, "
        r"warm-up ([0-9.]+) s[^)]*\)\)?;? ?(.*)",
        text,
    ):
        found[f"{m[1]}/{m[2]}"] = {
            "ready_s": float(m[3]), "torch_s": float(m[4]), "verify_and_load_s": float(m[5]),
            "warm_up_s": float(m[6]), "note": m[7].strip().strip('"'),
        }  # fmt: skip
    return found


def served(run: Run, name: str) -> tuple[Path, dict]:
    """The Triton model folder of ``name`` and the kiln.json of the version its config serves."""
    from serving.triton.repository import triton_model_name

    folder = run.work / "repo" / triton_model_name(name)
    versions = sorted((p for p in folder.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    record = json.loads((versions[-1] / "kiln.json").read_text())
    return folder, record


def model_inputs(run: Run, name: str, record: dict) -> dict[str, np.ndarray]:
    """Inputs at a middle shape of the served signature, integers inside the recorded ranges."""
    import compiler

    folder, _ = served(run, name)
    manifest = compiler.read_manifest(next(folder.glob("*/package")))
    rng = np.random.default_rng(0)
    feeds = {}
    for spec in manifest.input_specs:
        bounds = zip(spec.min_shape, spec.max_shape, strict=True)
        shape = [max(lo, min(hi, 4 if axis == 0 else 16)) for axis, (lo, hi) in enumerate(bounds)]
        dtype = np.dtype(spec.dtype.replace("bfloat16", "float32"))
        if dtype.kind == "f":
            feeds[spec.name] = rng.standard_normal(shape).astype(dtype)
        elif dtype.kind == "b":
            feeds[spec.name] = np.ones(shape, dtype)
        else:
            lo, hi = spec.value_range or (0, 1)
            if spec.name == "attention_mask":
                lo = hi = 1
            feeds[spec.name] = rng.integers(int(lo), int(hi) + 1, shape).astype(dtype)
    return feeds


def step_tritonclient(run: Run) -> dict:
    """Each model through tritonclient's gRPC client vs ``compiler.load`` of the package it serves."""
    import torch
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import np_to_triton_dtype

    import compiler

    client = grpcclient.InferenceServerClient(f"127.0.0.1:{run.ports['grpc']}")
    out = {}
    for name in MODELS:
        folder, record = served(run, name)
        feeds = model_inputs(run, name, record)
        inputs = []
        for key, value in feeds.items():
            item = grpcclient.InferInput(key, list(value.shape), np_to_triton_dtype(value.dtype))
            item.set_data_from_numpy(value)
            inputs.append(item)
        started = time.perf_counter()
        answer = client.infer(folder.name, inputs)
        infer_ms = (time.perf_counter() - started) * 1000
        version = answer.get_response().model_version
        module = compiler.load(
            folder / version / "package", device=device_of(run), allowed_modules=["zoo.models"]
        )
        with torch.inference_mode():
            flat = module.run_flat([torch.from_numpy(v).to(device_of(run)) for v in feeds.values()])
        worst = 0.0
        for sig, local in zip(record["outputs"], flat, strict=True):
            remote = torch.from_numpy(answer.as_numpy(sig["name"]).copy())
            local = local.detach().float().cpu()
            worst = max(worst, float((remote.float() - local).norm() / local.norm().clamp_min(1e-12)))
        out[name] = {"version": version, "rel_l2_vs_load": worst, "first_infer_ms": round(infer_ms, 2)}
        print(f"  {name}: Triton v{version} vs compiler.load rel L2 {worst:.2e}")
        if worst > 1e-3:
            raise StepFailed(
                f"{name}: tritonclient's answer differs from compiler.load's (rel L2 {worst:.3g})"
            )
    return out


def device_of(run: Run) -> str:
    return "cuda:0" if run.args.device == "cuda" else "cpu"


class Load:
    """``CLIENTS`` clients on the live model (one request at a time each, keep-alive HTTP), in a thread:
    answers counted by the version that gave them, failures kept."""

    def __init__(self, run: Run, name: str):
        folder, record = served(run, name)
        body, headers = v2_request(model_inputs(run, name, record))
        self.url = f"http://127.0.0.1:{run.ports['http']}/v2/models/{folder.name}/infer"
        self.body, self.headers = body, headers
        self.seen: dict[str, int] = {}
        self.first: dict[str, float] = {}
        self.failures: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    async def _one(self) -> None:
        conn = Connection(self.url, self.body, self.headers)
        while not self.stop.is_set():
            try:
                version = json.loads(await conn.post())["model_version"]
            except Exception as exc:
                version = "failed"
                if len(self.failures) < 5:
                    self.failures.append(f"{type(exc).__name__}: {str(exc)[:200]}")
                conn.close()
            self.seen[version] = self.seen.get(version, 0) + 1
            self.first.setdefault(version, time.monotonic())
        conn.close()

    async def _main(self) -> None:
        await asyncio.gather(*(self._one() for _ in range(CLIENTS)))

    def __enter__(self) -> Load:
        self.thread.start()
        time.sleep(1.0)
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(1.0)
        self.stop.set()
        self.thread.join(timeout=60)


def step_release_live(run: Run) -> dict:
    return _live(run, "release", LIVE[0], "--zoo", "zoo.yaml", "--max-latency-ratio", "3", "--runs", "10")


def step_rollback(run: Run) -> dict:
    return _live(run, "rollback", LIVE[0])


def _live(run: Run, command: str, name: str, *extra: str) -> dict:
    before = next(iter(served_versions(run, name)), None)
    log = run.work / "logs" / "tritonserver.log"
    offset = len(log.read_text(errors="replace"))
    url = f"http://127.0.0.1:{run.ports['http']}"
    with Load(run, name) as load:
        started = time.monotonic()
        text = run.kiln(command, name, "--target", run.args.target, "--triton", url, "--repository",
                        str(run.work / "repo"), "--triton-timeout", "120", *extra)  # fmt: skip
        returned = time.monotonic() - started
    new = max(load.first, key=lambda v: load.first[v] if v != "failed" else -1)
    result = {
        "clients": CLIENTS,
        "answers_by_version": load.seen,
        "failed_requests": load.seen.get("failed", 0),
        "failures": load.failures,
        "command_s": round(returned, 2),
        "version_before": before,
        "version_after": new,
        # from the command's start (a release re-validates first: its gate's seconds are in here)
        "call_to_new_version_s": round(load.first[new] - started, 2) if new in load.first else None,
        "stubs": stub_lines(log.read_text(errors="replace")[offset:]),
        "output_tail": text[-1500:],
    }
    if result["failed_requests"]:
        raise StepFailed(
            f"kiln {command} under load: {result['failed_requests']} failed requests: {load.failures}"
        )
    if new == before or new == "failed":
        raise StepFailed(f"kiln {command}: the server still answers from version {before}: {load.seen}")
    return result


def served_versions(run: Run, name: str) -> list[str]:
    folder, _ = served(run, name)
    config = (folder / "config.pbtxt").read_text()
    return re.findall(r"versions:\s*\[?\s*(\d+)", config)


def _json_tail(text: str):
    start = text.find("{")
    with contextlib.suppress(ValueError):
        return json.loads(text[start:]) if start >= 0 else text[-800:]
    return text[-800:]


def stop_server(run: Run) -> None:
    if run.server is not None and run.server.poll() is None:
        os.killpg(run.server.pid, signal.SIGTERM)
        try:
            run.server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(run.server.pid, signal.SIGKILL)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true", help="tiny models (a CPU check of the script)")
    parser.add_argument(
        "--target", default=None, help="the registry target the CLI is given (default: cuda / cpu)"
    )
    parser.add_argument("--work", default="/tmp/kiln-e2e", help="the work folder (kept: steps can resume)")
    parser.add_argument(
        "--out", default=None, help="results JSON (default: benchmarks/results/gpu_e2e_h100.json on cuda)"
    )
    parser.add_argument(
        "--steps", default=",".join(STEPS), help=f"comma-separated, in order: {','.join(STEPS)}"
    )
    parser.add_argument("--fresh", action="store_true", help="empty the work folder first")
    parser.add_argument("--models", default=",".join(MODELS), help="a subset of the zoo's models")
    parser.add_argument("--backend", choices=("onnxruntime", "inductor"), default="onnxruntime",
                        help="--device cpu: the fp32 entries' backend (inductor: AOT packages)")  # fmt: skip
    parser.add_argument("--live", default=LIVE[0], help="the model released and rolled back under load")
    args = parser.parse_args()
    chosen = [m.strip() for m in args.models.split(",") if m.strip()]
    if not chosen or set(chosen) - set(MODELS) or args.live not in chosen:
        parser.error(f"--models: a subset of {MODELS}, holding --live ({args.live})")
    MODELS[:] = chosen
    LIVE[:] = [args.live]
    args.target = args.target or args.device
    if args.out is None and args.device == "cuda":
        args.out = str(ROOT / "benchmarks" / "results" / "gpu_e2e_h100.json")
    steps = [s.strip() for s in args.steps.split(",") if s.strip()]
    unknown = [s for s in steps if s not in STEPS]
    if unknown:
        parser.error(f"--steps: unknown {unknown}; choose from {', '.join(STEPS)}")
    if any(s in steps for s in ("tritonclient", "release_live", "rollback")) and "serve" not in steps:
        parser.error("--steps: tritonclient, release_live and rollback need serve in the same run")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device visible: run with --device cpu --quick for the CPU check", file=sys.stderr)
            return 2
    if args.fresh:
        shutil.rmtree(args.work, ignore_errors=True)
    run = Run(args)
    functions = {name: globals()[f"step_{name}"] for name in STEPS}
    code = 0
    try:
        for name in steps:
            print(f"[{name}]", flush=True)
            started = time.perf_counter()
            try:
                detail = functions[name](run)
                record = {"ok": True, "seconds": round(time.perf_counter() - started, 2), "detail": detail}
            except (StepFailed, subprocess.TimeoutExpired) as exc:
                record = {
                    "ok": False,
                    "seconds": round(time.perf_counter() - started, 2),
                    "error": str(exc)[-6000:],
                }
                code = 1
            run.results["steps"][name] = record
            run.save()
            print(f"[{name}] {'ok' if record['ok'] else 'FAILED'} in {record['seconds']} s", flush=True)
            if not record["ok"]:
                print(record["error"], file=sys.stderr)
                break
    finally:
        stop_server(run)
    rows = [[n, r["ok"], r["seconds"]] for n, r in run.results["steps"].items()]
    from benchmarks._common import print_table

    print_table(f"gpu_e2e ({run.results['machine'].get('gpu') or run.results['machine'].get('cpu')})",
                ["step", "ok", "s"], rows)  # fmt: skip
    print(f"results: {args.out or run.state_file}")
    return code


if __name__ == "__main__":
    sys.exit(main())
