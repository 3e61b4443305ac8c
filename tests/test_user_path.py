"""The user's path: features run through `kiln zoo` on a zoo file, then checked on the packages read
back from disk in a fresh process (issue 32: repair and the int8 gate failed there with KeyError 'val'
while every in-process test passed).

One zoo run compiles tiny models that each exercise a feature: accuracy repair (one block overflows
fp16), int8 with its accuracy gate (one block int8 cannot represent), a fallback op between two
engines with stripped weights and shape profiles, and repeated blocks split and deduplicated. A fresh
process then loads each package from disk (a load runs from its runtime graph) and uses what a plan
read back must support: calling it, rebuilding a partition at another precision, refitting, comparing
partitions, re-saving and loading again.

The same run compiles a model registered in MLflow (a ``models:/`` source on the session's real
``mlflow server``) with Inductor's AOTInductor packages on the CPU, signed at compile: a fresh process
that holds the verification key runs it natively, with Inductor's compiler never imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from compiler.cache.local import LOCAL_DIR_ENV
from tests.fixtures import preloaded
from tests.fixtures.s3_server import BUCKET
from tests.fixtures.signing_keys import ec_key_pair
from zoo.models import sensitive_blocks

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # one `kiln zoo` of six feature models, then fresh processes on each

CHECKS = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    import compiler
    from zoo import models

    out, results = Path(sys.argv[1]), {}
    vit = Path(sys.argv[3])
    torch.manual_seed(1)
    torch.set_grad_enabled(False)
    for name, factory, kwargs in json.loads(sys.argv[2]):
        loaded = compiler.load(out / f"{name}.kiln", allowed_modules=["zoo.models"])
        case = getattr(models, factory)(**kwargs)
        x = torch.randn(3, *case.args[0].shape[1:]) if name != "int8" else case.args[0]
        got, want = loaded(x), case.model(x)
        result = {"rel_l2": float((got - want).norm() / want.norm()), "described": loaded.plan.described}
        result["precisions"] = dict(loaded.plan.options.partition_precision)
        result["partitions"] = len(loaded.plan.partitions)
        result["pad_targets"] = [t.batch for t in loaded._pad_targets if t.allowed]
        result["engines"] = len(loaded.engines)
        # What a plan read back from disk must support, as a compiled one does:
        # (an int8 package holds no float weights for its int8 partitions: rebuild a raised one, or
        # pin at int8 the one whose layers repair raised)
        raised = [p for p, v in loaded.plan.options.partition_precision.items() if v == "fp32"]
        result["float_layers"] = {p: list(v) for p, v in loaded.plan.options.float_layers.items()}
        last, level = loaded.plan.partitions[-1].name, "torch"
        if name == "int8":
            last, level = (raised[0], "torch") if raised else (next(iter(result["float_layers"])), "int8")
        rebuilt, built = compiler.rebuild(loaded, {last: level})
        result["rebuilt_rel_l2"] = float((rebuilt(x) - want).norm() / want.norm())
        try:  # an int8 package leaves out the float weights a comparison runs: a typed refusal
            comparison = compiler.compare_partitions(loaded, [x], runs=0)
            result["compared"] = sorted(row.partition for row in comparison.rows)
        except compiler.errors.PackageError as exc:
            result["compared"] = f"refused: {exc}"
        try:  # int8 scales were calibrated for these weights: new weights are a typed refusal
            refitted = loaded.refit({k: v * 1.0 for k, v in loaded.plan.program_weights.items()})
            result["refit_equal"] = bool(torch.allclose(refitted(x), got, atol=1e-6))
        except compiler.errors.RefitError:
            result["refit_equal"] = name == "int8"
        resaved = compiler.save(rebuilt, out / f"{name}.resaved.kiln").path
        again = compiler.load(resaved, allowed_modules=["zoo.models"])
        result["resaved_equal"] = bool(torch.allclose(again(x), rebuilt(x), atol=1e-6))
        results[name] = result
    # An hf: source, validated on recorded data: the package answers as transformers' model does.
    from transformers import AutoModelForImageClassification

    loaded = compiler.load(out / "vit.kiln")
    pixels = torch.randn(2, 3, 32, 32)
    want = AutoModelForImageClassification.from_pretrained(vit).eval()(pixel_values=pixels).logits
    got = loaded(pixel_values=pixels).logits
    results["vit"] = {
        "rel_l2": float((got - want).norm() / want.norm()),
        "validated_on": loaded.validation.data_source,
        "samples": loaded.validation.samples,
    }
    print(json.dumps(results))
    """
)

MODELS = [
    ("repair", "overflow_blocks", {"width": 32, "blocks": 4, "hot": 2}),
    ("int8", "sensitive_blocks", {"width": 32, "blocks": 4, "hot": 2}),
    ("fallback", "mlp_with_fallback", {"width": 16}),
    ("dedup", "repeated_fallback", {"depth": 3, "width": 16}),
]


NATIVE_CHECK = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import torch
    import compiler

    data = np.load(sys.argv[2])
    loaded = compiler.load(sys.argv[1])
    got = loaded(torch.from_numpy(data["x"]))
    print(json.dumps({
        "max_abs": float((got - torch.from_numpy(data["want"])).abs().max()),
        "dispatch": sorted(set(loaded.last_dispatch().values())),
        # A native package loads without Inductor's compiler; a standalone graph needs it.
        "inductor_imported": "torch._inductor.compile_fx" in sys.modules,
        "source": compiler.read_manifest(sys.argv[1]).source.to_json(),
    }))
    """
)


def _register_mlp(root: Path) -> None:
    """A PyTorch MLP logged in MLflow's own format (torch.export, with an input example), registered as
    kiln-user-mlp @production; its input and eager answer are kept for the check."""
    import mlflow
    import mlflow.pytorch

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    example = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    with mlflow.start_run():
        mlflow.pytorch.log_model(
            model,
            name="model",
            input_example=example,
            registered_model_name="kiln-user-mlp",
            pip_requirements=["torch"],
        )
    mlflow.MlflowClient().set_registered_model_alias("kiln-user-mlp", "production", "1")
    x = torch.randn(3, 8)
    with torch.no_grad():
        np.savez(root / "registered.npz", x=x.numpy(), want=model(x).numpy())


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory, s3_server, mlflow_server, prefect_server) -> dict:
    root = tmp_path_factory.mktemp("user-path")
    signing = ec_key_pair(root, "release")
    _register_mlp(root)
    case = sensitive_blocks()
    torch.manual_seed(0)
    np.savez(root / "recorded.npz", x=torch.randn(24, *case.args[0].shape).numpy())
    _vit_folder(root / "vit")
    np.savez(root / "pixels.npz", pixel_values=torch.randn(4, 2, 3, 32, 32).numpy())
    entries = [
        {
            "name": "repair",
            "factory": "zoo.models:overflow_blocks",
            "factory_kwargs": MODELS[0][2],
            "precision": "fp16",
            "partition": {"split_modules": "auto"},
            "on_accuracy_failure": "repair",
        },
        {
            "name": "int8",
            "factory": "zoo.models:sensitive_blocks",
            "factory_kwargs": MODELS[1][2],
            "precision": "int8",
            "partition": {"split_modules": "auto"},
            "calibration": {"data": "recorded.npz", "samples": 16},
            "validation": {"data": "recorded.npz"},
            "on_accuracy_failure": "repair",
        },
        {
            "name": "fallback",
            "factory": "zoo.models:mlp_with_fallback",
            "factory_kwargs": MODELS[2][2],
            "strip_weights": True,
            "profiles": [{"batch": 1}, {"batch": 4}, {"batch": [5, 32]}],
            "pad_to_profile": "auto",
        },
        {
            "name": "dedup",
            "factory": "zoo.models:repeated_fallback",
            "factory_kwargs": MODELS[3][2],
            "partition": {"split_modules": "auto"},
        },
        {
            "name": "vit",
            "source": "hf:./vit",
            "task": "image-classification",
            "inputs": {"pixel_values": {"dims": [{"axis": 0, "name": "batch", "min": 1, "max": 4}]}},
            "validation": {"data": "pixels.npz"},
        },
        {
            "name": "registered",
            "source": "models:/kiln-user-mlp@production",
            "backend": "inductor",
            "backend_options": {"aot": True},
        },
    ]
    settings = {
        "out_dir": "out",
        "workspace": "ws",
        "engine_cache": f"s3://{BUCKET}/user-path",  # a fleet-wide cache on object storage (moto)
        "tracking": False,
        "validation": {"samples": 2, "warmup": 0, "runs": 2},
    }
    (root / "zoo.yaml").write_text(yaml.safe_dump({"settings": settings, "models": entries}))
    # The fleet cache's local tier is this run's own, so the engines really go through the store.
    env = {**os.environ, "PYTHONPATH": str(ROOT), LOCAL_DIR_ENV: str(root / "near-cache")}
    # The processes' own temp folder: what torch's AOTInductor loader unpacks there must be gone at exit.
    (root / "tmp").mkdir()
    env["TMPDIR"] = str(root / "tmp")
    done = preloaded.run(
        [sys.executable, "-m", "flows.cli", "zoo", "zoo.yaml", "--out", "out", "--json"],
        cwd=root,
        # a release team signs; the flow reports to the suite's Prefect server (no temporary one)
        env={**env, "KILN_SIGNING_PRIVATE_KEY": str(signing.private), **prefect_server.env},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    cached = s3_server.client("s3").list_objects_v2(Bucket=BUCKET, Prefix="user-path/")
    checks = preloaded.run(  # NATIVE_CHECK's process below asserts what it imports: not forked
        [sys.executable, "-c", CHECKS, str(root / "out"), json.dumps(MODELS), str(root / "vit")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert checks.returncode == 0, checks.stderr[-3000:]
    results = json.loads(checks.stdout.strip().splitlines()[-1])
    native = subprocess.run(
        [
            sys.executable,
            "-c",
            NATIVE_CHECK,
            str(root / "out" / "registered.kiln"),
            str(root / "registered.npz"),
        ],
        env={**env, "KILN_SIGNING_PUBLIC_KEY": str(signing.public)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert native.returncode == 0, native.stderr[-3000:]
    results["registered"] = json.loads(native.stdout.strip().splitlines()[-1])
    return {"root": root, "results": results, "cached": [o["Key"] for o in cached.get("Contents", [])]}


def _vit_folder(path: Path) -> None:
    """A tiny ViT classifier with random weights, written as a user's save_pretrained folder."""
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=3,
    )
    ViTForImageClassification(config).eval().save_pretrained(path)


def test_every_package_read_back_runs_rebuilds_refits_compares_and_resaves(zoo_run):
    for name, result in zoo_run["results"].items():
        if name in ("vit", "registered"):
            continue
        assert not result["described"] or name == "int8", name  # a load runs from the runtime graph
        # rebuilt with its last partition in torch (int8: at the gate's own tolerance, 0.1)
        assert result["rebuilt_rel_l2"] < (1e-1 if name == "int8" else 5e-2), (name, result)
        assert result["compared"] and ("int8_weights_only" in result["compared"]) == (name == "int8"), name
        assert result["refit_equal"] and result["resaved_equal"], (name, result)


def test_repair_through_the_zoo_raised_the_overflowing_block_alone(zoo_run):
    result = zoo_run["results"]["repair"]
    assert list(result["precisions"].values()) == ["fp32"], result
    assert result["rel_l2"] < 2e-2


def test_the_int8_gate_through_the_zoo_raised_the_sensitive_block(zoo_run):
    result = zoo_run["results"]["int8"]
    # Layers first (issue 46): the sensitive block stays int8 with layers of it alone in fp32, or, where
    # no set of its layers passes, it is raised whole.
    raised = [p for p, v in result["precisions"].items() if v == "fp32"]
    assert len(result["float_layers"]) + len(raised) == 1, result
    assert result["rel_l2"] < 1e-1  # the int8 gate's tolerance


def test_split_blocks_share_engines_and_fallback_runs_between_engines(zoo_run):
    results = zoo_run["results"]
    assert results["dedup"]["engines"] < results["dedup"]["partitions"], results["dedup"]
    assert results["fallback"]["rel_l2"] < 1e-5 and results["dedup"]["rel_l2"] < 1e-5
    # pad_to_profile survived the zoo and the package: a batch of 3 pads up to the profile of 4
    assert 4 in results["fallback"]["pad_targets"], results["fallback"]


def test_an_hf_source_validated_on_recorded_data_answers_as_transformers_does(zoo_run):
    result = zoo_run["results"]["vit"]
    assert result["rel_l2"] < 1e-4, result
    assert "pixels.npz sha256:" in result["validated_on"] and result["samples"] == 4, result


def test_engines_went_to_the_object_store_cache(zoo_run):
    keys = zoo_run["cached"]
    assert any(k.startswith("user-path/blobs/") for k in keys), keys[:5]
    assert any(k.startswith("user-path/entries/") for k in keys), keys[:5]


def test_a_registered_model_compiled_with_aot_runs_natively_where_its_signature_verifies(zoo_run):
    result = zoo_run["results"]["registered"]
    assert result["max_abs"] < 1e-5, result  # answers as the model MLflow holds
    assert result["dispatch"] == ["aot"] and not result["inductor_imported"], result
    assert "models:/kiln-user-mlp" in json.dumps(result["source"]), result["source"]
    # The zoo validated it, the checks and NATIVE_CHECK loaded it: each unpacked copy was removed at exit
    # (compiler.backends.inductor.aot: a loader still held at exit used to leave its folder).
    left = sorted(p.name for p in (zoo_run["root"] / "tmp").glob("aotinductor_*"))
    assert not left, left
