"""The split graph as data: what a package load needs to run a model, read without torch.export.

A package's ``program.pt2`` holds the whole exported program. Reading it back costs most of a trusted
package's cold start: torch.export's deserializer imports torch._dynamo, parses every symbolic shape
with sympy and builds a fake tensor per node (2.5-3.3 s for BERT-base on the GPU machine's host).
What a load runs is much less: the split graph (the fallback graph, and a submodule per partition),
how the call's arguments flatten, and which weight feeds each input. ``runtime_graph.json`` holds just
that, beside the program, hashed with the other files. A load runs from it; the program is read only
when something asks for it (a re-save, a refit into a new module, quantization).

It is data, and torch.fx turns it into Python source that it runs, so every part fx writes into that
source is checked before a node is made: call targets and their arguments by the operator table and
schema rule of :mod:`compiler.partitioning.runtime_ops`; node, placeholder and submodule names are plain
identifiers that are no Python keyword, builtin or name of fx's generated code; constants are
numbers, booleans, dtypes, devices, layouts and memory formats (strings only where the table lists
them). The call signature's pytree specs are decoded by :mod:`compiler.partitioning.treespec`, under the
op-module rule. Nothing is imported, evaluated or unpickled from it. A graph that holds anything else
(higher-order operators, calls by name, attributes, an op outside the table) is not written: its
package loads from the program, as before.
"""

from __future__ import annotations

import builtins
import json
import keyword
import operator
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from torch.fx._lazy_graph_module import _LazyGraphModule
from torch.utils import _pytree as pytree

from compiler import json_reader
from compiler.errors import KilnError, PackageCorruptError, PackageJsonError
from compiler.partitioning import runtime_ops, treespec

FORMAT = 1

_DTYPES = {str(v).removeprefix("torch."): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,199}$")
# Names fx's generated code uses itself (globals, the module, its helpers): a graph value may not
# shadow them.
_RESERVED = frozenset({"self", "torch", "device", "inf", "nan", "NoneType", "fx_pytree", "pytree", "wrap"})
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
    out_spec: pytree.TreeSpec | treespec.DeferredSpec  # deferred: decoded on first use (read's note)
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


def encode(
    graph_module: torch.fx.GraphModule,
    signature: CallSignature,
    symbols: Mapping[str, tuple[str, int, int, int]],
) -> bytes:
    """The form's bytes (canonical JSON); :class:`NotData` saying what the form cannot hold."""
    try:
        data = {
            "format": FORMAT,
            "graph": _graph(graph_module),
            "in_spec": pytree.treespec_dumps(signature.in_spec),
            "out_spec": pytree.treespec_dumps(treespec.resolved(signature.out_spec)),
            "inputs": list(signature.inputs),
            "user_outputs": list(signature.user_outputs),
            "symbols": {k: list(v) for k, v in symbols.items()},
        }
    except NotData:
        raise
    except (NotImplementedError, TypeError) as exc:  # treespec_dumps: a type without a serialized name
        raise NotData(f"{type(exc).__name__}: {str(exc)[:200]}") from exc
    encoded = json.dumps(data, sort_keys=True, separators=(",", ":")).encode()
    try:  # what is written is what a load reads: a graph the reader would refuse loads from the program
        read(encoded, "the runtime graph being written")
    except KilnError as exc:
        raise NotData(f"it would not read back: {str(exc)[:200]}") from exc
    return encoded


def read(
    data: bytes,
    where: str,
    device: torch.device | None = None,
    *,
    allowed_modules: Sequence[str] | None = None,
    recorded_modules: Sequence[str] | None = None,
    deferred: Sequence[str] = (),
) -> RuntimeGraph:
    """Decode :func:`encode`'s bytes (checked by the caller's manifest hash, and here for shape).

    ``device``: where the model runs, when that is not where it was compiled: every device an op names
    becomes it (as torch.export's ``move_to_device_pass`` does for a program). ``allowed_modules`` and
    ``recorded_modules``: the op-module rule's allow list and the package's modules, for enum types in
    the pytree specs. ``deferred``: modules only the output spec needs (:func:`output_only_modules`),
    not imported yet: the output spec is then a ``DeferredSpec``, decoded (its modules imported) on
    first use. Malformed data is a :class:`PackageCorruptError` naming ``where``."""
    try:
        raw = _dict(json_reader.loads(data, where, error=PackageJsonError))
        if raw.get("format") != FORMAT:
            raise ValueError(f"format {raw.get('format')!r:.40}")
        rule = {"allowed": allowed_modules, "recorded": recorded_modules}
        out_spec = (
            treespec.DeferredSpec(_str(raw["out_spec"]), where, deferred, **rule)
            if deferred
            else treespec.loads(_str(raw["out_spec"]), where, **rule)
        )
        signature = CallSignature(
            treespec.loads(_str(raw["in_spec"]), where, **rule),
            out_spec,
            tuple(None if k is None else _str(k) for k in _list(raw["inputs"])),
            tuple(_int(i) for i in _list(raw["user_outputs"])),
        )
        # Symbol names are data (never written into code): plain identifiers, builtins included.
        symbols = {_identifier(k): _symbol(v) for k, v in _dict(raw["symbols"]).items()}
        graph_module = _module(raw["graph"], device, depth=0)
        _check_signature(graph_module, signature)
    except PackageCorruptError:
        raise
    except (
        ValueError,
        KeyError,
        TypeError,
        AttributeError,
        IndexError,
        RuntimeError,
        NotImplementedError,
        AssertionError,
        RecursionError,
        SyntaxError,
    ) as exc:
        raise PackageCorruptError(f"{where} is malformed: {exc!r:.300}") from exc
    return RuntimeGraph(graph_module, signature, symbols)


def output_only_modules(data: bytes, where: str, recorded: Sequence[str]) -> tuple[str, ...]:
    """The recorded modules only the output spec's types come from (transformers' ModelOutput): a
    load need not import them until a caller asks for the output type. None where the graph calls an
    op outside ATen and prims (its module may be one of them) or the data is malformed (:func:`read`
    says how)."""
    try:
        raw = _dict(json_reader.loads(data, where, error=PackageJsonError))
        outputs = treespec.type_names(_str(raw["out_spec"]), where)
        inputs = treespec.type_names(_str(raw["in_spec"]), where)
        if _calls_custom_ops(raw["graph"], 0):
            return ()
    except (KilnError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return ()

    def names(module: str, types: set[str]) -> bool:
        return any(t.startswith(module + ".") for t in types)

    return tuple(m for m in recorded if names(m, outputs) and not names(m, inputs))


def _calls_custom_ops(graph: Any, depth: int) -> bool:
    if depth > 16 or not isinstance(graph, dict):
        return True  # not a graph this reader takes: nothing deferred (read refuses it)
    for node in graph.get("nodes") or ():
        target = node.get("target") if isinstance(node, dict) else None
        if isinstance(target, str) and "::" in target and target.split("::", 1)[0] not in ("aten", "prims"):
            return True
    return any(_calls_custom_ops(sub, depth + 1) for sub in (graph.get("submodules") or {}).values())


def _check_signature(graph_module: torch.fx.GraphModule, signature: CallSignature) -> None:
    """The signature fits the graph: one entry per placeholder, user inputs as many as the input spec's
    leaves, user outputs indices of the graph's outputs and as many as the output spec's leaves."""
    nodes = list(graph_module.graph.nodes)
    placeholders = [n for n in nodes if n.op == "placeholder"]
    if len(placeholders) != len(signature.inputs):
        raise ValueError(
            f"the graph takes {len(placeholders)} inputs, its signature names {len(signature.inputs)}"
        )
    users = sum(1 for k in signature.inputs if k is None)
    if signature.in_spec.num_leaves != users:
        raise ValueError(f"the input spec has {signature.in_spec.num_leaves} leaves for {users} user inputs")
    outputs = next((n.args[0] for n in reversed(nodes) if n.op == "output"), None)
    count = len(outputs) if isinstance(outputs, tuple | list) else 0
    if any(not 0 <= i < count for i in signature.user_outputs):
        raise ValueError(f"user outputs {list(signature.user_outputs)[:8]} index a graph of {count} outputs")
    if signature.out_spec.num_leaves != len(signature.user_outputs):
        raise ValueError(
            f"the output spec has {signature.out_spec.num_leaves} leaves for "
            f"{len(signature.user_outputs)} user outputs"
        )


# ---------------------------------------------------------------- writing


def _graph(gm: torch.fx.GraphModule) -> dict:
    index: dict[torch.fx.Node, int] = {}
    nodes, submodules = [], {}
    for node in gm.graph.nodes:
        # A placeholder is written by its node name, which its target (the argument name) may differ
        # from: fx renames an argument called after a builtin (nn.Sequential's `input` is `input_1`).
        # The graph is called positionally, so the name is all a read needs.
        if _name_refusal(node.name):
            raise NotData(f"node name {node.name!r}")
        entry: dict[str, Any] = {"op": node.op, "name": node.name}
        if node.op == "call_function":
            try:  # the rule a read holds the call to: a graph it refuses is not written
                entry["target"] = runtime_ops.target_name(node.target)
                runtime_ops.check_call(node.target, node.args, node.kwargs, torch.fx.Node)
            except runtime_ops.CallRefused as exc:
                raise NotData(str(exc)) from exc
        elif node.op == "call_module":
            if _name_refusal(str(node.target)):
                raise NotData(f"submodule {node.target!r}")
            sub = getattr(gm, node.target)
            if not isinstance(sub, torch.fx.GraphModule):
                raise NotData(f"submodule {node.target} is a {type(sub).__name__}")
            submodules[node.target] = _graph(sub)
            entry["target"] = node.target
        elif node.op not in ("placeholder", "output"):
            users = sorted(str(u.target) for u in node.users if u.op == "call_function")
            raise NotData(
                f"{node.op} node {node.name}" + (f", taken by {', '.join(users)[:200]}" if users else "")
            )
        if node.op != "placeholder":
            entry["args"] = _value(node.args, index)
            entry["kwargs"] = {k: _value(v, index) for k, v in node.kwargs.items()}
        index[node] = len(nodes)
        nodes.append(entry)
    return {"nodes": nodes, "submodules": submodules}


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
        root.add_module(_name(name), _module(sub, device, depth + 1))
    graph = torch.fx.Graph()
    nodes: list[torch.fx.Node] = []
    # Nodes whose value is a tuple (a submodule's outputs: how many; an op's several results: None):
    # only indexing takes them, so a graph cannot hand a tuple to an op that wants a tensor.
    tuples: dict[torch.fx.Node, int | None] = {}
    outputs = 0
    for entry in _list(raw["nodes"]):
        entry = _dict(entry)
        op, name = _str(entry["op"]), _name(entry["name"])
        if op not in ("placeholder", "call_function", "call_module", "output"):
            raise ValueError(f"node {name}: op {op!r:.40}")
        if op == "placeholder":
            node = graph.create_node("placeholder", name, name=name)
        else:
            args = _decode(entry["args"], nodes, device)
            # Keyword names are checked against the called operator's schema (runtime_ops.check_call).
            kwargs = {_str(k): _decode(v, nodes, device) for k, v in _dict(entry["kwargs"]).items()}
            if not isinstance(args, tuple):
                raise ValueError(f"node {name}: args must be a tuple")
            if op == "output":
                outputs += 1
                values = pytree.tree_leaves(args)
                if (
                    len(args) != 1
                    or kwargs
                    or any(v is not None and not isinstance(v, torch.fx.Node) for v in values)
                ):
                    raise ValueError(f"output node {name} returns something other than graph values")
                target: Any = "output"
            elif op == "call_module":
                target = _name(entry["target"])
                if target not in root._modules:
                    raise ValueError(f"node {name} calls an unknown submodule {target!r:.60}")
                if kwargs or any(not isinstance(a, torch.fx.Node) for a in args):
                    raise ValueError(f"node {name} passes its submodule something other than graph values")
            else:
                target = runtime_ops.resolve(_str(entry["target"]))
                runtime_ops.check_call(target, args, kwargs, torch.fx.Node)
            _check_tuples(name, target, args, kwargs, tuples)
            node = graph.create_node(op, target, args, kwargs, name=name)
            if op == "call_module" and (count := _output_count(root._modules[target])) is not None:
                tuples[node] = count
            elif isinstance(target, torch._ops.OpOverload) and runtime_ops.returns_several(target):
                tuples[node] = None
        if node.name != name:  # fx renamed it: a name given twice
            raise ValueError(f"node name {name!r} is given twice")
        nodes.append(node)
    if outputs != 1 or nodes[-1].op != "output":
        raise ValueError("a graph ends in exactly one output node")
    # torch's own lazy form (Dynamo's): its Python code is generated on the first call, not here. A
    # partition an engine runs is never called, and generating the code of OPT-350m's 24 layers was
    # most of a load's runtime_graph lap (0.68 s of it on the 2-core CPU here, 0.26 s lazily).
    return _LazyGraphModule(root, graph)


def _check_tuples(
    name: str, target: Any, args: tuple, kwargs: dict, tuples: dict[torch.fx.Node, int | None]
) -> None:
    if target is operator.getitem:
        source, index = args if len(args) == 2 else (None, None)
        if source not in tuples or not isinstance(index, int) or isinstance(index, bool):
            raise ValueError(f"node {name} indexes something other than a tuple of results")
        count = tuples[source]
        if count is not None and not 0 <= index < count:
            raise ValueError(f"node {name} takes result {index} of {count}")
        return
    used = pytree.tree_leaves((args, kwargs)) if target != "output" else pytree.tree_leaves(args[0])
    if any(isinstance(v, torch.fx.Node) and v in tuples for v in used):
        raise ValueError(f"node {name} passes a tuple of results where a value goes")


def _output_count(module: torch.fx.GraphModule) -> int | None:
    output = next((n for n in reversed(module.graph.nodes) if n.op == "output"), None)
    value = output.args[0] if output is not None and output.args else None
    return len(value) if isinstance(value, tuple | list) else None


def _name_refusal(name: object) -> str | None:
    """Why ``name`` may not be written into the code fx generates, or None for a plain identifier."""
    if not isinstance(name, str) or not _NAME.match(name):
        return f"{name!r:.60} is not a plain identifier"
    # fx itself never names a node after a keyword or builtin (it renames them), so a graph that does
    # was not written by fx.
    if keyword.iskeyword(name) or hasattr(builtins, name):
        return f"{name!r} is a Python keyword or builtin"
    if name in _RESERVED or name.startswith("__"):
        return f"{name!r} is a name fx's generated code uses"
    return None


def _name(value: object) -> str:
    refusal = _name_refusal(value)
    if refusal is not None:
        raise ValueError(f"name {refusal}")
    return value  # type: ignore[return-value]


def _identifier(value: object) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"name {value!r:.60} is not a plain identifier")
    return value


def _symbol(value: object) -> tuple[str, int, int, int]:
    items = _list(value)
    if len(items) != 4:
        raise ValueError("a shape symbol is [input, axis, min, max]")
    return (_str(items[0]), _int(items[1]), _int(items[2]), _int(items[3]))


def _decode(value: Any, nodes: list[torch.fx.Node], device: torch.device | None) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    (kind, inner), *rest = _dict(value).items()
    if rest:
        raise ValueError(f"a value with keys {sorted(value)[:4]}")
    if kind == "node":
        index = _int(inner)
        if not 0 <= index < len(nodes):
            raise ValueError(f"a value names node {index}, not an earlier node")
        return nodes[index]
    if kind in ("list", "tuple"):
        items = [_decode(v, nodes, device) for v in _list(inner)]
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


def _list(value: object) -> list:
    if not isinstance(value, list):
        raise ValueError(f"expected a list, got {type(value).__name__}")
    return value
