"""A CUDA generation entry through the user's commands on the GPU (issue 44): `kiln zoo` compiles a
Llama-style decoder read from a ``save_pretrained`` folder (``source: hf:``, keyword inputs) at fp16 on
CUDA and records it, `kiln release` re-validates it (greedy tokens and perplexity; decode speed has no
champion to be compared with yet) and makes it champion, and `kiln lookup` finds it, each with no
--target and in a process of its own, as a scheduled recompile and the release pipeline run them. The
package read back in a fresh process generates on the GPU. Skips elsewhere with the reason.

    python3 -m pytest -q tests/gpu/test_zoo_release_generation_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from tests.fixtures.generation import cuda_generation_entry

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
MODEL = "llama-gen"
ENTRY = cuda_generation_entry(MODEL, "hf:./llama")


def _kiln(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "flows.cli", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from zoo.models import tiny_llama_lm

    root = tmp_path_factory.mktemp("zoo-gen-cuda")
    tiny_llama_lm(seed=7, hidden=64).model.eval().save_pretrained(root / "llama")
    settings = {"out_dir": "out", "workspace": "ws", "tracking": True, "engine_cache": "engines"}
    settings["validation"] = {"samples": 2, "warmup": 1, "runs": 3}
    (root / "zoo.yaml").write_text(yaml.safe_dump({"settings": settings, "models": [ENTRY]}))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}",
    }
    done = _kiln(["zoo", "zoo.yaml", "--out", "out", "--json"], root, env)
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return {"root": root, "env": env, "summary": json.loads((root / "out" / "summary.json").read_text())}


def test_the_zoo_records_a_cuda_version(zoo: dict) -> None:
    [row] = zoo["summary"]["models"]
    assert row["name"] == MODEL and row["device"] == "cuda" and row["status"] == "ok", row
    assert row["tracking"] and row["precision"].startswith("fp16"), row  # recorded in MLflow
    # Published as the engines take its weights: those only fp16 engines read, at fp16 (both programs).
    package = zoo["root"] / "out" / f"{MODEL}.kiln"
    for manifest in (package / "manifest.json", package / "decode" / "manifest.json"):
        reduced = json.loads(manifest.read_text())["plan"].get("reduced_weights", {})
        assert reduced and set(reduced.values()) == {"float16"}, manifest


def test_release_then_lookup_with_no_target_find_the_cuda_version(zoo: dict) -> None:
    root, env = zoo["root"], zoo["env"]
    released = _kiln(["release", MODEL, "--runs", "5", "--max-latency-ratio", "100", "--json"], root, env)
    assert released.returncode == 0, (released.stdout[-3000:], released.stderr[-3000:])
    outcome = json.loads(released.stdout[released.stdout.index("{") :])
    assert outcome["promoted"], outcome["reasons"]
    assert outcome["registered_model"].startswith(f"kiln.{MODEL}.cuda"), outcome["registered_model"]
    assert 0.0 <= outcome["report"]["accuracy"]["token_agreement"] <= 1.0  # fp16: measured, reported
    assert outcome["report"]["latency"]["note"].startswith("no champion yet"), outcome["report"]["latency"]
    found = _kiln(["lookup", MODEL, "--json"], root, env)
    assert found.returncode == 0, (found.stdout[-3000:], found.stderr[-3000:])
    looked = json.loads(found.stdout[found.stdout.index("{") :])
    assert looked["registered_model"] == outcome["registered_model"] and "champion" in looked["aliases"]
    assert looked["engine_target"].startswith("cuda"), looked


def test_the_package_read_back_generates_on_the_gpu(zoo: dict) -> None:
    code = textwrap.dedent(
        """
        import json, sys, torch, compiler
        m = compiler.load(sys.argv[1])
        ids = torch.randint(3, 100, (2, 5), device="cuda")
        out = m.generate(ids, max_new_tokens=6, eos_token_id=[])
        kept = bool(torch.equal(out[:, :5], ids))
        print(json.dumps({"shape": list(out.shape), "device": str(out.device), "prompt": kept}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(zoo["root"] / "out" / f"{MODEL}.kiln")],
        env=zoo["env"], capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    answer = json.loads(done.stdout.strip().splitlines()[-1])
    assert answer == {"shape": [2, 11], "device": "cuda:0", "prompt": True}, answer
