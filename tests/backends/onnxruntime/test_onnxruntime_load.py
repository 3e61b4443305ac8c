"""Loading ONNX Runtime engines: float weights handed over from memory (no serialize and parse of the
whole model), integer buffers written in (shape inference may read them), and the same answers either
way; idle threads: a module's only session may spin between calls, several sessions sleep (spinning
ones take the cores from the next engine: benchmarks/ort_threads.py)."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import compiler
from compiler.errors import BuildSettingsError
from compiler.runtime.module import EngineCall
from zoo.models import repeated_fallback


def _spinning(module: compiler.CompiledModule) -> list[str]:
    """Each ONNX Runtime session's allow_spinning entry ("default" where none is set)."""
    values = []
    for call in module.graph.children():
        if isinstance(call, EngineCall):
            options = call.engine.session.get_session_options()
            try:
                values.append(options.get_session_config_entry("session.intra_op.allow_spinning"))
            except RuntimeError:  # not set: ONNX Runtime's default, spinning
                values.append("default")
    return values


def test_several_sessions_sleep_and_a_lone_one_spins_also_after_a_load(tmp_path):
    case = repeated_fallback(depth=3, width=16)
    program = compiler.export(case.model, case.args)
    split = compiler.compile(program, cache=False)
    assert len(_spinning(split)) > 1 and set(_spinning(split)) == {"0"}
    x = case.args[0]
    torch.testing.assert_close(split(x), case.model(x), rtol=1e-5, atol=1e-5)
    loaded = compiler.load(compiler.save(split, tmp_path / "split.kiln").path, allowed_modules=["zoo"])
    assert set(_spinning(loaded)) == {"0"}

    lone = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    single = compiler.compile(compiler.export(lone, (torch.randn(3, 8),)), cache=False)
    assert _spinning(single) == ["default"]


class SlicedPositions(torch.nn.Module):
    """An int64 buffer sliced (as BERT's position ids): an integer weight, written into the model,
    beside float weights handed over from memory."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("positions", torch.arange(64).expand((1, -1)))  # as BERT's position ids
        self.table, self.fc = torch.nn.Embedding(64, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x + self.table(self.positions[:, 0 : x.shape[1]]))


def test_weights_from_memory_answer_like_the_model_beside_an_integer_buffer(tmp_path):
    torch.manual_seed(0)
    model = SlicedPositions().eval()
    x = torch.randn(2, 10, 16)
    program = compiler.export(model, (x,), dynamic_shapes={"x": {0: Dim("batch", min=1, max=8)}})
    for strip in (False, True):
        compiled = compiler.compile(program, cache=False, strip_weights=strip)
        loaded = compiler.load(compiler.save(compiled, tmp_path / f"m{strip}.kiln").path)
        for batch in (1, 2, 8):
            y = torch.randn(batch, 10, 16)
            torch.testing.assert_close(loaded(y), model(y), rtol=1e-5, atol=1e-5)


def test_sessions_take_their_thread_count_from_the_operator(monkeypatch):
    lone = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    program = compiler.export(lone, (torch.randn(3, 8),))
    monkeypatch.setenv("KILN_ORT_THREADS", "1")
    module = compiler.compile(program, cache=False)
    (call,) = [c for c in module.graph.children() if isinstance(c, EngineCall)]
    assert call.engine.session.get_session_options().intra_op_num_threads == 1
    x = torch.randn(3, 8)
    torch.testing.assert_close(module(x), lone(x), rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("KILN_ORT_THREADS", "four")
    with pytest.raises(BuildSettingsError, match="KILN_ORT_THREADS='four'"):
        compiler.compile(program, cache=False)
