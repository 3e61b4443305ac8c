"""ONNX Runtime engines' idle threads: a module's only ONNX Runtime session may spin between calls; where
a module runs several one after another, their threads sleep (spinning ones take the cores from the
next engine: benchmarks/ort_threads.py)."""

from __future__ import annotations

import torch

import compiler
from compiler.runtime import EngineCall
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
