"""Every command works on every model the README compiles (issue 40).

``kiln zoo`` compiles deploy/zoo.yaml's models, as the README's first command does, plus one
keyword-input ``hf:`` model (a sentence-pair BERT written with save_pretrained), into a fresh folder's
MLflow store. Then tests/matrix/driver.py, in one fresh process, runs every per-model user command on
every model (lookup with and without --shape, report, debug compare, release, rollback, serve triton
export), serves them all with ``kiln serve triton run``, answers one request per model through
tritonclient (compared with ``compiler.load``), and releases and rolls back a second version of each
under the running server. The models come from the zoo file and the commands from the CLI, so a new
model or command is in the matrix without an edit.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import yaml

from tests.fixtures import preloaded
from tests.matrix.driver import SKIPPED, per_model_commands

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # the zoo compiled, then every command on every model: 4 minutes alone
ZOO = ROOT / "deploy" / "zoo.yaml"
HF_MODEL = "pair"  # keyword inputs: input_ids, attention_mask, token_type_ids
MODELS = [m["name"] for m in yaml.safe_load(ZOO.read_text())["models"]] + [HF_MODEL]
COMMANDS = [" ".join(c) for c in per_model_commands() if c not in SKIPPED]
TOL = 1e-5


def _pair_bert(folder: Path) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=64, type_vocab_size=2, num_labels=3,
    )  # fmt: skip
    BertForSequenceClassification(config).eval().save_pretrained(folder)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory, prefect_server) -> dict:
    """The zoo compiled, then the driver's run; the flows (zoo, release) report to the suite's real
    Prefect server rather than each starting an ephemeral one."""
    root = tmp_path_factory.mktemp("readme-zoo")
    zoo = yaml.safe_load(ZOO.read_text())
    _pair_bert(root / "pair-bert")
    zoo["models"].append({"name": HF_MODEL, "source": "hf:./pair-bert", "task": "sequence-classification"})
    zoo["settings"].update({"out_dir": "out", "workspace": "ws", "engine_cache": "engine-cache"})
    (root / "zoo.yaml").write_text(yaml.safe_dump(zoo, sort_keys=False))
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "HF_HUB_OFFLINE": "1",
        "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    env.update(prefect_server.env)
    compiled = preloaded.run(
        [sys.executable, "-m", "flows.cli", "zoo", "zoo.yaml", "--out", "out"],
        cwd=root, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert compiled.returncode == 0, (compiled.stdout[-4000:], compiled.stderr[-4000:])
    driven = preloaded.run(  # a fresh process of its own, forked: torch and the like imported once
        [sys.executable, "-m", "tests.matrix.driver", str(root)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500,
    )  # fmt: skip
    assert driven.returncode == 0, (driven.stdout[-4000:], driven.stderr[-4000:])
    return {"root": root, "results": json.loads((root / "matrix.json").read_text())}


def _step(matrix: dict, model: str, name: str) -> dict:
    found = matrix["results"].get(model, {}).get(name)
    assert found is not None, f"{model}: step {name!r} did not run"
    return found


def test_the_matrix_covers_every_per_model_command_of_the_cli(matrix):
    ran = matrix["results"]["_commands"]["per_model"]
    assert sorted(ran) == sorted(" ".join(c) for c in per_model_commands())
    assert {"lookup", "report", "debug compare", "release", "rollback", "serve triton export"} <= set(ran)


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_works_on_every_readme_model(matrix, model, command):
    runs = {k: v for k, v in matrix["results"][model].items() if k.split("#")[0] == command}
    assert runs, f"{command} did not run on {model}"
    for name, run in runs.items():
        if command == "rollback":  # one champion, nothing before it: a typed refusal naming --to
            assert run["exit"] == 2 and "Traceback" not in run["output"], run
            assert "previous" in run["output"] or "--to" in run["output"], run
            continue
        assert run["exit"] == 0, f"{model}: kiln {' '.join(run.get('args', [name]))}\n{run['output']}"
    if command == "report":
        page = matrix["root"] / "reports" / f"{model}.html"
        assert page.stat().st_size > 4_000 and model in page.read_text() and "<svg" in page.read_text()


@pytest.mark.parametrize("model", MODELS)
def test_triton_answers_every_model_as_compiler_load_does(matrix, model):
    first = _step(matrix, model, "triton infer")
    assert first.get("exit", 0) == 0, first.get("output")
    assert first["max_abs_diff"] and max(first["max_abs_diff"].values()) <= TOL, first
    assert first["version"] == "1"


@pytest.mark.parametrize("model", MODELS)
def test_a_release_and_rollback_move_the_running_server_for_every_model(matrix, model):
    second = _step(matrix, model, "second version")
    assert second["exit"] == 0 and second["version"] == "2", second
    released = _step(matrix, model, "release --triton")
    assert released["exit"] == 0, released["output"]
    after = _step(matrix, model, "triton infer after release")
    assert after.get("exit", 0) == 0, after.get("output")
    assert after["version"] == "2" and max(after["max_abs_diff"].values()) <= TOL, after
    rolled = _step(matrix, model, "rollback --triton")
    assert rolled["exit"] == 0, rolled["output"]
    back = _step(matrix, model, "triton infer after rollback")
    assert back["version"] == "1" and max(back["max_abs_diff"].values()) <= TOL, back


def test_one_export_serves_every_model_of_the_zoo(matrix):
    export = _step(matrix, "_all", "serve triton export")
    assert export["exit"] == 0, export["output"]
    repository = matrix["root"] / "repository"
    assert sorted(p.name for p in repository.iterdir() if not p.name.startswith(".")) == sorted(MODELS)
    served = json.loads(next((repository / HF_MODEL).glob("[0-9]*/kiln.json")).read_text())
    # keyword inputs served under their names; token ids bounded by the embedding they index
    assert [i["name"] for i in served["inputs"]] == ["input_ids", "attention_mask", "token_type_ids"]
    assert [o["name"] for o in served["outputs"]] == ["logits"]


def test_cuda_versions_export_on_a_cpu_only_host_from_what_their_packages_record(tmp_path, monkeypatch):
    """A package recorded on the H100 (tests/fixtures/make_cuda_fixture.py) is exported for Triton here,
    where nothing CUDA can load: its signature comes from its manifest. One recorded by a kiln before
    output specs (package format 2) is refused by name, and leaves the repository as it was."""
    from registry import config
    from registry.models import CHAMPION, set_alias
    from registry.tracking import record_package

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    packages = ROOT / "tests" / "fixtures" / "packages"
    monkeypatch.chdir(tmp_path)  # the embedded store keeps artifacts under the working folder
    for model, folder in (("bert", "bert-cuda-inductor.kiln"), ("mlp", "mlp-cuda-inductor.kiln")):
        version = record_package(packages / folder, model, {"name": model}, tracking_uri=uri).version
        set_alias(config.client(uri), f"kiln.{model}.cuda_sm_90", CHAMPION, version)
    repository = tmp_path / "repository"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "flows.cli", "serve", "triton", "export", "bert", "mlp"]
    command += ["--target", "cuda:sm_90", "--repository", str(repository), "--tracking-uri", uri, "--json"]
    done = preloaded.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr[-3000:]  # one model failed: exit 1, the other exported
    outcome = {r["model"]: r for r in json.loads(done.stdout)}
    assert outcome["bert"]["ok"] and not outcome["mlp"]["ok"]
    assert (
        "did not record output specs" in outcome["mlp"]["message"]
        and "compile it again" in outcome["mlp"]["message"]
    )
    assert sorted(p.name for p in repository.iterdir()) == ["bert"]  # nothing of mlp, not even a folder
    config_text = (repository / "bert" / "config.pbtxt").read_text()
    # automatic instances: two on a GPU (serving.triton.config.instance_count)
    assert "kind: KIND_GPU count: 2" in config_text and "max_batch_size: 8" in config_text
    served = json.loads((repository / "bert" / "1" / "kiln.json").read_text())
    assert [i["name"] for i in served["inputs"]] == ["input_ids", "attention_mask"]  # keyword inputs
    assert [o["name"] for o in served["outputs"]] == ["last_hidden_state", "pooler_output"]
    assert served["engine_target"] == "cuda:sm_90"
