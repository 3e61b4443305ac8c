"""A new backend is one package plus one record: ``torchgraph`` (beside this file, nothing under
``compiler/``) compiles, runs, saves, loads and refits through kiln's own pipeline once its record is
registered, and every backend rule kiln applies to it comes from that record."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

import compiler
from compiler.backends import get_backend
from compiler.backends.base import graph_format
from compiler.backends.capabilities import backend_help, backend_names, capabilities, register, unregister
from compiler.errors import BackendError, CudaGraphError, OptionsError
from tests.backends.torchgraph.torchgraph_backend import NAME, RECORD, TorchGraphBackend

ROOT = Path(__file__).resolve().parents[3]


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.fixture(scope="module")
def registered():
    register(RECORD)
    yield RECORD
    unregister(NAME)


@pytest.fixture(scope="module")
def compiled(registered, tmp_path_factory):
    torch.manual_seed(0)
    model, x = Mlp().eval(), torch.randn(3, 8)
    program = compiler.export(model, (x,), dynamic_shapes=({0: torch.export.Dim("batch", max=32)},))
    cache = tmp_path_factory.mktemp("cache")
    return model, x, compiler.compile(program, backend=NAME, strip_weights=True, cache=cache)


def test_it_compiles_runs_saves_and_loads_through_the_pipeline(compiled, tmp_path):
    model, x, module = compiled
    engines = [a for a in module.engines.values() if a.is_engine]
    assert engines and {a.backend for a in engines} == {NAME}
    torch.testing.assert_close(module(x), model(x))
    torch.testing.assert_close(module(torch.randn(5, 8)).shape, torch.Size([5, 4]))
    compiler.save(module, tmp_path / "m.kiln")
    again = compiler.load(tmp_path / "m.kiln")
    assert compiler.read_manifest(tmp_path / "m.kiln").backend == NAME
    torch.testing.assert_close(again(x), model(x))
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    model.load_state_dict(state)
    torch.testing.assert_close(again.refit(state)(x), model(x))


def test_every_backend_rule_comes_from_its_record(registered):
    backend = get_backend(NAME)
    assert isinstance(backend, TorchGraphBackend) and isinstance(backend, compiler.backends.EngineBackend)
    assert graph_format(backend) == backend.graph_format == "torch.export"
    options = compiler.CompileOptions(backend=NAME, profiles=({"batch": 1}, {"batch": (2, 8)}))
    assert options.build_settings().profiles == ()  # its policy "none", not TensorRT's "all"
    with pytest.raises(OptionsError, match=r"precision int8: backend 'torchgraph' has no int8 build here"):
        compiler.CompileOptions(backend=NAME, precision="int8")
    compiler.CompileOptions(backend=NAME, device="cuda", cuda_graphs="on")  # it captures: no refusal
    assert NAME in backend_names() and NAME in backend_help()


def test_unregistered_it_is_refused_by_name_and_kiln_keeps_its_own(registered):
    unregister(NAME)
    try:
        with pytest.raises(OptionsError, match=r"backend 'torchgraph' is not a backend; expected one of"):
            compiler.CompileOptions(backend=NAME)
        with pytest.raises(BackendError, match="one of kiln's own"):
            unregister("onnxruntime")
        with pytest.raises(CudaGraphError, match="ONNX Runtime runs its engines on its own streams"):
            compiler.CompileOptions(backend="onnxruntime", device="cuda", cuda_graphs="on")
    finally:
        register(RECORD)
    assert capabilities(NAME) is RECORD


def test_compiler_names_no_backend_of_its_own_outside_the_table():
    # Adding this backend touched this folder only: nothing under compiler/ names it.
    found = subprocess.run(
        ["grep", "-rl", "--include=*.py", NAME, "compiler"], cwd=ROOT, capture_output=True, text=True
    )
    assert found.stdout == ""
