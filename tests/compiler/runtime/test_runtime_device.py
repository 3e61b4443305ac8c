"""The compiled module's device and input checks (issue 11 item 7, issue 14 item 13), on ONNX Runtime.

Where a model runs (``CompileOptions.device``) reaches builds, engines and the runtime; inputs that are
meta, sparse or on another device are typed errors naming the input; keywords naming positional inputs
are accepted as the eager model accepts them. The CUDA side runs in tests/gpu/test_inductor_gpu.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import compiler
from compiler.backends import get_backend
from compiler.device import program_device, program_on, to_device
from compiler.errors import BackendUnavailableError, EngineCompatibilityError, InputSpecError, PartitionError

needs_no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only machine's errors")


class Positions(nn.Module):
    """Adds positions made by a factory op: the trace records the device it ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) + torch.arange(8, device=x.device, dtype=x.dtype)


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    model = Positions().eval()
    x = torch.randn(2, 8)
    return model, x, compiler.compile(compiler.export(model, (x,)), cache=False)


def test_keyword_call_of_a_positional_input(compiled):
    model, x, module = compiled
    torch.testing.assert_close(module(x=x), model(x=x))
    with pytest.raises(InputSpecError, match="unexpected keyword inputs"):
        module(y=x)


def test_keyword_inputs_in_any_order_and_nested_inputs(compiled_zoo):
    """Single-tensor inputs skip pytree (the fast path); keyword order does not matter, and a wrong
    set of keywords still gets the full check's message."""
    case, module = compiled_zoo["tiny_bert"]
    ids, mask = case.kwargs["input_ids"], case.kwargs["attention_mask"]
    expected = module(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(module(attention_mask=mask, input_ids=ids).last_hidden_state, expected)
    with pytest.raises(InputSpecError, match="unexpected keyword inputs"):
        module(input_ids=ids, attention_mask=mask, token_type_ids=ids)
    with pytest.raises(InputSpecError):
        module(input_ids=ids)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda x: x.to("meta"), "input 'x' is a meta tensor"),
        (lambda x: x.to_sparse(), "input 'x' has layout torch.sparse_coo"),
    ],
)
def test_meta_and_sparse_inputs_are_typed_errors_naming_the_input(compiled, make, message):
    _, x, module = compiled
    with pytest.raises(InputSpecError, match=message):
        module(make(x))


def test_onnxruntime_engine_refuses_tensors_off_the_host(compiled):
    _, x, module = compiled
    call = module.graph.engine_0
    with pytest.raises(InputSpecError, match="is on meta; this engine runs on the CPU"):
        call.engine(x.to("meta"))


def test_device_is_validated_and_recorded(compiled):
    _, _, module = compiled
    assert module.device == torch.device("cpu") and module.plan.options.device == "cpu"
    with pytest.raises(PartitionError, match="is not a device"):
        compiler.CompileOptions(device="gpu0")


@needs_no_gpu
def test_cuda_on_a_cpu_only_machine_fails_clearly(compiled):
    model, x, _ = compiled
    program = compiler.export(model, (x,))
    with pytest.raises(BackendUnavailableError, match="'cuda' needs a CUDA GPU"):
        compiler.compile(program, cache=False, device="cuda")
    with pytest.raises(BackendUnavailableError, match="'cuda:1' needs a CUDA GPU"):
        get_backend("onnxruntime", device="cuda:1")
    with pytest.raises(BackendUnavailableError, match="needs a CUDA GPU"):
        to_device(model, (x,), device="cuda")


@needs_no_gpu
def test_packages_load_on_their_device_or_the_one_asked_for(compiled, tmp_path):
    model, x, module = compiled
    compiler.save(module, tmp_path / "m.kiln")
    loaded = compiler.load(tmp_path / "m.kiln")
    assert loaded.device == torch.device("cpu")
    torch.testing.assert_close(loaded(x), model(x))
    with pytest.raises(BackendUnavailableError, match="'cuda:0' needs a CUDA GPU"):
        compiler.load(tmp_path / "m.kiln", device="cuda:0")


# Made on the H100 by tests/fixtures/make_cuda_fixture.py (torch 2.11+cu130).
CUDA_PACKAGE = Path(__file__).resolve().parents[2] / "fixtures" / "packages" / "mlp-cuda-inductor.kiln"


@needs_no_gpu
def test_a_cuda_package_on_a_machine_without_a_gpu_is_a_typed_error():
    """A package compiled on the H100 (Inductor engines for cuda:0, another torch) moved here: its own
    device is not here, and its engines do not suit the CPU either; each error names what is missing."""
    import zoo.models  # noqa: F401  (the custom op its program calls)

    manifest = compiler.read_manifest(CUDA_PACKAGE)
    assert manifest.engine_target.startswith("cuda:sm_")
    with pytest.raises(BackendUnavailableError, match="'cuda:0' needs a CUDA GPU"):
        compiler.load(CUDA_PACKAGE)
    with pytest.raises(EngineCompatibilityError, match=r"built (with torch|for cuda:sm_)"):
        compiler.load(CUDA_PACKAGE, device="cpu")


def test_programs_move_with_the_devices_their_ops_name(compiled):
    model, x, _ = compiled
    program = compiler.export(*to_device(model, (x,), device="cpu")[:2])
    moved = program_on(program, torch.device("meta"))
    assert program_device(program) == torch.device("cpu") and program_device(moved) == torch.device("meta")
    devices = {str(n.kwargs.get("device")) for n in moved.graph.nodes if "device" in n.kwargs}
    assert devices == {"meta"}
    assert compiler.input_specs(moved) == compiler.input_specs(program)
    assert program_on(program, torch.device("cpu")) is program


def test_a_moved_programs_devices_are_devices_so_its_runtime_graph_is_written(compiled):
    """torch's move_to_device_pass writes the devices it moves as strings; the runtime graph a package
    loads from holds devices only as devices, so a program exported on the CPU and compiled for CUDA
    saved none and its loads read the whole program (10 s for a tiny BERT on the H200)."""
    from compiler.partitioning import runtime_graph

    model, x, _ = compiled
    moved = program_on(compiler.export(model, (x,)), torch.device("meta"))
    found = [n.kwargs["device"] for n in moved.graph.nodes if "device" in n.kwargs]
    assert found and all(isinstance(d, torch.device) and d.type == "meta" for d in found)
    plan = compiler.partition(moved, compiler.CompileOptions(min_block_size=1))
    assert runtime_graph.encode(plan.graph_module, plan.signature, plan.symbols)  # NotData if not
