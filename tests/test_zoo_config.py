"""The zoo file schema and the model-building seam: bad input is named with its field and its fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flows.zoo_config import (
    ZooConfigError,
    ZooEntry,
    check_target,
    load_zoo,
    parse_zoo,
    resolve_factory,
)
from tasks.model_case import load_case, model_key, weights_digest
from tasks.workspace import Workspace, content_hash

ROOT = Path(__file__).resolve().parents[1]


def _zoo(*models: dict, settings: dict | None = None) -> dict:
    return {"settings": settings or {}, "models": list(models)}


def test_example_zoo_is_valid_and_uses_every_zoo_architecture() -> None:
    zoo = load_zoo(ROOT / "deploy" / "zoo.yaml")
    assert zoo.invalid == []
    factories = {e.factory for e in zoo.entries}
    assert factories == {
        "zoo.models:tiny_bert",
        "zoo.models:tiny_vit",
        "zoo.models:tiny_resnet",
        "zoo.models:tiny_gpt2",
        "zoo.models:mlp_with_fallback",
    }
    assert all(e.backend == "onnxruntime" and e.targets == ["cpu"] for e in zoo.entries)
    for entry in zoo.entries:
        resolve_factory(entry.factory)  # importable from the repository root


@pytest.mark.parametrize(
    ("entry", "field", "fix"),
    [
        ({"name": "a", "factory": "zoo.models:tiny_vit", "backend": "onnxrt"}, "backend", "use one of"),
        ({"name": "a", "factory": "zoo.models:tiny_vit", "precison": "fp16"}, "precison", "unknown field"),
        ({"name": "a", "factory": "zoo.models:tiny_vit", "precision": "fp64"}, "precision", "fp32"),
        ({"name": "a", "factory": "zoo.models.tiny_vit"}, "factory", "module:function"),
        ({"name": "a", "factory": "zoo.models:tiny_vit", "targets": ["gpu0"]}, "targets", "cuda:N"),
        ({"name": "A b", "factory": "zoo.models:tiny_vit"}, "name", "lowercase"),
        (
            {
                "name": "a",
                "factory": "zoo.models:tiny_vit",
                "inputs": {"pixel_values": {"dims": [{"axis": 0, "name": "batch", "min": 9, "max": 2}]}},
            },
            "inputs.pixel_values.dims.0",
            "min <= max",
        ),
        (
            {
                "name": "a",
                "factory": "zoo.models:tiny_bert",
                "inputs": {
                    "input_ids": {"dims": [{"axis": 1, "name": "seq", "min": 4, "max": 64}]},
                    "attention_mask": {"dims": [{"axis": 1, "name": "seq", "min": 4, "max": 32}]},
                },
            },
            "seq",
            "one range",
        ),
    ],
)
def test_a_bad_entry_fails_only_that_model_naming_field_and_fix(entry: dict, field: str, fix: str) -> None:
    good = {"name": "good", "factory": "zoo.models:mlp_with_fallback"}
    zoo = parse_zoo(_zoo(good, entry), source="test.yaml")
    assert [e.name for e in zoo.entries] == ["good"]
    assert len(zoo.invalid) == 1
    message = zoo.invalid[0].error
    assert field in message and fix in message, message


def test_broken_files_fail_the_whole_run(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("models: [\n")
    with pytest.raises(ZooConfigError, match="not valid YAML"):
        load_zoo(bad_yaml)
    with pytest.raises(ZooConfigError, match="cannot read zoo file"):
        load_zoo(tmp_path / "missing.yaml")
    with pytest.raises(ZooConfigError, match="expected a mapping"):
        parse_zoo([1, 2])
    with pytest.raises(ZooConfigError, match=r"zoo\.models: required field is missing"):
        parse_zoo({"modelz": []})
    with pytest.raises(ZooConfigError, match=r"settings\.task_runner"):
        parse_zoo(_zoo({"name": "a", "factory": "m:f"}, settings={"task_runner": "spark"}))
    with pytest.raises(ZooConfigError, match="used twice"):
        parse_zoo(_zoo({"name": "a", "factory": "m:f"}, {"name": "a", "factory": "m:g"}))


def test_unimportable_factories_are_named() -> None:
    with pytest.raises(
        ZooConfigError, match=r"models\[x\]\.factory: cannot import module 'no_such_pkg\.models'"
    ):
        resolve_factory("no_such_pkg.models:f", "models[x].factory")
    with pytest.raises(ZooConfigError, match=r"has no 'tiny_bret'; functions there: .*tiny_bert"):
        resolve_factory("zoo.models:tiny_bret")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_a_missing_device_is_named_with_the_fix() -> None:
    check_target("cpu")
    with pytest.raises(ZooConfigError, match=r"targets: 'cuda:3' needs a CUDA device.*targets: \[cpu\]"):
        check_target("cuda:3")


def test_input_overrides_replace_the_factory_ranges_everywhere_the_name_is_used() -> None:
    entry = ZooEntry(
        name="bert",
        factory="zoo.models:tiny_bert",
        inputs={"input_ids": {"dims": [{"axis": 0, "name": "batch", "min": 1, "max": 4}]}},
    )
    case = load_case(entry)
    shapes = case.dynamic_shapes
    # Overridden input: only the listed axis stays dynamic, with the new range.
    assert set(shapes["input_ids"]) == {0}
    assert shapes["input_ids"][0].max == 4
    # attention_mask keeps its own spec, but its 'batch' is the overridden dimension.
    assert shapes["attention_mask"][0] is shapes["input_ids"][0]
    assert shapes["attention_mask"][1].max == 64


def test_bad_overrides_name_the_input() -> None:
    unknown = ZooEntry(name="vit", factory="zoo.models:tiny_vit", inputs={"pixels": {"dims": []}})
    with pytest.raises(ZooConfigError, match=r"models\[vit\]\.inputs\.pixels: the model has no input"):
        load_case(unknown)
    outside = ZooEntry(
        name="vit",
        factory="zoo.models:tiny_vit",
        inputs={"pixel_values": {"dims": [{"axis": 0, "name": "batch", "min": 4, "max": 8}]}},
    )
    with pytest.raises(ZooConfigError, match=r"example has size 2, outside \[4, 8\]; widen the range"):
        load_case(outside)
    bad_kwargs = ZooEntry(name="vit", factory="zoo.models:tiny_vit", factory_kwargs={"depth": 3})
    with pytest.raises(ZooConfigError, match=r"factory_kwargs.*depth"):
        load_case(bad_kwargs)


def test_model_key_is_the_content_of_the_model() -> None:
    entry = ZooEntry(name="mlp", factory="zoo.models:mlp_with_fallback")
    first, second = load_case(entry), load_case(entry)
    assert weights_digest(first.model) == weights_digest(second.model)  # seeded: same weights each build
    assert model_key(entry, first) == model_key(entry, second)
    reseeded = entry.model_copy(update={"seed": 1})
    assert weights_digest(load_case(reseeded).model) != weights_digest(first.model)
    assert model_key(reseeded, load_case(reseeded)) != model_key(entry, first)
    # Building the model does not disturb the caller's random stream.
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    load_case(entry)
    assert torch.equal(torch.rand(1), expected)


def test_workspace_json_is_content_addressed_and_keeps_key_order(tmp_path: Path) -> None:
    ws = Workspace(tmp_path)
    data = {"w0": "a", "w2": "b", "w10": "c"}
    path, sha = ws.put_json("plans", data)
    assert path.name == f"{sha}.json"
    assert list(__import__("json").loads(path.read_text())) == ["w0", "w2", "w10"]
    assert ws.put_json("plans", dict(data)) == (path, sha)
    assert content_hash({"a": 1, "b": [1, 2]}) == content_hash({"b": [1, 2], "a": 1})
    assert content_hash({"a": 1}) != content_hash({"a": 2})
