"""Engine targets a person can type, and ``kiln release`` finding its zoo entry (issues 40 and 41),
through the ``kiln`` command in fresh processes on a real MLflow store in a temporary directory.

- ``kiln zoo FILE`` compiles an ``hf:`` GPT-2 as ``feature-extraction`` (a decoder: its cache must stay
  off) beside the test MLP and an entry that fails asking for fp16 (its row says fp16), records FILE,
  and ``kiln release mlp`` with no ``--zoo`` rebuilds the original from FILE's entry.
- A CUDA package recorded on the GPU machine (``tests/fixtures/packages/mlp-cuda-inductor.kiln``,
  registered as ``kiln.mlp.cuda_sm_90`` here, on a host without a GPU) is what ``--target cuda`` finds
  on ``kiln report``, ``lookup``, ``rollback``, ``release`` and ``serve triton export``; ``kiln release``
  takes the target from the entry's ``devices: [cuda]``; a target that matches nothing lists the
  registered ones.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from tests.fixtures import preloaded
from tests.fixtures.prefect_server import PrefectServer

ROOT = Path(__file__).resolve().parents[2]
CUDA_PACKAGE = ROOT / "tests" / "fixtures" / "packages" / "mlp-cuda-inductor.kiln"
# The --target commands all talk to cuda_store's sqlite store first, in one environment, and none sets
# anything before importing MLflow (no quiet_prefect: that is zoo, compile, deploy, webhook): MLflow once.
SQLITE = preloaded.MLFLOW_SQLITE


def _kiln(
    cwd: Path,
    *args: str,
    timeout: float = 600,
    preload: tuple[str, ...] = (),
    server: PrefectServer | None = None,
) -> subprocess.CompletedProcess:
    """``kiln ARGS`` in ``cwd`` on the default MLflow store (``cwd/mlflow.db``); its flows report to
    ``server`` (the suite's Prefect server: a temporary one per command costs a start and a stop, and
    tests/flows/test_flows_faults.py covers those), else to no server; ``preload``: as preloaded.run's."""
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env.update(
        {"PYTHONPATH": str(ROOT), "COLUMNS": "200", "HF_HUB_OFFLINE": "1", **(server.env if server else {})}
    )
    return preloaded.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preload=preload,
    )


def _said(done: subprocess.CompletedProcess) -> str:
    """What a run printed (kiln's tables and errors go to stderr, --json results to stdout)."""
    return done.stdout + done.stderr


def _tiny_gpt2(folder: Path) -> None:
    import transformers as t

    config = t.GPT2Config(vocab_size=96, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    config.update({"bos_token_id": 0, "eos_token_id": 0})
    t.GPT2Model(config).save_pretrained(folder)


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory: pytest.TempPathFactory, prefect_server: PrefectServer) -> dict:
    root = tmp_path_factory.mktemp("zoo-then-release")
    _tiny_gpt2(root / "gpt2")
    shutil.copytree(root / "gpt2", root / "broken")
    (root / "broken" / "model.safetensors").write_bytes(b"not a safetensors file")
    settings = {"engine_cache": False, "validation": {"samples": 2, "warmup": 0, "runs": 2}}
    models = [
        {"name": "mlp", "factory": "zoo.models:mlp_with_fallback", "factory_kwargs": {"width": 16}},
        {"name": "gpt2", "source": "hf:./gpt2", "task": "feature-extraction"},
        # Its weights fail to load (the identity hashes them, so the run starts): its row must still say
        # what was asked.
        {"name": "broken", "source": "hf:./broken", "task": "feature-extraction", "precision": "fp16"},
    ]
    (root / "models.yaml").write_text(yaml.safe_dump({"settings": settings, "models": models}))
    done = _kiln(root, "zoo", "models.yaml", "--out", "out", server=prefect_server)
    return {
        "root": root,
        "server": prefect_server,
        "done": done,
        "summary": json.loads((root / "out" / "summary.json").read_text()),
    }


@pytest.mark.slow
def test_zoo_compiles_an_hf_decoder_and_a_failed_row_keeps_its_precision(zoo_run: dict) -> None:
    done, summary = zoo_run["done"], zoo_run["summary"]
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]  # one model failed
    rows = {m["name"]: m for m in summary["models"]}
    assert rows["gpt2"]["status"] == "ok", rows["gpt2"]["error"]
    assert rows["gpt2"]["max_rel_l2"] < 1e-4
    assert rows["mlp"]["status"] == "ok", rows["mlp"]["error"]
    assert rows["broken"]["status"] == "failed" and rows["broken"]["precision"] == "fp16"
    table_row = next(
        line for line in _said(done).splitlines() if re.match(r"\s*broken\s+cpu\s+failed\s", line)
    )
    assert "fp16" in table_row and "fp32" not in table_row, table_row
    record = json.loads((zoo_run["root"] / ".kiln" / "last-zoo.json").read_text())
    assert record["zoo_file"] == str(zoo_run["root"] / "models.yaml")


@pytest.mark.slow
def test_release_without_zoo_uses_the_last_zoo_runs_file(zoo_run: dict) -> None:
    root = zoo_run["root"]
    done = _kiln(
        root, "release", "mlp", "--max-latency-ratio", "5", "--runs", "5", "--json", server=zoo_run["server"]
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    outcome = json.loads(done.stdout[done.stdout.index("{") :])
    assert outcome["promoted"] and outcome["registered_model"] == "kiln.mlp.cpu"  # the entry's devices: [cpu]


@pytest.mark.slow
def test_release_without_a_zoo_file_to_use_names_zoo(zoo_run: dict, tmp_path: Path) -> None:
    # No kiln zoo ran here: no guess (deploy/zoo.yaml was the old default), a typed error naming --zoo.
    store = zoo_run["root"] / "mlflow.db"
    shutil.copy(store, tmp_path / "mlflow.db")
    done = _kiln(tmp_path, "release", "mlp", timeout=300)
    assert done.returncode == 2 and "--zoo" in _said(done), _said(done)
    assert "Traceback" not in _said(done)
    # A recorded zoo file that is gone since: the same, naming the file.
    (tmp_path / ".kiln").mkdir(exist_ok=True)
    (tmp_path / ".kiln" / "last-zoo.json").write_text(json.dumps({"zoo_file": str(tmp_path / "gone.yaml")}))
    done = _kiln(tmp_path, "release", "mlp", timeout=300)
    assert done.returncode == 2 and "gone.yaml" in _said(done) and "--zoo" in _said(done), _said(done)
    assert "Traceback" not in _said(done)


# ---------------------------------------------------------------- --target cuda on a host without a GPU


@pytest.fixture(scope="module")
def cuda_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """kiln.mlp.cuda_sm_90 version 1 (the GPU machine's package) as the champion; kiln.two has two CUDA
    targets (cuda_sm_80 and cuda_sm_90, registered models without versions)."""
    import mlflow

    from registry.tracking import record_package

    root = tmp_path_factory.mktemp("cuda-store")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    recorded = record_package(CUDA_PACKAGE, "mlp", None, None, tracking_uri=uri)
    assert recorded.registered_model == "kiln.mlp.cuda_sm_90"
    client = mlflow.MlflowClient(uri)
    client.set_registered_model_alias(recorded.registered_model, "champion", recorded.version)
    for name in ("kiln.two.cuda_sm_80", "kiln.two.cuda_sm_90"):
        client.create_registered_model(name)
    zoo = {"models": [{"name": "mlp", "factory": "zoo.models:mlp_with_fallback", "devices": ["cuda"]}]}
    (root / "zoo.yaml").write_text(yaml.safe_dump(zoo))
    return root


@pytest.fixture
def kiln(cuda_store: Path, prefect_server: PrefectServer) -> Callable[..., subprocess.CompletedProcess]:
    """``kiln ARGS`` in cuda_store, every command in one environment (one preloaded server for them)."""
    return functools.partial(_kiln, cuda_store, preload=SQLITE, server=prefect_server)


def test_target_cuda_finds_the_single_cuda_version_on_every_command(cuda_store: Path, kiln) -> None:
    # kiln report: downloads and verifies, never loads (the package needs a GPU to run).
    done = kiln("report", "mlp", "--target", "cuda", "--out", "mlp.html")
    assert done.returncode == 0, _said(done)
    assert "kiln.mlp.cuda_sm_90 version 1" in (cuda_store / "mlp.html").read_text()
    # kiln release: the entry's devices: [cuda] is the target (version 1 is the champion already).
    done = kiln("release", "mlp", "--version", "1", "--zoo", "zoo.yaml")
    assert done.returncode == 1, _said(done)
    said = _said(done)
    assert "kiln.mlp.cuda_sm_90 version 1 not promoted" in said and "already the champion" in said
    # kiln rollback reaches the same registered model.
    done = kiln("rollback", "mlp", "--target", "cuda")
    assert done.returncode == 2 and "kiln.mlp.cuda_sm_90 has no 'previous' alias" in _said(done), _said(done)
    # kiln lookup: found, then refused at load on this host (no CUDA), not "nothing registered".
    done = kiln("lookup", "mlp", "--target", "cuda", "--shape", "4,16")
    assert done.returncode == 2 and "needs a CUDA GPU" in _said(done), _said(done)


def test_a_target_matching_nothing_lists_the_registered_targets(kiln) -> None:
    lookup = ("lookup", "mlp", "--shape", "4,16", "--json")
    done = kiln(*lookup, "--target", "cpu")
    assert done.returncode == 1, _said(done)
    error = json.loads(done.stdout[: done.stdout.rindex("}") + 1])["error"]
    assert "'cpu' matches nothing registered for 'mlp'" in error and "registered targets: cuda_sm_90" in error
    # No --target: the model's one target (cuda_sm_90), which this CPU-only host cannot load, and says so.
    done = kiln(*lookup)
    assert done.returncode == 2 and "needs a CUDA GPU" in _said(done), _said(done)
    # Two CUDA targets and no GPU to choose by: both listed, and how to name one.
    done = kiln("rollback", "two", "--target", "cuda")
    assert done.returncode == 2, _said(done)
    assert "registered targets: cuda_sm_80, cuda_sm_90" in _said(done)
    assert "--target cuda:sm_80" in _said(done)
    # kiln serve triton export: the same resolution (cuda_sm_80 has no champion to export).
    export = ("serve", "triton", "export", "two", "--repository", "repo")
    done = kiln(*export, "--target", "cuda")
    assert done.returncode == 1 and "registered targets: cuda_sm_80, cuda_sm_90" in _said(done), _said(done)
    done = kiln(*export, "--target", "cuda:sm_80")
    assert done.returncode == 1 and "kiln.two.cuda_sm_80 has no 'champion' alias" in _said(done), _said(done)
    done = kiln("release", "nope", "--zoo", "zoo.yaml", "--target", "cuda")
    assert done.returncode == 2 and "nothing is registered for 'nope'" in _said(done), _said(done)
