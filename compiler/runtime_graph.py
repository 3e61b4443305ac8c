"""The split graph as data: what a package load needs to run a model, read without torch.export.

A package's ``program.pt2`` holds the whole exported program. Reading it back costs most of a trusted
package's cold start: torch.export's deserializer imports torch._dynamo, parses every symbolic shape
with sympy and builds a fake tensor per node (2.5-3.3 s for BERT-base on the GPU machine's host).
What a load runs is much less: the split graph (the fallback graph, and a submodule per partition),
how the call's arguments flatten, and which weight feeds each input. ``runtime_graph.json`` holds just
that, beside the program, hashed with the other files. A load runs from it; the program is read only
when something asks for it (a re-save, a refit into a new module, quantization).

It is data: every call target is resolved by name to an operator overload under ``torch.ops`` (a
namespace other than aten and prims only once its module has been imported by the op-module rule) or to
one of a few Python operators. Nothing is imported, evaluated or unpickled from it. A graph that holds
anything else (higher-order operators, calls by name, attributes) is not written: its package loads
from the program, as before.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.utils import _pytree as pytree

from compiler.errors import PackageCorruptError

FORMAT = 1

# The Python operators a split graph calls: tuple indexing of multi-output nodes and shape arithmetic.
_OPERATORS = {
    f"operator.{name}": getattr(operator, name)
    for name in ("getitem", "add", "sub", "mul", "floordiv", "truediv", "mod", "neg", "pow")
}
_BY_FUNCTION = {fn: name for name, fn in _OPERATORS.items()}
_DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,199}$")
_OP_NAME = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)::([A-Za-z_][A-Za-z0-9_]*)\.([A-Za-z_][A-Za-z0-9_]*)$")
_ENUMS: dict[str, tuple[type, tuple[str, ...]]] = {
    "layout": (torch.layout, ("strided", "sparse_coo", "sparse_csr", "_mkldnn")),
    "memory_format": (
        torch.memory_format,
        ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format"),
    ),
}


class NotData(ValueError):
    """The graph holds something this form does not write (the package loads from its program)."""


@dataclass(frozen=True)
class CallSignature:
    """How a call's arguments reach the split graph and its outputs come back.

    ``inputs``: per graph input, the weight key it is fed, or None for the next user input (flattened
    by ``in_spec``); ``user_outputs``: which graph outputs the caller gets, unflattened by ``out_spec``.
    """

    in_spec: pytree.TreeSpec
    out_spec: pytree.TreeSpec
    inputs: tuple[str | None, ...]
    user_outputs: tuple[int, ...]

    @classmethod
    def of(cls, program: ExportedProgram) -> CallSignature:
        signature = program.graph_signature
        return cls(
            program.call_spec.in_spec,
            program.call_spec.out_spec,
            tuple(None if s.kind == InputKind.USER_INPUT else s.target for s in signature.input_specs),
            tuple(i for i, s in enumerate(signature.output_specs) if s.kind == OutputKind.USER_OUTPUT),
        )

    def weight_keys(self) -> list[str]:
        return [k for k in self.inputs if k is not None]


@dataclass(frozen=True)
class RuntimeGraph:
    """What :func:`read` gives a load: the split graph, its call signature and shape symbols."""

    graph_module: torch.fx.GraphModule
    signature: CallSignature
    symbols: dict[str, tuple[str, int, int, int]]


def write(
    graph_module: torch.fx.GraphModule,
    signature: CallSignature,
    symbols: Mapping[str, tuple[str, int, int, int]],
) -> bytes | None:
    """The form's bytes (canonical JSON), or None where the graph holds something it cannot write."""
    try:
        data = {
            "format": FORMAT,
            "graph": _graph(graph_module),
            "in_spec": pytree.treespec_dumps(signature.in_spec),
            "out_spec": pytree.treespec_dumps(signature.out_spec),
            "inputs": list(signature.inputs),
            "user_outputs": list(signature.user_outputs),
            "symbols": {k: list(v) for k, v in symbols.items()},
        }
    except (NotData, NotImplementedError, TypeError):  # treespec_dumps: a type without a serialized name
        return None
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def read(data: bytes, where: str, device: torch.device | None = None) -> RuntimeGraph:
    """Decode :func:`write`'s bytes (checked by the caller's manifest hash, and here for shape).

    ``device``: where the model runs, when that is not where it was compiled: every device an op names
    becomes it (as torch.export's ``move_to_device_pass`` does for a program). Malformed data is a
    :class:`PackageCorruptError` naming ``where``."""
    try:
        raw = json.loads(data)
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format') if isinstance(raw, dict) else raw!r:.40}")
        signature = CallSignature(
            pytree.treespec_loads(_str(raw["in_spec"])),
            pytree.treespec_loads(_str(raw["out_spec"])),
            tuple(None if k is None else _str(k) for k in raw["inputs"]),
            tuple(_int(i) for i in raw["user_outputs"]),
        )
        symbols = {
            _str(k): (_str(v[0]), _int(v[1]), _int(v[2]), _int(v[3])) for k, v in raw["symbols"].items()
        }
        graph_module = _module(raw["graph"], device, depth=0)
    except PackageCorruptError:
        raise
    except (ValueError, KeyError, TypeError, AttributeError, IndexError, RuntimeError) as exc:
        raise PackageCorruptError(f"{where} is malformed: {exc!r:.300}") from exc
    placeholders = [n for n in graph_module.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(signature.inputs):
        raise PackageCorruptError(
            f"{where}: the graph takes {len(placeholders)} inputs, its signature names "
            f"{len(signature.inputs)}"
        )
    return RuntimeGraph(graph_module, signature, symbols)


# ---------------------------------------------------------------- writing


def _graph(gm: torch.fx.GraphModule) -> dict:
    index: dict[torch.fx.Node, int] = {}
    nodes, submodules = [], {}
    for node in gm.graph.nodes:
        if not _NAME.match(node.name):
            raise NotData(f"node name {node.name!r}")
        entry: dict[str, Any] = {"op": node.op, "name": node.name}
        if node.op == "call_function":
            entry["target"] = _target_name(node.target)
        elif node.op == "call_module":
            if not _NAME.match(str(node.target)):
                raise NotData(f"submodule {node.target!r}")
            sub = getattr(gm, node.target)
            if not isinstance(sub, torch.fx.GraphModule):
                raise NotData(f"submodule {node.target} is a {type(sub).__name__}")
            submodules[node.target] = _graph(sub)
            entry["target"] = node.target
        elif node.op not in ("placeholder", "output"):
            raise NotData(f"{node.op} node {node.name}")
        if node.op != "placeholder":
            entry["args"] = _value(node.args, index)
            entry["kwargs"] = {k: _value(v, index) for k, v in node.kwargs.items()}
        index[node] = len(nodes)
        nodes.append(entry)
    return {"nodes": nodes, "submodules": submodules}


def _target_name(target: object) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}::{target._opname}.{target._overloadname}"
    name = _BY_FUNCTION.get(target)  # type: ignore[arg-type]
    if name is None:
        raise NotData(f"call target {target!r:.80}")
    return name


def _value(value: object, index: Mapping[torch.fx.Node, int]) -> Any:
    if isinstance(value, torch.fx.Node):
        return {"node": index[value]}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return {"float": repr(value)}  # inf and nan survive
    if isinstance(value, (list, tuple)):
        # fx keeps args in its own immutable list type: a list is a list
        return {"list" if isinstance(value, list) else "tuple": [_value(v, index) for v in value]}
    if isinstance(value, torch.dtype):
        return {"dtype": str(value).removeprefix("torch.")}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    for kind, (cls, _names) in _ENUMS.items():
        if isinstance(value, cls):
            return {kind: str(value).removeprefix("torch.")}
    raise NotData(f"argument of type {type(value).__name__}")


# ---------------------------------------------------------------- reading


def _module(raw: dict, device: torch.device | None, depth: int) -> torch.fx.GraphModule:
    if depth > 2:  # the split graph and its partitions: nothing nests deeper
        raise ValueError("submodules nest too deep")
    root = torch.nn.Module()
    for name, sub in _dict(raw["submodules"]).items():
        if not _NAME.match(name):
            raise ValueError(f"submodule name {name!r:.60}")
        root.add_module(name, _module(sub, device, depth + 1))
    graph = torch.fx.Graph()
    nodes: list[torch.fx.Node] = []
    for entry in raw["nodes"]:
        op, name = _str(entry["op"]), _str(entry["name"])
        if not _NAME.match(name):
            raise ValueError(f"node name {name!r:.60}")
        if op not in ("placeholder", "call_function", "call_module", "output"):
            raise ValueError(f"node {name}: op {op!r:.40}")
        if op == "placeholder":
            node = graph.create_node("placeholder", name, name=name)
        else:
            args = _decode(entry["args"], nodes, device)
            kwargs = {_str(k): _decode(v, nodes, device) for k, v in _dict(entry["kwargs"]).items()}
            if not isinstance(args, tuple):
                raise ValueError(f"node {name}: args must be a tuple")
            if op == "output":
                target: Any = "output"
            elif op == "call_module":
                target = _str(entry["target"])
                if not _NAME.match(target) or target not in root._modules:
                    raise ValueError(f"node {name} calls an unknown submodule {target!r:.60}")
            else:
                target = _resolve(_str(entry["target"]))
            node = graph.create_node(op, target, args, kwargs, name=name)
        nodes.append(node)
    return torch.fx.GraphModule(root, graph)


def _resolve(name: str) -> Any:
    if name in _OPERATORS:
        return _OPERATORS[name]
    match = _OP_NAME.match(name)
    if match is None:
        raise ValueError(f"call target {name!r:.80}")
    namespace, op, overload = match.groups()
    try:  # a lookup in the dispatcher's registry: an op whose module was never imported is not there
        target = getattr(getattr(getattr(torch.ops, namespace), op), overload)
    except (AttributeError, RuntimeError) as exc:
        raise ValueError(f"operator {name} is not registered in this process") from exc
    if not isinstance(target, torch._ops.OpOverload):
        raise ValueError(f"{name} is not an operator overload")
    return target


def _decode(value: Any, nodes: list[torch.fx.Node], device: torch.device | None) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    (kind, inner), *rest = _dict(value).items()
    if rest:
        raise ValueError(f"a value with keys {sorted(value)[:4]}")
    if kind == "node":
        return nodes[_int(inner)]
    if kind in ("list", "tuple"):
        items = [_decode(v, nodes, device) for v in inner]
        return items if kind == "list" else tuple(items)
    if kind == "float":
        return float(_str(inner))
    if kind == "dtype":
        if inner not in _DTYPES:
            raise ValueError(f"dtype {inner!r:.40}")
        return _DTYPES[inner]
    if kind == "device":
        return device if device is not None else torch.device(_str(inner))
    if kind in _ENUMS:
        names = _ENUMS[kind][1]
        if inner not in names:
            raise ValueError(f"{kind} {inner!r:.40}")
        return getattr(torch, inner)
    raise ValueError(f"a value of kind {kind!r:.40}")


def _str(value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {type(value).__name__}")
    return value


def _dict(value: object) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"expected an object, got {type(value).__name__}")
    return value
