"""Serving a CUDA generation version on the real Triton Inference Server (issue 44), on the GPU.

A tiny Llama-style decoder compiled on CUDA in fp16 by Inductor (the default package: AOTInductor
engines, each one's package checked in a fresh process that imports the ops' modules first; its decode
program runs ``kiln::decode_attention``), recorded in an embedded registry under
its CUDA engine target and made champion; ``kiln serve triton export`` writes the repository and
``kiln serve triton run`` serves it (KIND_GPU), both through the CLI in processes of their own. Greedy
answers over gRPC on a left-padded batch equal ``compiler.load(package).generate`` on the GPU, and a
limit is refused by name while the server keeps answering. Skips elsewhere with the reason.

    python3 -m pytest -q tests/gpu/test_serve_generation_gpu.py
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _triton_missing() -> bool:
    from serving.triton.errors import TritonNotFoundError
    from serving.triton.server import find_tritonserver

    try:
        find_tritonserver()
    except TritonNotFoundError:
        return True
    return False


CUDA = torch.cuda.is_available()
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU"),
    pytest.mark.skipif(_triton_missing(), reason="needs Triton Inference Server (the nvidia-pytriton wheel)"),
]
MODEL = "llama-gen"
LIMITS = {"max_batch": 4, "max_cache_len": 32, "prompt_min": 1, "prompt_max": 12}


def _kiln(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-m", "flows.cli", *args]
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The CUDA package, recorded as version 1 (champion) of kiln.llama-gen.<its engine target>."""
    import compiler
    from registry import config
    from registry.models import CHAMPION, set_alias
    from registry.tracking import record_package
    from tests.fixtures.generation import compile_generation
    from zoo.models import tiny_llama_lm

    root = tmp_path_factory.mktemp("triton-gen-cuda")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    lm = tiny_llama_lm(seed=5, hidden=32).model.cuda().half().eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        package = compile_generation(
            lm, root / f"{MODEL}.kiln", backend="inductor", device="cuda", precision="fp16", **LIMITS
        )
    # Each engine has its AOTInductor package: the decode program's fresh-process check imports the
    # op's module first (it failed with "Could not find schema for kiln::decode_attention" before).
    left_out = [str(w.message) for w in caught if "no AOTInductor package" in str(w.message)]
    assert not left_out, left_out
    with contextlib.chdir(root):  # the embedded store keeps artifacts under the working folder
        done = record_package(package, MODEL, {"name": MODEL}, tracking_uri=uri)
        assert done.version == "1" and done.registered_model.startswith(f"kiln.{MODEL}.")
        assert done.registered_model != f"kiln.{MODEL}.cpu", done.registered_model
        set_alias(config.client(uri), done.registered_model, CHAMPION, "1")
    loaded = compiler.load(package, trust_engine_code=True)  # the package this test wrote
    assert "compiler.generation.attention" in sys.modules  # the decode program runs kiln's op
    return {"root": root, "uri": uri, "loaded": loaded}


@pytest.fixture(scope="module")
def server(store: dict):
    from tests.fixtures.triton_server import kiln_triton

    repo = store["root"] / "repository"
    done = _kiln(
        ["serve", "triton", "export", MODEL, "--repository", str(repo), "--tracking-uri", store["uri"]],
        store["root"],
    )
    assert done.returncode == 0, done.stdout + done.stderr
    config = (repo / MODEL / "config.pbtxt").read_text()
    assert "KIND_GPU" in config, config
    assert json.loads((repo / MODEL / "1" / "kiln.json").read_text())["method"] == "generate"
    with kiln_triton(store["root"], repo, start_timeout=600) as run:
        yield {"grpc": run.grpc}


def _infer(url: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    from tests.fixtures.triton_server import infer_generation

    return infer_generation("grpc", url, MODEL, feeds)  # the GPU host's wheels: grpc (http needs gevent)


def test_a_cuda_generation_version_serves_generate_over_grpc(store: dict, server: dict) -> None:
    ids = np.random.default_rng(1).integers(3, 512, (3, 9)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, :4], mask[2, :8] = 0, 0  # left padding: 5 and 1 real tokens
    ids = np.where(mask == 0, 0, ids)
    feeds = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": np.array([10], dtype=np.int64)}
    got = _infer(server["grpc"], feeds)
    with torch.no_grad():
        want = store["loaded"].generate(
            torch.from_numpy(ids).cuda(), torch.from_numpy(mask).cuda(), max_new_tokens=10
        )
    assert got["output_ids"].tolist() == want.cpu().tolist()
    assert got["generated_ids"].tolist() == want[:, ids.shape[1] :].cpu().tolist()

    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match=r"over max_batch 4.*generation\.max_batch"):
        _infer(server["grpc"], {"input_ids": np.ones((5, 4), np.int64)})
    again = _infer(server["grpc"], feeds)  # still answering, the same tokens
    assert again["output_ids"].tolist() == got["output_ids"].tolist()
