"""Every weight a package holds is the dtype and shape its program takes, checked at load
(compiler.package.reading.check_weight_specs), as an attacker with write access (no signing key) would
try it: the weights file rewritten, its checksum and the content hash made to agree again.

Engines check the weights they are given; a weight only PyTorch reads (a fallback op) was used as it
came, and the package loaded, then failed at its first call with torch's own error."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch._export.serde.serialize import _SERIALIZE_TO_TORCH_DTYPE

import compiler
from compiler.errors import PackageCorruptError
from compiler.package.manifest import RUNTIME_GRAPH, WEIGHTS
from compiler.package.reading import SCHEMA_DTYPES
from tests.fixtures import preloaded
from zoo.models import mlp_with_fallback

ROOT = Path(__file__).resolve().parents[3]
FORMAT1 = ROOT / "tests" / "fixtures" / "packages" / "mlp-format1-2026-11.kiln"
KEY = "head.0.weight"  # (64, 64) float32; in the fallback package only PyTorch reads it

REWRITES = {
    "same bytes as int32": lambda t: t.view(torch.int32),
    "float16": lambda t: t.half(),
    "float64": lambda t: t.double(),
    "flattened": lambda t: t.reshape(-1),
    "one row short": lambda t: t[:-1].clone(),
}


def test_the_archive_dtype_table_is_the_one_torch_export_load_reads():
    assert SCHEMA_DTYPES == _SERIALIZE_TO_TORCH_DTYPE


@pytest.fixture(scope="module")
def fallback_package(tmp_path_factory) -> Path:
    """mlp_with_fallback with its linears run by PyTorch: its head's weights reach no engine."""
    case = mlp_with_fallback()
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    compiled = compiler.compile(program, compiler.CompileOptions(torch_executed_ops=["aten.linear.default"]))
    assert all(KEY not in (i.weight_key for i in p.inputs) for p in compiled.plan.partitions)
    return compiler.save(compiled, tmp_path_factory.mktemp("fallback") / "mlp.kiln").path


def _rewrite(path: Path, rewrite, reseal) -> None:
    weights = safetensors.torch.load_file(path / WEIGHTS)
    weights[KEY] = rewrite(weights[KEY])
    safetensors.torch.save_file(weights, path / WEIGHTS)
    reseal(path)


@pytest.mark.parametrize("how", sorted(REWRITES))
def test_a_fallback_weight_rewritten_is_refused_at_load_naming_it(
    tmp_path, fallback_package, copy_package, reseal, how
):
    assert (fallback_package / RUNTIME_GRAPH).exists()  # the light load: the program is not read
    x = torch.randn(3, 64)
    expected = compiler.load(fallback_package)(x)
    path = copy_package(fallback_package, tmp_path / "mlp.kiln")
    _rewrite(path, REWRITES[how], reseal)
    with pytest.raises(
        PackageCorruptError, match=rf"holds '{KEY}' as .* its program takes float32 \[64, 64\]"
    ):
        compiler.load(path)
    _rewrite(path, lambda t: compiler.load(fallback_package).weights[KEY].clone(), reseal)
    torch.testing.assert_close(compiler.load(path)(x), expected, rtol=0, atol=0)  # the check refuses no more


def test_a_package_without_a_runtime_graph_is_checked_against_its_program(tmp_path, copy_package, reseal):
    """A format-1 package is loaded from its program (no runtime_graph.json): the same check."""
    path = copy_package(FORMAT1, tmp_path / "old.kiln")
    compiler.load(path)
    key = sorted(safetensors.torch.load_file(path / WEIGHTS))[0]
    weights = safetensors.torch.load_file(path / WEIGHTS)
    weights[key] = weights[key].double()
    safetensors.torch.save_file(weights, path / WEIGHTS)
    reseal(path)
    with pytest.raises(PackageCorruptError, match=rf"holds '{key}' as float64 .* its program takes float32"):
        compiler.load(path)


def test_the_cli_refuses_it_in_a_fresh_process_with_a_typed_error(
    tmp_path, fallback_package, copy_package, reseal
):
    path = copy_package(fallback_package, tmp_path / "mlp.kiln")
    _rewrite(path, REWRITES["float16"], reseal)
    env = {**os.environ, "PYTHONPATH": preloaded.python_path()}
    command = [
        sys.executable,
        "-m",
        "flows.cli",
        "debug",
        "compare",
        str(path),
        "--allow-op-module",
        "zoo.models",
    ]
    done = preloaded.run(
        [*command, "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 2, (done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr
    assert f"error: PackageCorruptError: {path}: {WEIGHTS} holds '{KEY}' as float16 [64, 64]" in done.stderr
