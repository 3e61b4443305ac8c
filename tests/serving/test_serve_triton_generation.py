"""Serving a generation version on the real Triton Inference Server (issue 44), on the CPU.

A tiny Llama-style decoder compiled into its prefill and decode programs, packaged, recorded in an
embedded registry and made champion; ``kiln serve triton export`` writes the repository and ``kiln
serve triton run`` serves it, both through the CLI in processes of their own. Every answer is held to
``compiler.load(package).generate(...)`` with the same arguments: greedy over HTTP on a left-padded
batch, sampling over gRPC, the defaults on a one-token prompt, and each limit refused by name while
the server keeps answering. The same package registered under a second name is exported with
``--stream-tokens`` into the same repository and streamed token by token to a gRPC streaming client.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import compiler
from tests.fixtures import preloaded
from tests.fixtures.generation import compile_generation
from tests.fixtures.triton_server import infer_generation, kiln_triton, triton_inputs
from zoo.models import tiny_llama_lm

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # a decoder compiled and served by Triton
MODEL = "llama-gen"
STREAMED = "llama-gen-stream"  # the same package, exported with --stream-tokens
LIMITS = {"max_batch": 4, "max_cache_len": 32, "prompt_min": 1, "prompt_max": 12}


def _kiln(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return preloaded.run(  # a process of its own, forked from the preloaded server
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The compiled package, recorded as version 1 (champion) of kiln.llama-gen.cpu."""
    from registry import config
    from registry.models import CHAMPION, set_alias
    from registry.tracking import record_package

    root = tmp_path_factory.mktemp("triton-gen")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    package = compile_generation(tiny_llama_lm(seed=5, hidden=32).model, root / f"{MODEL}.kiln", **LIMITS)
    with contextlib.chdir(root):  # the embedded store keeps artifacts under the working folder
        for name in (MODEL, STREAMED):
            assert record_package(package, name, {"name": name}, tracking_uri=uri).version == "1"
            set_alias(config.client(uri), f"kiln.{name}.cpu", CHAMPION, "1")
    return {"root": root, "uri": uri, "package": package, "loaded": compiler.load(package)}


@pytest.fixture(scope="module")
def repository(store: dict) -> Path:
    repo = store["root"] / "repository"
    done = _kiln(
        ["serve", "triton", "export", MODEL, "--repository", str(repo), "--tracking-uri", store["uri"]],
        store["root"],
    )
    assert done.returncode == 0, done.stdout + done.stderr
    streamed = ["serve", "triton", "export", STREAMED, "--stream-tokens", "--repository", str(repo)]
    done = _kiln([*streamed, "--tracking-uri", store["uri"]], store["root"])
    assert done.returncode == 0, done.stdout + done.stderr
    return repo


@pytest.fixture(scope="module")
def server(store: dict, repository: Path):
    """``kiln serve triton run`` in its own process group, as an operator runs it."""
    with kiln_triton(store["root"], repository) as run:
        yield {"http": run.http, "grpc": run.grpc}


def _infer(protocol: str, url: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return infer_generation(protocol, url, MODEL, feeds)


def _padded_batch() -> tuple[np.ndarray, np.ndarray]:
    ids = np.random.default_rng(1).integers(3, 512, (3, 9)).astype(np.int64)
    mask = np.ones_like(ids)
    mask[1, :4], mask[2, :8] = 0, 0  # left padding: 5 and 1 real tokens
    return np.where(mask == 0, 0, ids), mask


def _generate(store: dict, ids: np.ndarray, mask: np.ndarray | None = None, **kw) -> torch.Tensor:
    loaded = store["loaded"]
    with torch.no_grad():
        return loaded.generate(torch.from_numpy(ids), None if mask is None else torch.from_numpy(mask), **kw)


def test_export_writes_the_generate_signature(repository: Path) -> None:
    config = (repository / MODEL / "config.pbtxt").read_text()
    served = json.loads((repository / MODEL / "1" / "kiln.json").read_text())
    assert served["method"] == "generate"
    assert "max_batch_size: 0" in config and "dynamic_batching" not in config  # one generate per request
    assert '{ name: "input_ids" data_type: TYPE_INT64 dims: [ -1, -1 ] }' in config
    assert '{ name: "max_new_tokens" data_type: TYPE_INT64 dims: [ 1 ] optional: true }' in config
    assert '{ name: "do_sample" data_type: TYPE_BOOL dims: [ 1 ] optional: true }' in config
    assert [o["name"] for o in served["outputs"]] == ["output_ids", "generated_ids"]
    assert "model_transaction_policy" not in config  # one response per request, unless asked
    streamed = (repository / STREAMED / "config.pbtxt").read_text()
    assert "model_transaction_policy { decoupled: true }" in streamed
    assert json.loads((repository / STREAMED / "kiln-serving.json").read_text())["stream"] is True


def test_greedy_padded_batch_over_http_equals_generate(store: dict, server: dict) -> None:
    ids, mask = _padded_batch()
    feeds = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": np.array([10], dtype=np.int64)}
    got = _infer("http", server["http"], feeds)
    want = _generate(store, ids, mask, max_new_tokens=10)
    assert got["output_ids"].tolist() == want.tolist()
    assert got["generated_ids"].tolist() == want[:, ids.shape[1] :].tolist()
    assert got["generated_ids"].shape[1] >= 1


def test_sampling_over_grpc_equals_generate_with_the_same_seed(store: dict, server: dict) -> None:
    ids, mask = _padded_batch()
    params = {"temperature": 0.8, "top_k": 40, "top_p": 0.9, "seed": 7}
    feeds = {
        "input_ids": ids,
        "attention_mask": mask,
        "max_new_tokens": np.array([12], dtype=np.int64),
        "do_sample": np.array([True]),
        "temperature": np.array([params["temperature"]], dtype=np.float32),
        "top_k": np.array([params["top_k"]], dtype=np.int64),
        "top_p": np.array([params["top_p"]], dtype=np.float32),
        "seed": np.array([params["seed"]], dtype=np.int64),
        "eos_token_id": np.array([], dtype=np.int64),  # none: every row runs to max_new_tokens
    }
    got = _infer("grpc", server["grpc"], feeds)
    want = _generate(
        store,
        ids,
        mask,
        max_new_tokens=12,
        do_sample=True,
        temperature=np.float32(0.8).item(),
        top_k=40,
        top_p=np.float32(0.9).item(),
        seed=7,
        eos_token_id=[],
    )
    assert got["output_ids"].tolist() == want.tolist()
    assert got["generated_ids"].shape == (3, 12)
    greedy = _generate(store, ids, mask, max_new_tokens=12, eos_token_id=[])
    assert want.tolist() != greedy.tolist()  # the parameters reached the sampler


def test_defaults_on_a_one_token_prompt(store: dict, server: dict) -> None:
    """A prompt shorter than the compiled minimum (left-padded by generate), every parameter left out:
    generate's defaults (16 new tokens, greedy, the model's eos and pad)."""
    ids = np.array([[17]], dtype=np.int64)
    got = _infer("http", server["http"], {"input_ids": ids})
    want = _generate(store, ids)
    assert got["output_ids"].tolist() == want.tolist()
    floor = store["loaded"].prompt_floor
    assert got["generated_ids"].tolist() == want[:, floor:].tolist()


@pytest.mark.parametrize(
    ("feeds", "message"),
    [
        ({"input_ids": np.ones((1, 13), np.int64)}, r"longer than the compiled range.*prompt_length\.max"),
        (
            {"input_ids": np.ones((1, 8), np.int64), "max_new_tokens": np.array([30], np.int64)},
            r"the cache holds 32.*generation\.max_cache_len",
        ),
        ({"input_ids": np.ones((5, 4), np.int64)}, r"over max_batch 4.*generation\.max_batch"),
        ({"input_ids": np.full((1, 4), 512, np.int64)}, r"token id 512, outside the vocabulary 0\.\.511"),
        (
            {
                "input_ids": np.ones((1, 4), np.int64),
                "do_sample": np.array([True]),
                "top_p": np.array([1.5], np.float32),
            },
            r"top_p 1\.5 must be in \(0, 1\]",
        ),
    ],
    ids=["prompt-too-long", "past-the-cache", "batch-over-max", "token-past-vocab", "bad-top-p"],
)
def test_limits_are_refused_by_name_and_the_server_keeps_answering(
    store: dict, server: dict, feeds: dict, message: str
) -> None:
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match=message) as refused:
        _infer("http", server["http"], feeds)
    assert refused.value.status() == "400"  # INVALID_ARG: the request's fault, not the server's
    ids = np.array([[5, 6, 7]], dtype=np.int64)
    got = _infer("http", server["http"], {"input_ids": ids, "max_new_tokens": np.array([3], np.int64)})
    assert got["output_ids"].tolist() == _generate(store, ids, max_new_tokens=3).tolist()


def _stream(url: str, feeds: dict[str, np.ndarray], timeout: float = 120.0) -> list[tuple[np.ndarray, bool]]:
    """Every response of one streamed request: (generated_ids, whether flagged final), until the final
    one; an error response raises it."""
    import queue

    import tritonclient.grpc as grpc

    inputs = triton_inputs(grpc, feeds)
    answers: queue.Queue = queue.Queue()
    got: list[tuple[np.ndarray, bool]] = []
    with grpc.InferenceServerClient(url) as client:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        try:
            client.async_stream_infer(STREAMED, inputs, enable_empty_final_response=True)
            while not (got and got[-1][1]):
                result, error = answers.get(timeout=timeout)
                if error is not None:
                    raise error
                final = result.get_response().parameters["triton_final_response"].bool_param
                got.append((result.as_numpy("generated_ids"), final))
        finally:
            client.stop_stream()
    return got


def test_streamed_tokens_over_grpc_equal_generate(store: dict, server: dict) -> None:
    """One response per generated token, in order, the last flagged final, the tokens those the
    unstreamed generate returns: a padded batch greedy, and one row sampled ending at its eos."""
    ids, mask = _padded_batch()
    feeds = {"input_ids": ids, "attention_mask": mask, "max_new_tokens": np.array([10], dtype=np.int64)}
    got = _stream(server["grpc"], feeds)
    want = _generate(store, ids, mask, max_new_tokens=10)[:, ids.shape[1] :]
    assert [final for _, final in got] == [False] * (len(got) - 1) + [True]
    assert all(tokens.shape == (3, 1) for tokens, _ in got)
    assert np.concatenate([tokens for tokens, _ in got], axis=1).tolist() == want.tolist()
    row = ids[:1, 4:]
    sampled = _generate(store, row, max_new_tokens=12, do_sample=True, seed=3, eos_token_id=[])[0, 5:]
    stop = int(sampled[4])  # the fifth sampled token as eos: the stream ends there
    feeds = {
        "input_ids": row,
        "max_new_tokens": np.array([12], dtype=np.int64),
        "do_sample": np.array([True]),
        "seed": np.array([3], dtype=np.int64),
        "eos_token_id": np.array([stop], dtype=np.int64),
    }
    got = _stream(server["grpc"], feeds)
    want = _generate(store, row, max_new_tokens=12, do_sample=True, seed=3, eos_token_id=[stop])[0, 5:]
    assert [int(tokens[0, 0]) for tokens, _ in got] == want.tolist()
    assert len(got) == sampled.tolist().index(stop) + 1 and got[-1][1]


def test_a_streamed_request_over_a_limit_gets_one_final_error(server: dict) -> None:
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException, match=r"longer than the compiled range.*prompt_length\.max"):
        _stream(server["grpc"], {"input_ids": np.ones((1, 13), np.int64)})
    ids = np.array([[5, 6, 7]], dtype=np.int64)
    got = _stream(server["grpc"], {"input_ids": ids, "max_new_tokens": np.array([2], np.int64)})
    assert len(got) == 2 and got[-1][1]  # the stream still answers


def test_stream_tokens_refuses_a_forward_version_by_name() -> None:
    from serving.triton.config import ServedModel, TensorSig, render_config
    from serving.triton.errors import TritonConfigError

    forward = ServedModel(
        "bert",
        "kiln.bert.cpu",
        "1",
        "a" * 64,
        "cpu",
        (TensorSig("x", "float32", (-1, 4)),),
        (TensorSig("y", "float32", (-1, 2)),),
    )
    assert "decoupled" not in render_config(forward)
    with pytest.raises(TritonConfigError, match=r"not a generation version.*--stream-tokens"):
        render_config(forward, stream=True)
