"""CUDA graphs in the runtime (issue 20): runs on a GPU machine, skips elsewhere with the reason.

A graphed module answers like the uncaptured one and the eager model; outputs are fresh tensors (static
buffers on opt-in); shapes are LRU-bounded with count and pool bytes visible; a module that cannot be
captured is found by the compile-time check and runs uncaptured (``"on"``: a typed error); refit while
graphed changes the answer; calls from other streams are correct; a loaded package gets the same runtime.

    python3 -m pytest -q tests/gpu/test_cuda_graphs_gpu.py
"""

from __future__ import annotations

import pytest
import torch

import compiler
from compiler.device import to_device
from compiler.errors import CudaGraphError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]


@torch.library.custom_op("kiln_test::host_roundtrip", mutates_args=())
def host_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """A fallback op that computes on the host: a capture cannot record it."""
    return (x.cpu() * 2).to(x.device)


@host_roundtrip.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class HostOpModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(host_roundtrip(torch.relu(self.a(x))))


def _compiled(name: str, **settings):
    from zoo.models import FACTORIES

    case = FACTORIES[name]()
    model, args, kwargs = to_device(case.model, case.args, case.kwargs, device="cuda")
    program = compiler.export(model, args, kwargs, dynamic_shapes=case.dynamic_shapes)
    module = compiler.compile(program, backend="inductor", device="cuda", cache=False, **settings)
    return model, args, kwargs, module


@pytest.fixture(scope="module")
def mlp():
    return _compiled("mlp_with_fallback")


@pytest.fixture(scope="module")
def bert():
    return _compiled("tiny_bert")


def _batch(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.randn(n, *x.shape[1:], device=x.device, dtype=x.dtype)


def test_graphed_module_matches_eager_and_records_its_check(bert):
    model, args, kwargs, module = bert
    assert module.cuda_graphs.enabled, module.cuda_graphs.reason
    assert module.report.cuda_graphs["capturable"] is True
    with torch.no_grad():
        expected = model(*args, **kwargs).last_hidden_state
        for _ in range(3):  # capture, then replays
            got = module(*args, **kwargs).last_hidden_state
            torch.testing.assert_close(got, expected, rtol=2e-3, atol=2e-3)
    assert module.cuda_graphs.captured_shapes == 1
    assert module.cuda_graphs.pool_bytes > 0


def test_outputs_are_fresh_unless_static_outputs(mlp):
    _, args, _, module = mlp
    x1, x2 = args[0], _batch(args[0], args[0].shape[0])
    first = module(x1)
    kept = first.clone()
    second = module(x2)
    assert first.data_ptr() != second.data_ptr()
    torch.testing.assert_close(first, kept)  # the second call did not overwrite the first answer
    module.cuda_graphs.static_outputs = True
    try:
        a, b = module(x1), module(x2)
        assert a.data_ptr() == b.data_ptr()  # the graph's own buffer, overwritten by the next call
    finally:
        module.cuda_graphs.static_outputs = False


def test_captured_shapes_are_lru_bounded(mlp):
    model, args, _, module = mlp
    graphs = module.cuda_graphs
    graphs.clear()
    graphs.max_shapes, before = 2, graphs.evictions
    try:
        for n in (1, 2, 3, 1):
            x = _batch(args[0], n)
            torch.testing.assert_close(module(x), model(x), rtol=2e-3, atol=2e-3)
        assert graphs.captured_shapes == 2
        assert graphs.evictions - before == 2  # 1 went for 3, then 2 went for 1
        assert graphs.pool_bytes > 0
    finally:
        graphs.max_shapes = 8


def test_calls_from_other_streams_are_correct(mlp):
    model, args, _, module = mlp
    inputs = [_batch(args[0], args[0].shape[0]) for _ in range(4)]
    expected = [model(x) for x in inputs]
    streams = [torch.cuda.Stream() for _ in range(2)]
    outputs = []
    for i, x in enumerate(inputs):  # alternate streams, no synchronisation between the calls
        stream = streams[i % 2]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            outputs.append(module(x))
    torch.cuda.synchronize()
    for got, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)


def test_refit_while_graphed_changes_the_answer(mlp):
    model, args, _, module = mlp
    before = module(*args).clone()
    assert module.cuda_graphs.captured_shapes >= 1
    tuned = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    refitted = module.refit(tuned)
    after = refitted(*args)
    assert refitted.cuda_graphs.enabled and refitted.cuda_graphs.captured_shapes == 1
    assert not torch.allclose(after, before, rtol=1e-3, atol=1e-3)
    from zoo.models import mlp_with_fallback

    reference = mlp_with_fallback().model.cuda()
    reference.load_state_dict(tuned)
    torch.testing.assert_close(after, reference(*args), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(module(*args), before)  # the old module keeps its own weights


def test_refit_in_place_while_graphed_replays_the_same_capture_with_new_weights(mlp, tmp_path):
    model, args, _, module = mlp
    loaded = compiler.load(compiler.save(module, tmp_path / "m.kiln").path, trust_engine_code=True)
    before = loaded(*args).clone()
    graphs = loaded.cuda_graphs
    assert graphs.enabled and graphs.captured_shapes >= 1
    captures = graphs.captures
    tuned = {k: v + 0.05 * torch.randn_like(v) for k, v in model.state_dict().items()}
    assert loaded.refit(tuned, in_place=True) is loaded
    after = loaded(*args)
    assert graphs.captures == captures, "the refit must not cost a re-capture"
    assert not torch.allclose(after, before, rtol=1e-3, atol=1e-3)
    from zoo.models import mlp_with_fallback

    reference = mlp_with_fallback().model.cuda()
    reference.load_state_dict(tuned)
    torch.testing.assert_close(after, reference(*args), rtol=2e-3, atol=2e-3)
    # From another stream too: the replay reads the new weights there as well.
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        other = loaded(*args)
    torch.cuda.current_stream().wait_stream(stream)
    torch.testing.assert_close(other, after)


def test_uncapturable_module_runs_uncaptured_with_the_reason():
    model = HostOpModel().cuda().eval()
    x = torch.randn(4, 16, device="cuda")
    program = compiler.export(model, (x,))
    module = compiler.compile(program, backend="inductor", device="cuda", cache=False)
    assert module.report.cuda_graphs["capturable"] is False
    assert module.report.cuda_graphs["reason"]
    assert not module.cuda_graphs.enabled and "capture" in module.cuda_graphs.reason
    assert "CUDA graphs off" in module.report.summary()
    torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-4)
    with pytest.raises(CudaGraphError, match="cannot be graphed"):
        compiler.compile(program, backend="inductor", device="cuda", cache=False, cuda_graphs="on")


def test_on_and_off(mlp):
    model, args, _, _ = mlp
    program = compiler.export(model, args)
    on = compiler.compile(program, backend="inductor", device="cuda", cache=False, cuda_graphs="on")
    off = compiler.compile(program, backend="inductor", device="cuda", cache=False, cuda_graphs="off")
    assert on.cuda_graphs.enabled and not off.cuda_graphs.enabled
    torch.testing.assert_close(on(*args), off(*args), rtol=1e-4, atol=1e-4)
    assert on.cuda_graphs.captured_shapes == 1 and off.cuda_graphs.captured_shapes == 0


def test_loaded_package_gets_the_same_runtime(mlp, tmp_path):
    model, args, _, module = mlp
    compiler.save(module, tmp_path / "m.kiln")
    loaded = compiler.load(tmp_path / "m.kiln", trust_engine_code=True)
    assert loaded.report.cuda_graphs == module.report.cuda_graphs  # the check travels in the manifest
    assert loaded.cuda_graphs.enabled
    torch.testing.assert_close(loaded(*args), model(*args), rtol=2e-3, atol=2e-3)
    assert loaded.cuda_graphs.captured_shapes == 1
    off = compiler.load(tmp_path / "m.kiln", trust_engine_code=True, cuda_graphs="off")
    assert not off.cuda_graphs.enabled
    # kiln lookup and the MLflow pyfunc load through compiler.load with the manifest's mode
    # (tests/compiler/runtime/test_cuda_graphs.py checks that where MLflow is installed).


@pytest.mark.parametrize("aot", [True, False])
def test_profiles_are_captured_at_compile_and_load(tmp_path, aot):
    """The default CUDA engine (its AOTInductor package serves every shape) and the standalone form
    (``aot: false``: a static specialization per profile) both capture every profile at compile."""
    profiles = [{"batch": 1}, {"batch": 8}]
    model, args, _, module = _compiled("mlp_with_fallback", profiles=profiles, backend_options={"aot": aot})
    assert module.cuda_graphs.captured_shapes == 2  # both profiles, before any call of ours
    rows = module.report.profiles
    served = "aot" if aot else "static"
    assert all(set(r["engines"].values()) == {served} for r in rows), rows
    if not aot:  # the captured graphs replay the static specializations
        assert all(r["dispatch"].startswith("cuda graph over static specializations in") for r in rows)
    compiler.save(module, tmp_path / "p.kiln")
    loaded = compiler.load(tmp_path / "p.kiln", trust_engine_code=True)
    graphs = loaded.cuda_graphs
    assert graphs.captured_shapes == 2 and graphs.warmup_seconds > 0  # warm-up is part of load, timed
    x = _batch(args[0], 8)
    torch.testing.assert_close(loaded(x), model(x), rtol=2e-3, atol=2e-3)
    assert graphs.captured_shapes == 2  # the first call at a profile replays, no capture


@pytest.mark.parametrize("cuda_graphs", ["auto", "off"])
def test_static_specializations_answer_like_the_model_on_cuda(cuda_graphs):
    """BERT with profiles batch 1 and 8: the specializations (graphed and not) and the dynamic engine at
    batch 5 answer like the eager model; synchronised, so a faulting kernel fails here, not later."""
    model, _, kwargs, module = _compiled(  # the standalone form: the default has no specializations
        "tiny_bert",
        profiles=[{"batch": 1}, {"batch": 8}],
        cuda_graphs=cuda_graphs,
        backend_options={"aot": False},
    )
    for batch, served in ((8, "static"), (1, "static"), (5, "dynamic")):
        inputs = {k: v.repeat(batch, 1)[:batch] for k, v in kwargs.items()}  # token ids stay in range
        with torch.no_grad():
            got = module(**inputs).last_hidden_state
            torch.cuda.synchronize()
            want = model(**inputs).last_hidden_state
        torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
        if cuda_graphs == "off":
            assert set(module.last_dispatch().values()) == {served}, batch
