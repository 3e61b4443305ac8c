"""The zoo file schema, compile requests and the factory source: bad input is named with its field and fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from compiler.options import CompileOptions
from compiler.validation.report import Tolerances
from tasks.workspace import Workspace, compile_key, content_hash
from zoo.config import ZooEntry
from zoo.errors import UntrustedCodeError, ZooConfigError
from zoo.preflight import check_device, check_memory, preflight
from zoo.settings import ZooSettings
from zoo.sources.factory import FactoryPolicy, resolve_factory
from zoo.zoo_file import load_zoo, parse_zoo

TRUSTED = FactoryPolicy()


def load_case(entry: ZooEntry):
    return entry.requests()[0].load_case()


def weights_digest(model: torch.nn.Module) -> str:
    return content_hash({k: v.detach().numpy().tobytes().hex() for k, v in model.state_dict().items()})


ROOT = Path(__file__).resolve().parents[2]


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
    assert all(e.backend == "onnxruntime" and e.devices == ["cpu"] for e in zoo.entries)
    for entry in zoo.entries:
        resolve_factory(entry.factory, TRUSTED)  # importable from the repository root


@pytest.mark.parametrize(
    ("entry", "field", "fix"),
    [
        ({"name": "a", "factory": "zoo.models:tiny_vit", "backend": "onnxrt"}, "backend", "use one of"),
        ({"name": "a", "factory": "zoo.models:tiny_vit", "precison": "fp16"}, "precison", "unknown field"),
        ({"name": "a", "factory": "zoo.models:tiny_vit", "precision": "fp64"}, "precision", "fp32"),
        ({"name": "a", "factory": "zoo.models.tiny_vit"}, "factory", "module:function"),
        ({"name": "a" * 300, "factory": "zoo.models:tiny_vit"}, "name", "at most 100"),
        ({"name": "a", "factory": "zoo.models:tiny_vit", "targets": ["gpu0"]}, "targets", "cuda:N"),
        ({"name": "a", "factory": "zoo.models:tiny_vit", "tolerances": {"rel_l3": 1}}, "rel_l3", "unknown"),
        ({"name": "a", "factory": "zoo.models:tiny_vit", "workspace_bytes": 0}, "workspace_bytes", "greater"),
        (
            {"name": "a", "factory": "zoo.models:tiny_vit", "on_build_failure": "onnxruntime"},
            "on_build_failure",
            "cannot fall back",
        ),
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
        (
            {"name": "a", "factory": "zoo.models:tiny_llama_lm", "task": "text-generation"},
            "generation",
            "max_batch",
        ),
        (
            {
                "name": "a",
                "factory": "zoo.models:tiny_llama_lm",
                "task": "text-generation",
                "generation": {"max_cache_len": 16, "prompt_length": {"max": 16}},
            },
            "max_cache_len",
            "above prompt_length.max",
        ),
        (
            {
                "name": "a",
                "factory": "zoo.models:tiny_llama_lm",
                "task": "text-generation",
                "generation": {"max_cache_len": 32, "prompt_length": {"max": 16}},
                "inputs": {"input_ids": {"dims": []}},
            },
            "inputs",
            "generation.prompt_length",
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
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 20000)
    with pytest.raises(ZooConfigError, match="nested deeper than 64 levels"):
        load_zoo(deep)
    with pytest.raises(ZooConfigError, match="used twice"):
        parse_zoo(_zoo({"name": "a", "factory": "m:f"}, {"name": "a", "factory": "m:g"}))


def test_unimportable_factories_are_named() -> None:
    with pytest.raises(
        ZooConfigError, match=r"models\[x\]\.factory: cannot import module 'no_such_pkg\.models'"
    ):
        resolve_factory("no_such_pkg.models:f", FactoryPolicy(("no_such_pkg",)), "models[x].factory")
    with pytest.raises(ZooConfigError, match=r"has no 'tiny_bret'; functions there: .*tiny_bert"):
        resolve_factory("zoo.models:tiny_bret", TRUSTED)


@pytest.mark.parametrize(
    ("factory", "why"),
    [
        ("os:system", "standard library"),
        ("subprocess:run", "standard library"),
        ("builtins:eval", "standard library"),
        ("numpy:zeros", "not trusted for factories"),
        ("zoo.models:Dim", "not a function defined in 'zoo.models'"),
    ],
)
def test_a_factory_outside_the_trusted_packages_never_runs(factory: str, why: str, tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    zoo = parse_zoo(
        _zoo({"name": "evil", "factory": factory, "factory_kwargs": {"command": f"touch {marker}"}})
    )
    request = zoo.requests(zoo.entries[0])[0]
    with pytest.raises(UntrustedCodeError, match=why):
        preflight(request)  # what --check and the flows run before anything else
    with pytest.raises(UntrustedCodeError, match=why):
        request.load_case()
    assert not marker.exists()


def test_factories_in_the_zoo_files_own_directory_or_listed_packages_are_trusted(tmp_path: Path) -> None:
    (tmp_path / "my_models.py").write_text(
        "from zoo.models import mlp_with_fallback\n\ndef small(width=16, seed=0):\n"
        "    return mlp_with_fallback(width=width, seed=seed)\n"
    )
    zoo_file = tmp_path / "zoo.yaml"
    zoo_file.write_text("models:\n  - {name: mine, factory: 'my_models:small'}\n")
    zoo = load_zoo(zoo_file)
    case = zoo.requests(zoo.entries[0])[0].load_case()
    assert case.model(torch.randn(2, 16)).shape == (2, 16)
    # Elsewhere the same module is not trusted unless its package is listed.
    elsewhere = parse_zoo(_zoo({"name": "mine", "factory": "my_models:small"}))
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(UntrustedCodeError, match="factory_packages"):
            elsewhere.requests(elsewhere.entries[0])[0].identity()
        listed = parse_zoo(
            _zoo({"name": "mine", "factory": "my_models:small"}, settings={"factory_packages": ["my_models"]})
        )
        assert listed.requests(listed.entries[0])[0].identity().kind == "factory"
    finally:
        sys.path.remove(str(tmp_path))


def test_yaml_aliases_are_refused_at_parse_time(tmp_path: Path) -> None:
    bomb = tmp_path / "bomb.yaml"
    lines = ["a: &a [x, x, x, x, x, x, x, x, x]"]
    lines += [
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]" for i in range(8)
    ]
    bomb.write_text("\n".join(lines) + "\nmodels: [*i]\n")
    with pytest.raises(ZooConfigError, match="anchors and aliases"):
        load_zoo(bomb)


def test_a_zoo_file_that_is_not_utf8_is_a_zoo_error(tmp_path: Path) -> None:
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("models:\n  - {name: caf\xe9, factory: 'zoo.models:tiny_vit'}\n".encode("latin-1"))
    with pytest.raises(ZooConfigError, match="not UTF-8"):
        load_zoo(latin)


def test_an_entry_is_one_typed_request_per_device_with_every_option() -> None:
    entry = ZooEntry.model_validate(
        {
            "name": "bert",
            "factory": "zoo.models:tiny_bert",
            "precision": "fp16",
            "devices": ["cpu", "cuda:1"],
            "workspace_bytes": 1 << 30,
            "optimization_level": 3,
            "backend_options": {"refit": "identical"},
            "partition": {"min_block_size": 2, "split_modules": ["BertLayer"]},
            "tolerances": {"max_abs": 0.5},
        }
    )
    cpu, cuda = entry.requests()
    assert isinstance(cpu.options, CompileOptions) and cpu.device == "cpu" and cuda.device == "cuda:1"
    assert cuda.options.device == "cuda:1" and cuda.package_name == "bert-cuda1"
    assert cpu.options.workspace_bytes == 1 << 30 and cpu.options.optimization_level == 3
    assert cpu.options.backend_options == {"refit": "identical"} and cpu.options.split_modules == (
        "BertLayer",
    )
    # Tolerances: the entry's, with rel_l2 from the precision's default.
    assert cpu.tolerances == Tolerances(rel_l2=2e-2, max_abs=0.5)
    assert cpu.to_dict()["source"] == "factory:zoo.models:tiny_bert"
    # split_modules 'auto' (the word kiln compile --split-module auto passes) is auto, not a class name.
    auto = {"name": "a", "factory": "zoo.models:tiny_vit", "partition": {"split_modules": "auto"}}
    assert ZooEntry.model_validate(auto).requests()[0].options.split_modules == "auto"
    as_flag = {**auto, "partition": {"split_modules": ["auto"]}}  # kiln compile --split-module auto
    assert ZooEntry.model_validate(as_flag).requests()[0].options.split_modules == "auto"
    # 'targets' is the older spelling of devices.
    assert ZooEntry.model_validate(
        {"name": "a", "factory": "zoo.models:tiny_vit", "targets": ["cpu"]}
    ).devices == ["cpu"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_a_missing_device_is_named_with_the_fix() -> None:
    check_device("cpu")
    with pytest.raises(ZooConfigError, match=r"devices: 'cuda:3' needs a CUDA device.*devices: \[cpu\]"):
        check_device("cuda:3")


def test_absurd_input_ranges_are_refused_before_anything_is_built() -> None:
    entry = ZooEntry.model_validate(
        {
            "name": "mlp",
            "factory": "zoo.models:mlp_with_fallback",
            "inputs": {"x": {"dims": [{"axis": 0, "name": "batch", "min": 1, "max": 10**12}]}},
        }
    )
    with pytest.raises(ZooConfigError, match=r"input 'x' alone takes .* GiB.*lower the dims' max"):
        preflight(entry.requests()[0], load=True)
    check_memory("small", {"x": 1 << 20}, available=1 << 30)


def test_the_engine_cache_is_the_zoo_files_else_the_environments_else_the_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("KILN_CACHE_DIR", raising=False)
    assert ZooSettings().engine_cache_choice()[1] == "default"
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "env"))
    assert ZooSettings().engine_cache_choice() == (str(tmp_path / "env"), "$KILN_CACHE_DIR")
    chosen = ZooSettings(engine_cache=str(tmp_path / "zoo")).engine_cache_choice()
    assert chosen == (str(tmp_path / "zoo"), "settings.engine_cache")
    assert ZooSettings(engine_cache=False).engine_cache_dir() is None


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


def test_the_compile_key_is_the_identity_of_the_source_without_loading_it() -> None:
    entry = ZooEntry(name="mlp", factory="zoo.models:mlp_with_fallback")
    first, second = load_case(entry), load_case(entry)
    assert weights_digest(first.model) == weights_digest(second.model)  # seeded: same weights each build
    assert compile_key(entry.requests()[0]) == compile_key(entry.requests()[0])
    reseeded = entry.model_copy(update={"seed": 1})
    assert weights_digest(load_case(reseeded).model) != weights_digest(first.model)
    assert compile_key(reseeded.requests()[0]) != compile_key(entry.requests()[0])
    fp16 = entry.model_copy(update={"precision": "fp16"})
    assert compile_key(fp16.requests()[0]) != compile_key(entry.requests()[0])
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


def test_recorded_validation_data_is_part_of_the_compile_key(tmp_path: Path) -> None:
    import numpy as np

    data = tmp_path / "recorded.npz"
    np.savez(data, x=np.zeros((2, 3, 64), "float32"))
    zoo_file = tmp_path / "zoo.yaml"
    zoo_file.write_text(
        "models:\n  - {name: m, factory: 'zoo.models:mlp_with_fallback', validation: {data: recorded.npz}}\n"
    )
    zoo = load_zoo(zoo_file)
    request = zoo.requests(zoo.entries[0])[0]
    assert request.validation.data == str(data)  # relative to the zoo file
    before = compile_key(request)
    np.savez(data, x=np.ones((2, 3, 64), "float32"))  # edited in place: validate again
    assert compile_key(request) != before


def test_recorded_fields_the_model_does_not_take_are_refused_naming_the_zoo_option(tmp_path: Path) -> None:
    """Recorded as a BERT tokenizer writes them, for a model that takes no token_type_ids (dropped, or
    an architecture without them): the entry's ``validation.ignore_fields`` / ``calibration.ignore_fields``
    leaves the field out; without it the error names the field and that option."""
    import numpy as np

    from compiler.errors import ValidationDataError
    from compiler.inputs.specs import InputSpec

    ids = np.random.randint(0, 50, (3, 2, 8))
    np.savez(tmp_path / "rec.npz", input_ids=ids, attention_mask=np.ones_like(ids), token_type_ids=0 * ids)
    dims = {0: "batch", 1: "seq"}
    specs = tuple(
        InputSpec(n, "int64", (1, 1), (2, 8), (8, 32), dims, (0, 49)) for n in ("input_ids", "attention_mask")
    )
    entry = {"name": "m", "factory": "zoo.models:tiny_bert", "validation": {"data": "rec.npz"}}
    plan = ZooEntry.model_validate(entry).requests(zoo_dir=str(tmp_path))[0].validation
    with pytest.raises(ValidationDataError) as exc:
        plan.dataset(specs)
    message = str(exc.value)
    assert message.startswith(f"validation.data: {tmp_path / 'rec.npz'}: field(s) ['token_type_ids']")
    assert message.endswith("or list them in validation.ignore_fields: ['token_type_ids']")

    entry["validation"]["ignore_fields"] = ["token_type_ids"]
    ignoring = ZooEntry.model_validate(entry).requests(zoo_dir=str(tmp_path))[0]
    assert len(ignoring.validation.dataset(specs)) == 3
    assert (
        ignoring.cache_identity()
        != ZooEntry.model_validate({**entry, "validation": {"data": "rec.npz"}})
        .requests(zoo_dir=str(tmp_path))[0]
        .cache_identity()
    )
    calibrated = {
        **entry,
        "precision": "int8",
        "calibration": {"data": "rec.npz", "ignore_fields": ["token_type_ids"]},
    }
    options = ZooEntry.model_validate(calibrated).requests(zoo_dir=str(tmp_path))[0].options
    assert options.calibration.ignore_fields == ("token_type_ids",)
    assert CompileOptions.from_dict(options.to_dict()) == options  # travels in packages

    # Without recorded data there is nothing to leave out.
    zoo = parse_zoo(
        _zoo({"name": "n", "factory": "zoo.models:tiny_bert", "validation": {"ignore_fields": ["x"]}})
    )
    assert "ignore_fields applies to recorded data" in zoo.invalid[0].error


def test_a_generation_entry_is_one_request_with_its_plan(tmp_path: Path) -> None:
    entry = ZooEntry(
        name="gen",
        factory="zoo.models:tiny_llama_lm",
        task="text-generation",
        generation={
            "max_batch": 4,
            "max_cache_len": 48,
            "prompt_length": {"min": 2, "max": 24},
            "validation": {"prompts": "prompts.safetensors"},
        },
    )
    (request,) = entry.requests(zoo_dir=str(tmp_path))
    plan = request.generation
    assert (plan.max_batch, plan.max_cache_len, plan.prompt_min, plan.prompt_max) == (4, 48, 2, 24)
    assert plan.prompts == str(tmp_path / "prompts.safetensors")
    assert request.options.strip_weights  # engines hold no weights: the programs share one copy
    assert request.to_dict()["generation"]["max_cache_len"] == 48
    decode = request.for_program("decode")
    assert decode.generation.program == "decode" and compile_key(decode) != compile_key(request)

    # perplexity's tolerance: by the loosest precision compiled, unless the entry states one
    def tolerance(**fields) -> float:
        gen = {"max_cache_len": 48, "prompt_length": {"max": 24}, **fields.pop("generation", {})}
        one = ZooEntry(
            name="g", factory="zoo.models:tiny_llama_lm", task="text-generation", generation=gen, **fields
        )
        return one.requests(zoo_dir=str(tmp_path))[0].generation.perplexity_rel_tol

    assert plan.perplexity_rel_tol == tolerance() == 1e-4  # fp32
    assert tolerance(precision="fp16") == 2e-3
    assert tolerance(precision="fp16", partition={"precision": {"engine_0": "bf16"}}) == 1.6e-2
    assert tolerance(precision="bf16", generation={"validation": {"perplexity_rel_tol": 0.05}}) == 0.05


def test_the_decode_program_takes_its_backends_bandwidth_bound_options(tmp_path: Path) -> None:
    """Inductor's record autotunes a CUDA decode program's GEMMs (matrix-vector products that read every
    weight per token) and gives batch 1 its own static engine; the prefill program, the CPU and what an
    operator set are left as they are."""

    def programs(**fields) -> dict[str, CompileOptions]:
        entry = ZooEntry(
            name="gen",
            factory="zoo.models:tiny_llama_lm",
            task="text-generation",
            generation={"max_batch": 2, "max_cache_len": 32, "prompt_length": {"min": 1, "max": 8}},
            **fields,
        )
        (request,) = entry.requests(zoo_dir=str(tmp_path))
        return {p: request.for_program(p).options for p in ("prefill", "decode")}

    cuda = programs(backend="inductor", devices=["cuda"], backend_options={"aot": False})
    assert dict(cuda["decode"].backend_options) == {
        "aot": False,
        "mode": "max-autotune-no-cudagraphs",
        "compile_options": {"triton.enable_pdl": True},
    }
    assert cuda["decode"].profiles == ({"batch": 1},)
    assert dict(cuda["prefill"].backend_options) == {"aot": False} and cuda["prefill"].profiles == ()
    cpu = programs(backend="inductor")["decode"]
    assert not cpu.backend_options and not cpu.profiles  # the CPU: no autotuning, no specialization
    assert not programs(backend="onnxruntime", devices=["cuda"])["decode"].backend_options
    own = programs(
        backend="inductor", devices=["cuda"], backend_options={"mode": "default"}, profiles=[{"batch": 2}]
    )["decode"]
    assert own.profiles == ({"batch": 2},)  # the operator's keys win; the keys they left get the record's
    assert dict(own.backend_options) == {"mode": "default", "compile_options": {"triton.enable_pdl": True}}


def test_a_decode_program_built_at_fp16_by_inductor_is_traced_with_kilns_attention_op(tmp_path: Path) -> None:
    """The zoo exports the model in fp32 and builds at the entry's precision: a decode program for an
    engine that keeps kiln's ops (Inductor's record) at fp16/bf16 is told to trace the op (its Triton
    kernels run on CUDA; found on the H100: every zoo package held the ATen form); fp32 entries and
    ONNX backends trace the ATen form. The CPU traces ATen whatever it is told (no kernels there)."""

    def told(**fields) -> bool | None:
        gen = {"max_batch": 2, "max_cache_len": 32, "prompt_length": {"min": 1, "max": 8}}
        entry = ZooEntry(
            name="g", factory="zoo.models:tiny_llama_lm", task="text-generation", generation=gen, **fields
        )
        return entry.requests(zoo_dir=str(tmp_path))[0].for_program("decode").load_case().model.attention_op

    assert told(backend="inductor", precision="fp16") is True
    assert told(backend="inductor", precision="bf16") is True
    assert told(backend="inductor") is False  # fp32 keeps ATen's exact products
    assert told(backend="onnxruntime", precision="fp16") is False
