"""Generation versions in the registry (issue 44), against a real MLflow server and Prefect server.

The zoo entry is a tiny Llama-style decoder (``task: text-generation``). Three versions are recorded:
two compiled from the entry's own model (other batch limits, so other packages) and one from a
differently seeded model, what a bad retrain gives. The logged model's signature says how to call it
(``generate``: token ids in, the settings as parameters, token ids out) and the MLflow model answers
as ``generate`` does, in a fresh process; ``kiln report`` of a version shows both programs. The first
two versions are promoted on token agreement and perplexity against the eager model, the second also
on decode speed against the first; the third is refused through the CLI in a process of its own, its
report naming every measure it failed.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import yaml

from compiler.errors import PackageJsonError
from registry.generation import speed_metrics
from registry.models import CHAMPION, PREVIOUS, TAG_REJECTED, get_aliases, registered_model_name
from tests.fixtures import preloaded
from tests.fixtures.generation import compile_generation
from zoo.models import tiny_llama_lm

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # two decoder versions compiled and recorded
MODEL = "llama-gen"
NAME = registered_model_name(MODEL, "cpu")
ENTRY = {
    "name": MODEL,
    "factory": "zoo.models:tiny_llama_lm",
    "factory_kwargs": {"hidden": 32},
    "task": "text-generation",
    "generation": {
        "max_batch": 2,
        "max_cache_len": 24,
        "prompt_length": {"min": 1, "max": 10},
        "validation": {"samples": 3, "max_new_tokens": 8},
    },
    "backend": "onnxruntime",
    "devices": ["cpu"],
}
LIMITS = {"max_cache_len": 24, "prompt_min": 1, "prompt_max": 10}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("release-gen") / "zoo.yaml"
    path.write_text(yaml.safe_dump({"models": [ENTRY]}))
    return path


@pytest.fixture(scope="module")
def versions(mlflow_server, zoo: Path) -> dict[str, str]:
    """good -> v1, good with another batch limit -> v2, another model's weights -> v3."""
    from registry.tracking import record_package
    from zoo.config import ZooEntry

    request = ZooEntry(**ENTRY).requests()[0]
    lm = request.load_model().model  # the entry's own model, as the release rebuilds it
    other = tiny_llama_lm(seed=9, hidden=32).model
    made = {}
    for key, model, batch in (("good", lm, 2), ("good-b3", lm, 3), ("retrained", other, 2)):
        path = compile_generation(model, zoo.parent / f"{key}.kiln", report=True, max_batch=batch, **LIMITS)
        made[key] = record_package(path, MODEL, request).version
    assert len(set(made.values())) == 3
    return made


def _fresh(*args: str) -> str:
    """``python ARGS`` in a process of its own; its output."""
    done = preloaded.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_the_logged_model_is_called_as_generate(mlflow_server, zoo: Path, versions: dict[str, str]) -> None:
    """Its signature names the token inputs, the settings (with defaults) and the output; the MLflow
    model, loaded in a fresh process, answers as ``compiler.load(...).generate`` with the same settings."""
    import mlflow
    import torch

    import compiler

    uri = f"models:/{NAME}/{versions['good']}"
    signature = mlflow.models.get_model_info(uri).signature
    assert [s.name for s in signature.inputs.inputs] == ["input_ids", "attention_mask"]
    assert [s.name for s in signature.outputs.inputs] == ["output_ids"]
    params = {p.name: p.default for p in signature.params.params}
    assert params["max_new_tokens"] == 16 and params["do_sample"] is False and params["eos_token_id"] == [2]
    ids = [[0, 0, 7, 8, 9], [4, 5, 6, 7, 8]]
    mask = [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    settings = {"max_new_tokens": 6, "do_sample": True, "temperature": 0.7, "top_k": 50, "seed": 3}
    script = (
        "import json, sys, numpy as np, mlflow\n"
        "model = mlflow.pyfunc.load_model(sys.argv[1])\n"
        "ids, mask, params = (json.loads(a) for a in sys.argv[2:5])\n"
        "out = model.predict({'input_ids': np.array(ids), 'attention_mask': np.array(mask)}, params=params)\n"
        "print(json.dumps(out.tolist()))\n"
    )
    got = json.loads(
        _fresh("-c", script, uri, json.dumps(ids), json.dumps(mask), json.dumps(settings)).splitlines()[-1]
    )
    loaded = compiler.load(zoo.parent / "good.kiln")
    want = loaded.generate(torch.tensor(ids), torch.tensor(mask), **{**settings, "top_p": None})
    assert got == want.tolist() and len(got[0]) == 5 + 6


def test_report_of_a_version_shows_both_programs_and_how_to_call_it(
    mlflow_server, zoo: Path, versions: dict[str, str]
) -> None:
    import re

    page_path = zoo.parent / "report.html"
    _fresh(
        "-m", "flows.cli",
        "report", MODEL, "--version", versions["good"], "--out", str(page_path),
    )  # fmt: skip
    page = page_path.read_text()
    headings = re.findall(r"<h2>(.*?)</h2>", page)
    assert headings[:3] == ["How to call it", "Generation", "Generated tokens"]
    assert "Prefill program" in headings and "Decode program" in headings
    assert headings.count("Partitioned graph") == 2  # each program's map
    assert "module.generate(input_ids" in page and "[batch 1..2, prompt 1..10]" in page
    ids = re.findall(r' id="([^"]+)"', page)
    assert len(ids) == len(set(ids)) and "decode-partitions" in ids
    assert "<th>token agreement</th><td>3 of 3 prompt batches" in page
    assert re.search(r"<td>decode tokens/s, batch 2</td><td>[0-9.]+</td><td>[0-9.]+</td>", page)


def test_release_gates_a_generation_version_on_tokens_perplexity_and_decode_speed(
    mlflow_server, prefect_api, zoo: Path, versions: dict[str, str]
) -> None:
    import mlflow

    from flows.release import release

    first = release(MODEL, version=versions["good"], zoo_path=str(zoo), max_latency_ratio=100.0, runs=5)
    assert first["promoted"], first["reasons"]
    assert first["report"]["accuracy"]["token_agreement"] == 1.0
    assert first["report"]["accuracy"]["perplexity_rel_error"] <= 1e-4
    assert first["report"]["latency"]["note"].startswith("no champion yet")

    second = release(MODEL, version=versions["good-b3"], zoo_path=str(zoo), max_latency_ratio=100.0, runs=5)
    assert second["promoted"], second["reasons"]
    speed = second["report"]["latency"]
    assert speed["measure"] == "decode_tokens_per_s" and speed["batches"] == [1, 2]
    assert (
        speed["candidate_decode_tokens_per_s_batch2"] > 0 and speed["champion_decode_tokens_per_s_batch1"] > 0
    )
    client = mlflow.MlflowClient(mlflow_server.uri)
    assert get_aliases(client, NAME) == {CHAMPION: versions["good-b3"], PREVIOUS: versions["good"]}
    stored = json.loads(client.get_model_version(NAME, versions["good-b3"]).tags["release_report"])
    assert stored["passed"] and stored["failed_measures"] == []


def test_a_worse_generation_version_is_refused_naming_each_measure(
    mlflow_server, prefect_api, zoo: Path, versions: dict[str, str]
) -> None:
    """Through the CLI in a fresh process; a latency limit no version meets (0.01x) also refuses it on
    decode speed, so all three measures are named."""
    import mlflow

    args = ["release", MODEL, "--version", versions["retrained"], "--zoo", str(zoo)]
    args += ["--max-latency-ratio", "0.01", "--runs", "5", "--json"]
    done = preloaded.run(
        [sys.executable, "-m", "flows.cli", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=900,
    )
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    outcome = json.loads(done.stdout[done.stdout.index("{") :])
    assert not outcome["promoted"]
    failed = outcome["report"]["failed_measures"]
    assert failed == ["generation.token_agreement", "generation.perplexity", "decode_tokens_per_s"]
    assert [r.split(":")[0] for r in outcome["reasons"]][:2] == failed[:2]
    assert all(any(r.startswith(m) for r in outcome["reasons"]) for m in failed)
    assert outcome["report"]["accuracy"]["token_agreement"] < 1.0
    client = mlflow.MlflowClient(mlflow_server.uri)
    rejected = json.loads(client.get_model_version(NAME, versions["retrained"]).tags[TAG_REJECTED])
    assert rejected[0].startswith("generation.token_agreement: greedy tokens differ")
    assert get_aliases(client, NAME)[CHAMPION] == versions["good-b3"]  # nothing moved


def test_speed_metrics_name_each_measure_of_each_side() -> None:
    """What a zoo compile measured (compiler.generation.validate.measure_speed) becomes the run's metrics:
    the compiled programs' under their own names, the eager ones' prefixed, the GPU's peak memory too."""
    speed = {
        "prompt_lengths": [8, 10],
        "batches": [1, 2],
        "compiled_ttft_ms_prompt8": 1.5,
        "eager_decode_tokens_per_s_batch2": 40.0,
        "compiled_peak_gpu_memory_bytes": 123456,
        "eager_peak_gpu_memory_bytes": 234567,
        "measured_at": "2026-11-28",
    }
    assert speed_metrics(speed) == {
        "ttft_ms.prompt8": 1.5,
        "eager_decode_tokens_per_s.batch2": 40.0,
        "peak_gpu_memory_bytes": 123456.0,
        "eager_peak_gpu_memory_bytes": 234567.0,
    }
    # a package rewritten after its compile (hashes recomputed): a typed error naming the measure
    for bad in ("12", True, float("inf"), 10**400, {"a": 1}):
        with pytest.raises(PackageJsonError, match=r"validation\.speed\.compiled_peak_gpu_memory_bytes"):
            speed_metrics({**speed, "compiled_peak_gpu_memory_bytes": bad}, "pkg/generation.json")
    with pytest.raises(PackageJsonError, match=r"validation\.speed is list"):
        speed_metrics([1, 2])
