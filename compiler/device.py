"""Devices: where a model runs (``cpu``, ``cuda``, ``cuda:N``), resolved and checked once.

``CompileOptions.device`` names it; this module turns the name into a ``torch.device`` that exists
here (or a :class:`~compiler.errors.BackendUnavailableError` that says what is missing), moves a model
and its example inputs there before export (:func:`to_device`), and moves an exported program whose
weights live elsewhere (:func:`program_on`). Engines are bound to the device by
``compiler.backends.get_backend(name, device=...)``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from compiler.device_name import check_device
from compiler.errors import BackendUnavailableError


def warm_device(device: torch.device) -> None:
    """Make ready, on the calling (worker) thread, what a CUDA model's first call would otherwise wait
    for: the device's context (0.3-0.4 s on the H200) and cuBLAS, whose first matmul in a process took
    0.1-0.19 s there; a thread's own cuBLAS handle once it is loaded, ~5 ms."""
    if device.type == "cuda":
        square = torch.zeros(8, 8, device=device, dtype=torch.float16)
        torch.mm(square, square)
        torch.cuda.synchronize(device)


def resolve(device: str | torch.device) -> torch.device:
    """The device named, present here; ``cuda`` means the current CUDA device (an explicit index)."""
    name = str(device)
    check_device(name)
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        why = (
            f"this torch ({torch.__version__}) is built without CUDA"
            if torch.version.cuda is None
            else "no CUDA device is visible (driver, CUDA_VISIBLE_DEVICES?)"
        )
        raise BackendUnavailableError(f"device {name!r} needs a CUDA GPU, but {why}; run it on a GPU machine")
    index = int(name.split(":")[1]) if ":" in name else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if index >= count:
        raise BackendUnavailableError(
            f"device {name!r} does not exist: this machine has cuda:0..cuda:{count - 1}"
        )
    return torch.device("cuda", index)


def same(a: torch.device, b: torch.device) -> bool:
    """Whether two devices are one (``cuda`` without an index is the current CUDA device)."""
    if a.type != b.type:
        return False
    if a.type != "cuda":
        return True
    current = torch.cuda.current_device() if torch.cuda.is_available() else 0
    return (a.index if a.index is not None else current) == (b.index if b.index is not None else current)


def to_device(
    model: torch.nn.Module, args: tuple = (), kwargs: Mapping[str, Any] | None = None, *, device: str = "cpu"
) -> tuple[torch.nn.Module, tuple, dict[str, Any]]:
    """The model and its example inputs on ``device``, ready for ``compiler.export``.

    Export must see the model where it will run: factory ops (``arange``, ``full``, masks) record the
    device of the trace in the graph, and engines are built on the weights' device.
    """
    target = resolve(device)
    moved = pytree.tree_map_only(torch.Tensor, lambda t: t.to(target), (tuple(args), dict(kwargs or {})))
    return model.to(target), moved[0], moved[1]


def program_device(program: torch.export.ExportedProgram) -> torch.device | None:
    """The device the program was traced on (its inputs' and weights' metadata), None if it has no tensor.

    Read from the graph, not from the state dict: a program loaded from a package carries placeholder
    weights on the host until the real ones are put in.
    """
    for node in program.graph.nodes:
        if node.op != "placeholder":
            break
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return val.device
    return None


def program_on(program: torch.export.ExportedProgram, device: torch.device) -> torch.export.ExportedProgram:
    """The program on ``device`` (weights, constants and the devices its ops name), unchanged if there.

    torch.export's own ``move_to_device_pass`` rewrites device arguments of factory ops too, which a
    plain ``.to()`` of the weights would leave pointing at the old device.
    """
    current = program_device(program)
    if current is None or same(current, device):
        return program
    from torch.export.passes import move_to_device_pass

    # The pass edits in place: work on a copy, so the caller's program stays where it was.
    moved = copy.copy(program)
    moved._state_dict, moved._constants = dict(program.state_dict), dict(program.constants)
    moved._graph_module = copy.deepcopy(program.graph_module)
    # No autograd: moving a CUDA program's weights (which require grad) on a torch built without CUDA
    # otherwise aborts the process in autograd's C++ (grad_accumulator for a cuda tensor).
    with torch.no_grad():
        moved = move_to_device_pass(moved, device)
    typed_devices(moved.graph_module)
    return moved


def typed_devices(graph_module: torch.fx.GraphModule) -> None:
    """Device arguments as ``torch.device``, in place: ``move_to_device_pass`` writes the ones it moves
    as strings (``'cuda:0'``), which the ops take alike, but a package's runtime graph holds devices
    only as devices (``compiler.partitioning.runtime_graph``): a program exported on the CPU and
    compiled for CUDA saved no runtime graph, and its loads read the whole program (10 s for a tiny BERT
    on the H200 instead of well under one)."""
    for module in graph_module.modules():
        if not isinstance(module, torch.fx.GraphModule):
            continue
        for node in module.graph.nodes:
            schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
            if schema is None:
                continue
            names = {a.name for a in schema.arguments if _is_device(a.real_type)}
            if not names:
                continue
            at = {i for i, a in enumerate(schema.arguments) if a.name in names}
            node.args = tuple(_typed(v) if i in at else v for i, v in enumerate(node.args))
            node.kwargs = {k: _typed(v) if k in names else v for k, v in node.kwargs.items()}
        module.recompile()


def _is_device(kind: torch.JitType) -> bool:
    if isinstance(kind, torch.OptionalType):
        kind = kind.getElementType()
    return isinstance(kind, torch.DeviceObjType)


def _typed(value: object) -> object:
    return torch.device(value) if isinstance(value, str) else value
