"""Model sources: Hugging Face folders and hub ids, torch.export programs and MLflow-registered models.

Real parts only: models written with save_pretrained from tiny configs (random weights, no downloads),
a real Hugging Face cache layout for the offline hub case, real .pt2 files and a real `mlflow server`.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest
import torch

import compiler
from tests.fixtures.downloads import downloading, killed_download
from zoo.config import ZooEntry
from zoo.errors import UntrustedCodeError, ZooConfigError
from zoo.preflight import preflight
from zoo.sources import default_name, source_for
from zoo.sources.hf import HfSource
from zoo.sources.staging import TEMP_PREFIX, staging_dir
from zoo.zoo_file import parse_zoo


def _tiny_hf(task: str, folder: Path, seed: int = 0) -> Path:
    """A save_pretrained folder of a tiny model for ``task`` (random weights)."""
    import transformers as t

    torch.manual_seed(seed)
    bert = dict(vocab_size=96, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)
    bert.update(intermediate_size=32, max_position_embeddings=40)
    if task == "feature-extraction":
        model = t.BertModel(t.BertConfig(**bert))
    elif task == "sequence-classification":
        model = t.BertForSequenceClassification(t.BertConfig(**bert, num_labels=3))
    elif task == "token-classification":
        config = t.DistilBertConfig(vocab_size=96, dim=16, n_layers=1, n_heads=2, hidden_dim=32, num_labels=5)
        model = t.DistilBertForTokenClassification(config)
    elif task == "image-classification":
        config = t.ViTConfig(
            image_size=16,
            patch_size=8,
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            num_labels=4,
        )
        model = t.ViTForImageClassification(config)
    elif task == "causal-lm":
        config = t.GPT2Config(
            vocab_size=96, n_positions=48, n_embd=16, n_layer=1, n_head=2, bos_token_id=0, eos_token_id=0
        )
        model = t.GPT2LMHeadModel(config)
    else:
        raise AssertionError(task)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf")


def _entry(source: str, **fields) -> ZooEntry:
    return ZooEntry.model_validate({"name": "m", "source": source, **fields})


def _error(exc: pytest.ExceptionInfo) -> str:
    return str(exc.value)


# ---------------------------------------------------------------- hf: identity


def test_hf_identity_hashes_files_without_loading_and_follows_the_weights(hf_dir: Path) -> None:
    folder = _tiny_hf("sequence-classification", hf_dir / "cls")
    source = source_for(f"hf:{folder}", task="sequence-classification")
    first = source.identity()
    assert (first.kind, first.uri, first.version) == ("hf", f"hf:{folder}", "")  # a folder has no revision
    assert source.identity() == first

    # Another task is another graph: another identity.
    assert source_for(f"hf:{folder}", task="feature-extraction").identity().digest != first.digest

    # New weights (same config): a new identity.
    copy = _tiny_hf("sequence-classification", hf_dir / "cls-retrained", seed=1)
    assert source_for(f"hf:{copy}", task="sequence-classification").identity().digest != first.digest
    shutil.copy(copy / "model.safetensors", folder / "model.safetensors")
    assert source.identity().digest != first.digest

    # Identity never loads: weights that no loader could read still hash; load() then fails, typed.
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    assert source.identity().digest not in (first.digest,)
    with pytest.raises(ZooConfigError, match="could not load it as task 'sequence-classification'"):
        source.load()


# ---------------------------------------------------------------- hf: load + export, per task


@pytest.mark.parametrize(
    ("task", "inputs", "output_shape"),
    [
        # BERT takes token_type_ids (type_vocab_size 2); DistilBERT's forward has none; GPT-2 has no types.
        ("feature-extraction", {"input_ids", "attention_mask", "token_type_ids"}, None),
        ("sequence-classification", {"input_ids", "attention_mask", "token_type_ids"}, (3,)),
        ("token-classification", {"input_ids", "attention_mask"}, (5,)),
        ("image-classification", {"pixel_values"}, (4,)),
        ("causal-lm", {"input_ids", "attention_mask"}, (96,)),
    ],
)
def test_hf_folder_loads_and_exports_with_ranges_from_config_and_task(
    hf_dir: Path, task: str, inputs: set[str], output_shape: tuple | None
) -> None:
    folder = _tiny_hf(task, hf_dir / task)
    request = _entry(f"hf:{folder}", task=task).requests()[0]
    case = request.load_case()
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    specs = {s.name: s for s in compiler.input_specs(program)}
    assert set(specs) == inputs
    if "input_ids" in specs:
        ids = specs["input_ids"]
        # batch 1..8, sequence 1..min(512, max positions); int64; token ids over the whole vocabulary.
        assert ids.dtype == "int64" and ids.dynamic_dims == {0: "batch", 1: "seq"}
        max_seq = 48 if task == "causal-lm" else 40 if task != "token-classification" else 512
        assert (ids.min_shape, ids.max_shape) == ((1, 1), (8, max_seq))
        assert ids.value_range == (0.0, 95.0)
        x = {"input_ids": torch.randint(0, 96, (3, 7)), "attention_mask": torch.ones(3, 7, dtype=torch.int64)}
        if (
            "token_type_ids" in specs
        ):  # the tokenizer's segments: the same ranges, values 0..type_vocab_size-1
            types = specs["token_type_ids"]
            assert types.dtype == "int64" and types.dynamic_dims == ids.dynamic_dims
            assert (types.min_shape, types.max_shape, types.value_range) == (
                ids.min_shape,
                ids.max_shape,
                (0, 1),
            )
            x["token_type_ids"] = (torch.arange(7) >= 4).long().expand(3, 7)  # a sentence pair
    else:
        pixels = specs["pixel_values"]
        assert pixels.dtype == "float32" and (pixels.min_shape, pixels.max_shape) == (
            (1, 3, 16, 16),
            (8, 3, 16, 16),
        )
        x = {"pixel_values": torch.randn(3, 3, 16, 16)}
    eager, exported = case.model(**x), program.module()(**x)
    if task == "causal-lm":  # logits only, no cache objects
        assert isinstance(eager, torch.Tensor) and eager.shape == (3, 7, 96)
    eager_t = eager if isinstance(eager, torch.Tensor) else eager[0]
    exported_t = exported if isinstance(exported, torch.Tensor) else exported[0]
    if output_shape is not None:
        assert eager_t.shape[-1:] == output_shape
    torch.testing.assert_close(exported_t, eager_t, rtol=1e-4, atol=1e-5)


def test_an_hf_decoder_as_feature_extraction_exports_without_its_cache(hf_dir: Path) -> None:
    """Issue 41: GPT-2's hidden states, not its KV cache (a DynamicCache torch.export cannot return)."""
    import transformers as t

    folder = hf_dir / "gpt2-features"
    torch.manual_seed(0)
    config = t.GPT2Config(vocab_size=96, n_positions=48, n_embd=16, n_layer=1, n_head=2)
    t.GPT2Model(config).save_pretrained(folder)
    assert json.loads((folder / "config.json").read_text())["use_cache"] is True  # as the hub's have it
    case = _entry(f"hf:{folder}", task="feature-extraction").requests()[0].load_case()
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    assert [s.name for s in compiler.input_specs(program)] == ["input_ids", "attention_mask"]
    x = {"input_ids": torch.randint(0, 96, (3, 7)), "attention_mask": torch.ones(3, 7, dtype=torch.int64)}
    eager, exported = case.model(**x), program.module()(**x)
    assert eager.past_key_values is None
    torch.testing.assert_close(exported.last_hidden_state, eager.last_hidden_state, rtol=1e-4, atol=1e-5)


def test_inputs_override_the_hf_ranges_and_the_example_moves_inside_them(hf_dir: Path) -> None:
    folder = _tiny_hf("feature-extraction", hf_dir / "ranged")
    seq = {"axis": 1, "name": "seq", "min": 24, "max": 32}
    inputs = {"input_ids": {"dims": [seq]}, "attention_mask": {"dims": [seq]}}
    case = _entry(f"hf:{folder}", task="feature-extraction", inputs=inputs).requests()[0].load_case()
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    ids = next(s for s in compiler.input_specs(program) if s.name == "input_ids")
    assert (ids.min_shape, ids.opt_shape, ids.max_shape) == ((2, 24), (2, 24), (2, 32))


def test_an_entry_drops_or_narrows_an_input_the_model_would_take(hf_dir: Path) -> None:
    folder = _tiny_hf("feature-extraction", hf_dir / "drop")
    seq = {"axis": 1, "name": "seq", "min": 4, "max": 24}
    batch = {"axis": 0, "name": "batch", "min": 1, "max": 4}
    inputs = {"token_type_ids": {"drop": True}, "input_ids": {"dims": [batch, seq]}}
    request = _entry(f"hf:{folder}", task="feature-extraction", inputs=inputs).requests()[0]
    case = request.load_case()
    assert set(case.kwargs) == {"input_ids", "attention_mask"}
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    specs = {s.name: s for s in compiler.input_specs(program)}
    # The mask, not listed, has input_ids' narrowed ranges: one tokenizer call gives both.
    assert list(specs) == ["input_ids", "attention_mask"]
    assert specs["input_ids"].max_shape == specs["attention_mask"].max_shape == (4, 24)
    # A dropped input is another compile than a static one (``dims: []``).
    static = _entry(f"hf:{folder}", task="feature-extraction", inputs={"token_type_ids": {"dims": []}})
    assert static.requests()[0].cache_identity() != request.cache_identity()

    # What cannot be dropped is named: the main input, a parameter without a default, a typo.
    with pytest.raises(ZooConfigError, match=r"models\[m\]\.inputs\.input_ids\.drop: .*main input"):
        _entry(f"hf:{folder}", task="feature-extraction", inputs={"input_ids": {"drop": True}}).requests()[
            0
        ].load_case()
    with pytest.raises(ZooConfigError, match=r"inputs\.token_types: the model has no input 'token_types'"):
        _entry(f"hf:{folder}", task="feature-extraction", inputs={"token_types": {"drop": True}}).requests()[
            0
        ].load_case()
    both = parse_zoo(
        {
            "models": [
                {
                    "name": "b",
                    "source": f"hf:{folder}",
                    "task": "feature-extraction",
                    "inputs": {"token_type_ids": {"drop": True, "dims": [seq]}},
                }
            ]
        }
    )
    assert "drop: true takes no dims" in both.invalid[0].error


def test_an_offline_hub_id_resolves_from_the_local_cache(hf_dir: Path, tmp_path: Path, monkeypatch) -> None:
    # The cache layout huggingface_hub writes: refs/<branch> -> commit, snapshots/<commit>/<files>.
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--kiln-test--tiny-gpt2"
    _tiny_hf("causal-lm", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    source = source_for("hf:kiln-test/tiny-gpt2", task="causal-lm")
    identity = source.identity()
    assert identity.version == commit
    folder_identity = source_for(f"hf:{repo / 'snapshots' / commit}", task="causal-lm").identity()
    assert identity.digest == folder_identity.digest  # the same files are the same model
    assert source.load().model(torch.tensor([[1, 2, 3]]), torch.ones(1, 3, dtype=torch.int64)).shape == (
        1,
        3,
        96,
    )
    # The branch moves: this source keeps the commit it keyed and loads; a new source sees the move.
    moved = "fedcba9876543210fedcba9876543210fedcba98"
    shutil.copytree(repo / "snapshots" / commit, repo / "snapshots" / moved)
    (repo / "refs" / "main").write_text(moved)
    assert source.identity().version == commit
    assert source_for("hf:kiln-test/tiny-gpt2", task="causal-lm").identity().version == moved
    with pytest.raises(ZooConfigError, match=r"at revision 'v2' is not in the local Hugging Face cache"):
        source_for("hf:kiln-test/tiny-gpt2", task="causal-lm", revision="v2").identity()


# ---------------------------------------------------------------- hf: bad input, named by entry and field


def _preflight_error(entry: dict, zoo_dir: Path | None = None) -> str:
    zoo = parse_zoo({"models": [entry]}, zoo_dir=str(zoo_dir) if zoo_dir else None)
    assert not zoo.invalid, zoo.invalid
    with pytest.raises(ZooConfigError) as exc:
        preflight(zoo.requests(zoo.entries[0])[0])
    return _error(exc)


def test_missing_folder_and_folder_without_config_are_named(hf_dir: Path, tmp_path: Path) -> None:
    missing = _preflight_error({"name": "gone", "source": f"hf:{tmp_path}/nope", "task": "causal-lm"})
    assert missing.startswith("models[gone].source:") and "does not exist" in missing

    relative = _preflight_error({"name": "rel", "source": "hf:./models/bert", "task": "causal-lm"}, tmp_path)
    assert relative.startswith("models[rel].source:") and f"relative to {tmp_path}" in relative

    (tmp_path / "empty").mkdir()
    empty = _preflight_error({"name": "empty", "source": f"hf:{tmp_path}/empty", "task": "causal-lm"})
    assert empty.startswith("models[empty].source:") and "has no config.json" in empty

    folder = _tiny_hf("causal-lm", tmp_path / "pickled")
    (folder / "model.safetensors").rename(folder / "pytorch_model.bin")
    pickled = _preflight_error({"name": "pkl", "source": f"hf:{folder}", "task": "causal-lm"})
    assert pickled.startswith("models[pkl].source:") and "which loading would unpickle" in pickled


def test_unknown_or_unfit_task_is_named(hf_dir: Path) -> None:
    folder = _tiny_hf("feature-extraction", hf_dir / "task-check")
    zoo = parse_zoo({"models": [{"name": "t", "source": f"hf:{folder}", "task": "summarize"}]})
    assert zoo.invalid[0].name == "t"
    assert zoo.invalid[0].error.startswith("models[0] (t).task: unknown task 'summarize'; use one of")
    with pytest.raises(ZooConfigError, match=r"^task: 'summarize' is not a task kiln loads"):
        source_for(f"hf:{folder}", task="summarize")
    # A BERT has no image-classification head: refused before anything loads.
    unfit = _preflight_error({"name": "u", "source": f"hf:{folder}", "task": "image-classification"})
    assert unfit.startswith("models[u].task: 'image-classification' does not fit")


def test_remote_code_needs_trust_remote_code(tmp_path: Path) -> None:
    folder = _tiny_hf("feature-extraction", tmp_path / "custom")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="kiln_custom", auto_map={"AutoModel": "modeling_custom.CustomModel"})
    (folder / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (folder / "modeling_custom.py").write_text(f"open({str(marker)!r}, 'w').close()\n")

    entry = {"name": "custom", "source": f"hf:{folder}", "task": "feature-extraction"}
    zoo = parse_zoo({"models": [entry]})
    with pytest.raises(UntrustedCodeError) as exc:
        preflight(zoo.requests(zoo.entries[0])[0])
    assert _error(exc).startswith("models[custom].trust_remote_code:") and "runs that code" in _error(exc)
    with pytest.raises(UntrustedCodeError):
        source_for(f"hf:{folder}", task="feature-extraction").load()
    assert not marker.exists()  # nothing from the folder ran

    # Trusted, the model's own code is part of its identity.
    trusted = source_for(f"hf:{folder}", task="feature-extraction", trust_remote_code=True)
    before = trusted.identity().digest
    (folder / "modeling_custom.py").write_text("# changed\n")
    assert trusted.identity().digest != before
    assert not marker.exists()


def test_remote_code_identity_covers_every_python_file_below_the_folder(tmp_path: Path) -> None:
    """Issue 31 N23: code in a subfolder (or imported by a dotted relative name) changed, and the identity
    said "nothing changed", so a stale package answered for a model that no longer existed."""
    folder = _tiny_hf("feature-extraction", tmp_path / "nested")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="kiln_nested", auto_map={"AutoModel": "modeling_top.TopModel"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_top.py").write_text("from .sub.modeling_x import Layer\n")
    (folder / "sub").mkdir()
    (folder / "sub" / "modeling_x.py").write_text("SCALE = 1.0\n")
    (folder / "sub" / "deeper").mkdir()
    (folder / "sub" / "deeper" / "helpers.py").write_text("EPS = 1e-5\n")
    source = source_for(f"hf:{folder}", task="feature-extraction", trust_remote_code=True)
    before = source.identity().digest
    (folder / "sub" / "modeling_x.py").write_text("SCALE = 3.0\n")
    after = source.identity().digest
    assert after != before
    (folder / "sub" / "deeper" / "helpers.py").write_text("EPS = 1e-6\n")
    assert source.identity().digest != after
    # A file's place is part of what it is: the same bytes moved to another module path is other code.
    moved = source.identity().digest
    (folder / "sub" / "deeper" / "helpers.py").rename(folder / "sub" / "helpers.py")
    assert source.identity().digest != moved


@pytest.mark.parametrize(
    ("where", "value"),
    [
        ("config", "kernels-community/flash-attn"),
        ("config", {"": "sdpa", "text_config": "kernels-community/flash-attn"}),
        ("entry", "kernels-community/flash-attn@v2:flash_attn"),
        ("entry", "my_custom_attention"),
    ],
)
def test_attention_implementations_that_load_hub_kernels_are_refused_before_loading(
    hf_dir: Path, tmp_path: Path, monkeypatch, where: str, value
) -> None:
    """transformers fetches a kernel from the hub (and runs it) for an attn_implementation that names a
    hub repository: kiln compiles offline from the files the entry names, so it is refused in preflight."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = _tiny_hf("feature-extraction", tmp_path / "kernel")
    entry = {"name": "k", "source": f"hf:{folder}", "task": "feature-extraction"}
    if where == "config":
        config = json.loads((folder / "config.json").read_text())
        config["attn_implementation"] = value
        (folder / "config.json").write_text(json.dumps(config))
        message = _preflight_error(entry)
        assert message.startswith("models[k].source:") and "config.json" in message
    else:
        zoo = parse_zoo({"models": [{**entry, "attn_implementation": value}]})
        assert zoo.invalid, "the schema accepted a hub kernel"
        message = zoo.invalid[0].error
        assert "attn_implementation" in message
    assert "hub" in message and "sdpa" in message and "eager" in message, message


def test_flash_attention_that_transformers_would_fetch_from_the_hub_is_refused(
    hf_dir: Path, tmp_path: Path, monkeypatch
) -> None:
    """Without flash-attn installed (or usable: no CUDA here), transformers serves flash_attention_2 with
    a hub kernel wherever the ``kernels`` package is installed; without ``kernels`` it cannot fetch."""
    folder = _tiny_hf("feature-extraction", hf_dir / "flash")
    entry = {"name": "f", "source": f"hf:{folder}", "task": "feature-extraction"}
    zoo = parse_zoo({"models": [{**entry, "attn_implementation": "flash_attention_2"}]})
    preflight(zoo.requests(zoo.entries[0])[0])  # no kernels package: nothing would be fetched
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")  # the package transformers fetches hub kernels with
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ZooConfigError) as exc:
        preflight(zoo.requests(zoo.entries[0])[0])
    assert _error(exc).startswith("models[f].attn_implementation: attn_implementation 'flash_attention_2'")
    assert "from the Hugging Face hub" in _error(exc) and "sdpa or eager" in _error(exc)


def test_built_in_attention_implementations_compile_and_are_part_of_the_identity(hf_dir: Path) -> None:
    folder = _tiny_hf("feature-extraction", hf_dir / "attn")
    entry = {"name": "a", "source": f"hf:{folder}", "task": "feature-extraction"}
    digests = set()
    for value in (None, "eager", "sdpa"):
        request = parse_zoo({"models": [{**entry, "attn_implementation": value}]}).entries[0].requests()[0]
        preflight(request)
        digests.add(request.identity().digest)
    assert len(digests) == 3
    case = _entry(f"hf:{folder}", task="feature-extraction", attn_implementation="eager").requests()[0]
    assert case.load_case().model.config._attn_implementation == "eager"
    wrong = parse_zoo({"models": [{"name": "p", "source": "pt2:x.pt2", "attn_implementation": "eager"}]})
    assert "attn_implementation: applies to hf: sources only" in wrong.invalid[0].error


def test_offline_hub_id_not_in_the_cache_is_named(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = _preflight_error({"name": "hub", "source": "hf:kiln-test/not-cached", "task": "causal-lm"})
    assert message.startswith("models[hub].source: hf:kiln-test/not-cached: hub id 'kiln-test/not-cached'")
    assert "not in the local Hugging Face cache" in message and "HF_HUB_OFFLINE" in message


# ---------------------------------------------------------------- entry fields


def test_entry_takes_exactly_one_source_and_factory_is_a_source_kind() -> None:
    old = ZooEntry.model_validate({"name": "b", "factory": "zoo.models:tiny_bert", "seed": 3})
    new = ZooEntry.model_validate({"name": "b", "source": "factory:zoo.models:tiny_bert", "seed": 3})
    assert old.source_uri == new.source_uri == "factory:zoo.models:tiny_bert"
    assert old.requests()[0].cache_identity() == new.requests()[0].cache_identity()

    cases = [
        ({"name": "x"}, "source: give exactly one of source"),
        ({"name": "x", "source": "hf:a", "factory": "zoo.models:tiny_bert"}, "exactly one"),
        ({"name": "x", "source": "hf:./a"}, "task: required for hf: sources"),
        (
            {"name": "x", "source": "factory:zoo.models:tiny_bert", "task": "causal-lm"},
            "task: applies to hf:",
        ),
        ({"name": "x", "source": "hf:./a", "task": "causal-lm", "seed": 1}, "seed: applies to factory:"),
        ({"name": "x", "source": "s3://bucket/model"}, "source: 's3://bucket/model' has no known kind"),
        ({"name": "x", "source": "factory:os.system"}, "must look like 'factory:package.module:function'"),
    ]
    for raw, expected in cases:
        zoo = parse_zoo({"models": [raw]})
        assert expected in zoo.invalid[0].error, (raw, zoo.invalid[0].error)


def test_default_names_for_sources_given_on_the_command_line() -> None:
    assert default_name("hf:./models/bert-base/") == "bert-base"
    assert default_name("hf:Org/Tiny_Model") == "tiny-model"
    assert default_name("factory:zoo.models:tiny_bert") == "tiny-bert"
    assert isinstance(source_for("hf:./x", task="causal-lm"), HfSource)


# ---------------------------------------------------------------- pt2:


class _Tagger(torch.nn.Module):
    """Two inputs sharing a dynamic dim, one of them token ids: what a re-export must keep."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(50, 8), torch.nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids) * mask.unsqueeze(-1))


@pytest.fixture(scope="module")
def pt2_files(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from torch.export import Dim

    folder = tmp_path_factory.mktemp("pt2")
    torch.manual_seed(0)
    model = _Tagger().eval()
    ids = torch.randint(0, 50, (2, 6))
    ids.view(-1)[0], ids.view(-1)[-1] = 0, 49
    batch, seq = Dim("batch", min=1, max=8), Dim("seq", min=2, max=32)
    shapes = {"ids": {0: batch, 1: seq}, "mask": {0: batch, 1: seq}}
    kiln = compiler.export(model, (), {"ids": ids, "mask": torch.ones(2, 6)}, dynamic_shapes=shapes)
    compiler.save_program(kiln, folder / "kiln.pt2")
    plain = torch.export.export(model, (ids, torch.ones(2, 6)), dynamic_shapes=shapes)
    torch.export.save(plain, folder / "plain.pt2")  # no kiln specs: ranges from its constraints
    return {"model": model, "dir": folder, "kiln": folder / "kiln.pt2", "plain": folder / "plain.pt2"}


@pytest.mark.parametrize("which", ["kiln", "plain"])
def test_pt2_round_trip_keeps_the_ranges(pt2_files: dict, which: str) -> None:
    path = pt2_files[which]
    entry = ZooEntry.model_validate({"name": "tagger", "source": f"pt2:{path.name}"})
    request = entry.requests(zoo_dir=str(pt2_files["dir"]))[0]  # relative to the zoo file's folder
    identity = request.identity()
    import hashlib

    assert identity.kind == "pt2" and identity.version == hashlib.sha256(path.read_bytes()).hexdigest()[:16]
    assert request.identity() == identity

    case = request.load_case()
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    specs = {s.name: s for s in compiler.input_specs(program)}
    assert (specs["ids"].min_shape, specs["ids"].max_shape) == ((1, 2), (8, 32))
    assert specs["ids"].dynamic_dims[0] == specs["mask"].dynamic_dims[0]  # one shared batch dim
    assert specs["ids"].dynamic_dims[1] == specs["mask"].dynamic_dims[1]
    if which == "kiln":  # kiln programs carry their dim names and the token-id range
        assert specs["ids"].dynamic_dims == {0: "batch", 1: "seq"}
        assert specs["ids"].value_range == (0.0, 49.0)
    ids, mask = torch.randint(0, 50, (5, 9)), torch.ones(5, 9)
    # The re-export takes its inputs as the original did: by keyword (kiln.pt2) or by position.
    module = program.module()
    out = module(ids=ids, mask=mask) if case.kwargs else module(ids, mask)
    torch.testing.assert_close(out, pt2_files["model"](ids, mask))
    # A program's inputs are all required: dropping one is refused by name, before any export.
    dropped = ZooEntry.model_validate(
        {"name": "t", "source": f"pt2:{path.name}", "inputs": {"mask": {"drop": True}}}
    )
    with pytest.raises(
        ZooConfigError, match=r"models\[t\]\.inputs\.mask\.drop: .*'mask'.* cannot be dropped"
    ):
        dropped.requests(zoo_dir=str(pt2_files["dir"]))[0].load_case()


def test_truncated_corrupt_or_unsafe_pt2_is_refused(pt2_files: dict, tmp_path: Path) -> None:
    import zipfile

    data = pt2_files["kiln"].read_bytes()
    (tmp_path / "truncated.pt2").write_bytes(data[: len(data) // 2])
    message = _preflight_error({"name": "cut", "source": "pt2:truncated.pt2"}, tmp_path)
    assert message.startswith("models[cut].source: pt2:truncated.pt2:") and "truncated" in message

    missing = _preflight_error({"name": "nofile", "source": "pt2:absent.pt2"}, tmp_path)
    assert missing.startswith("models[nofile].source:") and "does not exist" in missing

    # A program whose graph is garbage, and a program with an entry torch would unpickle.
    with zipfile.ZipFile(pt2_files["kiln"]) as good, zipfile.ZipFile(tmp_path / "junk.pt2", "w") as junk:
        for item in good.infolist():
            broken = item.filename.endswith("models/model.json")
            junk.writestr(item, b'{"graph_module": ' if broken else good.read(item))
    shutil.copy(pt2_files["kiln"], tmp_path / "evil.pt2")
    with zipfile.ZipFile(tmp_path / "evil.pt2", "a") as archive:
        archive.writestr(
            zipfile.ZipInfo(f"{archive.namelist()[0].split('/')[0]}/data/evil.pkl"), b"\x80\x04."
        )
    for name, error in (("junk", ZooConfigError), ("evil", UntrustedCodeError)):
        request = ZooEntry(name=name, source=f"pt2:{name}.pt2").requests(zoo_dir=str(tmp_path))[0]
        preflight(request)  # a zip archive: its content is checked when it loads
        with pytest.raises(error, match=rf"^models\[{name}\]\.source: pt2:{name}\.pt2: "):
            request.load_case()


# ---------------------------------------------------------------- models:/ (a real mlflow server)

_MLP_IN, _MLP_OUT = 8, 4


def _mlp(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(_MLP_IN, 16), torch.nn.ReLU(), torch.nn.Linear(16, _MLP_OUT)
    ).eval()


def _mlmodel_by_hand(client, run_id: str, path: str, flavors: dict, name: str) -> None:
    """A registered version whose MLmodel says what a test needs (it is never loaded)."""
    import mlflow

    mlflow.log_text(yaml_dump({"artifact_path": path, "flavors": flavors}), f"{path}/MLmodel", run_id=run_id)
    client.create_registered_model(name)
    client.create_model_version(name, f"runs:/{run_id}/{path}", run_id)


def yaml_dump(data: dict) -> str:
    import yaml

    return yaml.safe_dump(data)


@pytest.fixture(scope="module")
def registered(mlflow_server) -> dict:
    """kiln-src-mlp (pt2 format, signature and input example from the logged example) @production;
    kiln-src-pickled (pickle format, a signature, no example); two hand-written MLmodels that are
    not loadable PyTorch models: no signature, and another flavor."""
    import mlflow
    import mlflow.pytorch
    import numpy as np
    from mlflow.models import infer_signature

    client = mlflow.MlflowClient()
    model, pickled = _mlp(0), _mlp(1)
    example = np.random.default_rng(0).standard_normal((4, _MLP_IN)).astype(np.float32)
    with mlflow.start_run() as run:
        mlflow.pytorch.log_model(
            model,
            name="model",
            input_example=example,
            registered_model_name="kiln-src-mlp",
            pip_requirements=["torch"],
        )
        signature = infer_signature(example, pickled(torch.from_numpy(example)).detach().numpy())
        mlflow.pytorch.log_model(
            pickled,
            name="pickled",
            signature=signature,
            serialization_format="pickle",
            registered_model_name="kiln-src-pickled",
            pip_requirements=["torch"],
        )
        pytorch_flavor = {"pytorch": {"model_data": "data", "pytorch_version": str(torch.__version__)}}
        _mlmodel_by_hand(client, run.info.run_id, "nosig", pytorch_flavor, "kiln-src-nosig")
        _mlmodel_by_hand(
            client, run.info.run_id, "sk", {"sklearn": {"pickled_model": "m.pkl"}}, "kiln-src-sk"
        )
    client.set_registered_model_alias("kiln-src-mlp", "production", "1")
    return {"model": model, "pickled": pickled, "run_id": run.info.run_id, "client": client}


def test_registered_model_resolves_without_loading_and_exports(registered: dict) -> None:
    source = source_for("models:/kiln-src-mlp@production")
    identity = source.identity()
    assert (identity.kind, identity.version, identity.run_id) == ("mlflow", "1", registered["run_id"])
    assert source_for("models:/kiln-src-mlp/1").identity().digest == identity.digest

    case = _entry("models:/kiln-src-mlp@production").requests()[0].load_case()
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    (spec,) = compiler.input_specs(program)
    # The signature's -1 batch axis becomes batch 1..8; the logged example (batch 4) is the example.
    assert (spec.dtype, spec.min_shape, spec.opt_shape, spec.max_shape) == ("float32", (1, 8), (4, 8), (8, 8))
    x = torch.randn(3, _MLP_IN)
    torch.testing.assert_close(program.module()(x), registered["model"](x))

    # The alias moves to a new version: a new source resolves it, and a new identity keys the compile;
    # a source that already resolved keeps the version it keyed.
    client = registered["client"]
    first = client.get_model_version("kiln-src-mlp", "1")
    logged_model = first.model_id or first.source.removeprefix("models:/")  # MLflow 3: a logged model
    client.create_model_version("kiln-src-mlp", first.source, first.run_id, model_id=logged_model)
    client.set_registered_model_alias("kiln-src-mlp", "production", "2")
    try:
        moved = source_for("models:/kiln-src-mlp@production").identity()
        assert moved.version == "2" and moved.digest != identity.digest
        assert source.identity() == identity
    finally:
        client.set_registered_model_alias("kiln-src-mlp", "production", "1")


def test_inputs_give_the_registered_model_its_ranges(
    registered: dict, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the downloads' staging parent
    stale = killed_download(tmp_path, "source")  # a download killed midway leaves its staging directory
    batch = {"axis": 0, "name": "rows", "min": 2, "max": 64}
    entry = _entry("models:/kiln-src-mlp/1", inputs={"input": {"dims": [batch]}})
    case = entry.requests()[0].load_case()
    # The next download swept it; its own directory is gone too.
    assert not stale.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(TEMP_PREFIX)]
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    (spec,) = compiler.input_specs(program)
    assert (spec.min_shape, spec.max_shape, spec.dynamic_dims) == ((2, 8), (64, 8), {0: "rows"})


def test_a_pickled_registered_model_loads_only_where_mlflow_allows_it(registered: dict, monkeypatch) -> None:
    request = _entry("models:/kiln-src-pickled/1").requests()[0]
    preflight(request)  # version, flavor and signature resolve: nothing is unpickled
    monkeypatch.delenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", raising=False)
    with pytest.raises(UntrustedCodeError, match=r"^models\[m\]\.source: .*runs code from the registry"):
        request.load_case()
    monkeypatch.setenv("MLFLOW_ALLOW_PICKLE_DESERIALIZATION", "true")
    case = request.load_case()
    # No input example was logged: the example is drawn from the signature (batch 2 in 1..8).
    assert case.args[0].shape == (2, _MLP_IN) and case.args[0].dtype == torch.float32
    torch.testing.assert_close(case.model(case.args[0]), registered["pickled"](case.args[0]))


@pytest.mark.parametrize(
    ("uri", "field", "expected"),
    [
        ("models:/kiln-src-none/1", "source", "does not exist in the registry"),
        ("models:/kiln-src-mlp/9", "source", "does not exist in the registry"),
        ("models:/kiln-src-mlp@staging", "source", "does not exist in the registry"),
        ("models:/kiln-src-sk/1", "source", "is not a PyTorch model (its flavors: sklearn)"),
        ("models:/kiln-src-nosig/1", "source", "has no signature and the entry gives no inputs:"),
    ],
)
def test_registry_bad_input_is_named(registered: dict, uri: str, field: str, expected: str) -> None:
    message = _preflight_error({"name": "reg", "source": uri})
    assert message.startswith(f"models[reg].{field}: {uri}") and expected in message, message


def test_staging_dirs_of_killed_downloads_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    killed_dir = killed_download(tmp_path, "killed")
    assert killed_dir.is_dir()  # no cleanup ran
    live, live_dir = downloading(tmp_path, "live")
    try:
        day = 24 * 3600
        # Another machine's downloads (a shared disk) are judged by age only; names not ours are left.
        other_old = tmp_path / f"{TEMP_PREFIX}0123456789ab-1-1-source-abc"
        other_new = tmp_path / f"{TEMP_PREFIX}0123456789ab-2-2-source-def"
        foreign = tmp_path / f"{TEMP_PREFIX}someone-elses"
        for path in (other_old, other_new, foreign):
            path.mkdir()
        os.utime(other_old, (time.time() - day - 60, time.time() - day - 60))
        os.utime(foreign, (time.time() - 3 * day, time.time() - 3 * day))
        with staging_dir("mine", tmp_path) as mine:
            assert mine.is_dir() and mine.name.startswith(TEMP_PREFIX)
            assert not killed_dir.exists() and not other_old.exists()
            assert (live_dir / "weights.part").is_file()  # a live download, however old, is never touched
            assert other_new.is_dir() and foreign.is_dir()
        assert not mine.exists()
    finally:
        live.kill()
        live.wait()


def test_malformed_models_uri_fails_its_entry() -> None:
    zoo = parse_zoo({"models": [{"name": "x", "source": "models:/fraud-bert/latest"}]})
    assert (
        "models[0] (x).source: 'models:/fraud-bert/latest' must be models:/NAME/VERSION"
        in zoo.invalid[0].error
    )
    assert default_name("models:/Fraud_BERT@production") == "fraud-bert"


def test_weights_and_programs_that_are_special_files_are_refused_not_read(tmp_path: Path) -> None:
    import os

    folder = _tiny_hf("sequence-classification", tmp_path / "fifo")
    (folder / "model.safetensors").unlink()
    os.mkfifo(folder / "model.safetensors")
    zero = _tiny_hf("sequence-classification", tmp_path / "zero")
    (zero / "model.safetensors").unlink()
    (zero / "model.safetensors").symlink_to("/dev/zero")
    os.mkfifo(tmp_path / "program.pt2")

    def hung(signum, frame):
        raise TimeoutError("reading a special file blocked")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)  # before the check, hashing the FIFO blocked and /dev/zero never ended
    try:
        fifo = _preflight_error({"name": "f", "source": f"hf:{folder}", "task": "sequence-classification"})
        assert "model.safetensors' is a FIFO" in fifo and "regular files" in fifo, fifo
        dev = _preflight_error({"name": "z", "source": f"hf:{zero}", "task": "sequence-classification"})
        assert "is a character device (it resolves to '/dev/zero')" in dev, dev
        with pytest.raises(ZooConfigError, match="is a character device"):
            source_for(f"hf:{zero}", task="sequence-classification").load()
        pt2 = _preflight_error({"name": "p", "source": f"pt2:{tmp_path}/program.pt2"})
        assert "program.pt2' is a FIFO" in pt2, pt2
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_check_refuses_validation_data_that_would_expand_past_the_bound(tmp_path: Path) -> None:
    from tests.compiler.inputs.test_data import _npz_claiming

    _npz_claiming(tmp_path / "claims.npz", (1 << 30,))  # 4 GiB by its npy header, 16 bytes of data
    entry = {"name": "m", "factory": "zoo.models:mlp_with_fallback", "validation": {"data": "claims.npz"}}
    error = _preflight_error(entry, tmp_path)
    assert error.startswith("models[m].validation.data:") and "its arrays take 4096.0 MiB" in error, error
    # Calibration data is bounded alike: int8's --check said ready for the same 4 GiB claim.
    entry = {"name": "q", "factory": "zoo.models:mlp_with_fallback", "precision": "int8"}
    error = _preflight_error({**entry, "calibration": {"data": "claims.npz"}}, tmp_path)
    assert error.startswith("models[q].calibration.data:") and "its arrays take 4096.0 MiB" in error, error
