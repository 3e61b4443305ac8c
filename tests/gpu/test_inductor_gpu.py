"""The CUDA side of the runtime, through the Inductor backend (issue 15): runs on a GPU machine, skips
elsewhere with the reason.

Every example-zoo model compiles with ``inductor`` on CUDA and matches eager; packages load in a fresh
process on the GPU; inputs, engine outputs and fallback ops stay on the device (no host copies during a
call); the current stream is used; refit works on the device; inputs on the wrong device are typed
errors; ONNX Runtime (CPU-only here) refuses a CUDA device up front.

    python3 -m pytest -q tests/gpu/test_inductor_gpu.py
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import compiler
from compiler.backends import get_backend
from compiler.device import to_device
from compiler.errors import BackendUnavailableError, InputSpecError

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]
ZOO = ("tiny_bert", "tiny_vit", "tiny_resnet", "tiny_gpt2", "mlp_with_fallback", "repeated_fallback")


def _case(name: str):
    from zoo.models import FACTORIES

    case = FACTORIES[name]()
    model, args, kwargs = to_device(case.model, case.args, case.kwargs, device="cuda")
    return model, args, kwargs, case.dynamic_shapes


@pytest.fixture(scope="module")
def zoo_compiled(tmp_path_factory):
    """name -> (model, args, kwargs, compiled), every zoo model compiled with Inductor on cuda."""
    cache = compiler.EngineCache(tmp_path_factory.mktemp("cache"))
    result = {}
    for name in ZOO:
        model, args, kwargs, shapes = _case(name)
        program = compiler.export(model, args, kwargs, dynamic_shapes=shapes)
        result[name] = (
            model,
            args,
            kwargs,
            compiler.compile(program, backend="inductor", device="cuda", cache=cache),
        )
    return result


@pytest.mark.parametrize("name", ZOO)
def test_zoo_model_on_cuda_matches_eager(zoo_compiled, name):
    model, args, kwargs, compiled = zoo_compiled[name]
    assert compiled.report.engine_target.startswith("cuda:sm_")
    with torch.no_grad():
        expected, actual = model(*args, **kwargs), compiled(*args, **kwargs)
    for e, a in zip(
        torch.utils._pytree.tree_leaves(expected), torch.utils._pytree.tree_leaves(actual), strict=True
    ):
        assert a.device == e.device and a.device.type == "cuda"
        torch.testing.assert_close(a, e, rtol=2e-3, atol=2e-3)
    report = compiler.validate(model, compiled, samples=3, warmup=2, runs=5)
    assert report.max_rel_l2 < 1e-3, report.to_dict()


def test_no_host_copies_during_a_call(zoo_compiled):
    """Engines, fallback ops (the custom op between engines) and outputs stay on the GPU."""
    _, args, kwargs, compiled = zoo_compiled["repeated_fallback"]
    compiled(*args, **kwargs)
    torch.cuda.synchronize()
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]
    ) as prof:
        compiled(*args, **kwargs)
        torch.cuda.synchronize()
    copies = [e.name for e in prof.events() if "Memcpy" in e.name and ("HtoD" in e.name or "DtoH" in e.name)]
    assert copies == [], copies
    assert any(a.backend == "inductor" for a in compiled.engines.values())
    assert compiled.report.fallback_ops  # the custom op ran in PyTorch, on the GPU, between engines


def test_current_stream_is_used(zoo_compiled):
    """Engines and fallback ops run on the caller's stream: correct results on a side stream, synchronised
    with that stream alone."""
    model, args, kwargs, compiled = zoo_compiled["tiny_bert"]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.no_grad():
        out = compiled(*args, **kwargs)
    side.synchronize()
    expected = model(*args, **kwargs)
    torch.testing.assert_close(out.last_hidden_state, expected.last_hidden_state, rtol=2e-3, atol=2e-3)


def test_refit_on_the_device(zoo_compiled):
    model, args, _, compiled = zoo_compiled["mlp_with_fallback"]
    tuned = {k: v + 0.01 * torch.randn_like(v) for k, v in model.state_dict().items()}
    refitted = compiled.refit({k: v.cpu() for k, v in tuned.items()})  # host weights go to the device
    reference, *_ = _case("mlp_with_fallback")
    reference.load_state_dict(tuned)
    torch.testing.assert_close(refitted(*args), reference(*args), rtol=2e-3, atol=2e-3)


def test_wrong_device_inputs_are_typed_errors(zoo_compiled):
    _, args, _, compiled = zoo_compiled["mlp_with_fallback"]
    with pytest.raises(InputSpecError, match="input 'x' is on cpu, but the model was compiled for cuda:0"):
        compiled(args[0].cpu())
    from zoo.models import mlp_with_fallback

    case = mlp_with_fallback()
    host = compiler.compile(compiler.export(case.model, case.args), cache=False)  # ONNX Runtime, on the CPU
    with pytest.raises(InputSpecError, match="is on cuda:0, but the model was compiled for cpu"):
        host(args[0])
    with pytest.raises(BackendUnavailableError, match="onnxruntime' runs on the CPU only"):
        get_backend("onnxruntime", device="cuda")


def test_packages_load_in_a_fresh_process_on_the_gpu(zoo_compiled, tmp_path):
    for name, (_, args, kwargs, compiled) in zoo_compiled.items():
        compiler.save(compiled, tmp_path / f"{name}.kiln")
        torch.save(
            {"args": [a.cpu() for a in args], "kwargs": {k: v.cpu() for k, v in kwargs.items()}},
            tmp_path / f"{name}.in",
        )
        out = compiled(*args, **kwargs)
        torch.save([t.cpu() for t in torch.utils._pytree.tree_leaves(out)], tmp_path / f"{name}.out")
    code = textwrap.dedent(
        f"""
        import time, torch, compiler
        import transformers.modeling_outputs  # output types of the zoo's transformers (trusted here)
        import zoo.models  # the custom op the fallback models call
        from pathlib import Path
        root = Path({str(tmp_path)!r})
        for name in {list(zoo_compiled)!r}:
            start = time.perf_counter()
            m = compiler.load(root / f"{{name}}.kiln", trust_engine_code=True)  # our own packages
            seconds = time.perf_counter() - start
            inputs = torch.load(root / f"{{name}}.in")
            kwargs = {{k: v.cuda() for k, v in inputs["kwargs"].items()}}
            out = m(*[a.cuda() for a in inputs["args"]], **kwargs)
            leaves = torch.utils._pytree.tree_leaves(out)
            assert all(t.device.type == "cuda" for t in leaves), name
            for a, e in zip(leaves, torch.load(root / f"{{name}}.out"), strict=True):
                torch.testing.assert_close(a.cpu(), e, rtol=1e-4, atol=1e-4)
            print(name, str(m.device), round(seconds, 2))
        """
    )
    # An engine that compiles again (its compiled graph did not load on the GPU) fails the run.
    command = [sys.executable, "-W", "error:Inductor engine", "-c", code]
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=400)
    assert done.returncode == 0, done.stderr[-4000:]
    print(done.stdout)
    assert len(done.stdout.split("\n")) > len(zoo_compiled)
