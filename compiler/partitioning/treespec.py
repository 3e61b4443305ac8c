"""Pytree specs (how a call's arguments flatten and its outputs come back), decoded by kiln.

torch's ``treespec_loads`` imports whatever module a spec's enum or defaultdict factory names and
calls what it finds there. A package's runtime graph carries two specs, so they are read here instead,
by the rules a program's text is held to (``compiler.program.text``, ``compiler.program.module_policy``):

* a node type resolves only through torch's registry of serializable pytree types (registered by a
  module already imported, e.g. under the op-module rule): nothing is imported for it;
* a defaultdict's factory is one of ``module_policy.DEFAULT_FACTORIES`` (builtin containers and
  numbers), never looked up in a module;
* an enum in a context is a member of an ``enum.Enum`` class whose module the op-module rule allows
  (``compiler.program.export.import_allowed_modules``), reached by plain attribute names.

Anything else is a ``ValueError`` naming it (the caller makes that its typed error).
"""

from __future__ import annotations

import builtins
import enum
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from torch.utils import _pytree as pytree

from compiler import json_reader
from compiler.program.module_policy import MODULE_NAME, default_factory_refusal

_QUALNAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")
_MAX_DEPTH = 64  # specs nest as deep as the model's inputs and outputs do; far less in practice


def loads(
    text: str, where: str, *, allowed: Sequence[str] | None = None, recorded: Sequence[str] | None = None
) -> pytree.TreeSpec:
    """The spec ``pytree.treespec_dumps`` wrote as ``text`` (protocol 1), read by the rules above.
    ``allowed``/``recorded``: the caller's op-module allow list and the package's recorded modules."""
    # Each spec level is two JSON levels (the node object, its children list), in a [protocol, spec] pair.
    protocol, schema = json_reader.loads(text, f"{where} pytree spec", max_depth=2 * _MAX_DEPTH + 3)
    if protocol != 1:
        raise ValueError(f"pytree spec protocol {protocol!r:.20}")
    return _spec(schema, where, allowed, recorded, 0)


def _spec(
    schema: Any, where: str, allowed: Sequence[str] | None, recorded: Sequence[str] | None, depth: int
) -> pytree.TreeSpec:
    kind, context, children = _node(schema, depth)
    if kind is None:
        return pytree.treespec_leaf()
    if not isinstance(kind, str) or kind not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
        raise ValueError(f"pytree type {kind!r:.80} is not registered in this process")
    typ = pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE[kind]
    node_def = pytree.SUPPORTED_SERIALIZED_TYPES[typ]
    if typ is defaultdict:
        decoded = _defaultdict_context(context)
    elif node_def.from_dumpable_context is not None:
        # A registered type's own decoder: torch's for namedtuples (a registry look-up) or that of the
        # module that registered the type, which the op-module rule let this process import.
        decoded = node_def.from_dumpable_context(context)
    else:
        if not isinstance(context, str):
            raise ValueError(f"pytree {kind} context is not JSON text")
        decoded = json_reader.loads(
            context,
            f"{where} pytree {kind} context",
            object_hook=lambda obj: _enum_member(obj, where, allowed, recorded),
        )
    return pytree.TreeSpec(typ, decoded, [_spec(c, where, allowed, recorded, depth + 1) for c in children])


def _defaultdict_context(context: Any) -> list[Any]:
    if not isinstance(context, dict) or set(context) != {
        "default_factory_module",
        "default_factory_name",
        "dict_context",
    }:
        raise ValueError("a defaultdict pytree context is not {factory module, factory name, keys}")
    module, name = context["default_factory_module"], context["default_factory_name"]
    refusal = default_factory_refusal(module, name)
    if refusal is not None:
        raise ValueError(f"the pytree names {refusal}")
    return [getattr(builtins, name), context["dict_context"]]


def _enum_member(
    obj: dict[str, Any], where: str, allowed: Sequence[str] | None, recorded: Sequence[str] | None
) -> Any:
    if "__enum__" not in obj:
        return obj
    fqn, name = obj.get("fqn"), obj.get("name")
    if not isinstance(fqn, str) or not isinstance(name, str):
        raise ValueError("a pytree enum without a class name and member name")
    module, _, qualname = fqn.partition(":")
    if not MODULE_NAME.match(module) or not _QUALNAME.match(qualname):
        raise ValueError(f"pytree enum class {fqn!r:.80}")
    from compiler.program.export import import_allowed_modules  # the op-module rule (imports torch.export)

    import_allowed_modules([module], where, allowed=allowed, recorded=recorded)
    import sys

    cls: Any = sys.modules[module]
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)) or name not in cls.__members__:
        raise ValueError(f"pytree enum {fqn}.{name:.40} is not a member of an enum class")
    return cls[name]


class DeferredSpec:
    """An output spec checked at load and decoded on first use: the modules its types come from
    (``modules``: transformers' ModelOutput, a 1.4-2 s import) are imported only when a caller asks for
    the model's own output type (``forward``), never for ``run_flat`` (a serving backend's path, issue
    45). The op-module rule held them at load; it holds the import again when it happens."""

    def __init__(
        self,
        text: str,
        where: str,
        modules: Sequence[str],
        *,
        allowed: Sequence[str] | None = None,
        recorded: Sequence[str] | None = None,
    ):
        protocol, schema = json_reader.loads(text, f"{where} pytree spec", max_depth=2 * _MAX_DEPTH + 3)
        if protocol != 1:
            raise ValueError(f"pytree spec protocol {protocol!r:.20}")
        self.num_leaves = _leaves(schema, 0)  # the shape checked now: a load refuses a malformed spec
        self.text, self.where, self.modules = text, where, tuple(modules)
        self._allowed, self._recorded = allowed, recorded
        self._spec: pytree.TreeSpec | None = None

    def resolve(self) -> pytree.TreeSpec:
        """The spec, its modules imported (by the op-module rule) the first time."""
        if self._spec is None:
            from compiler.errors import PackageCorruptError
            from compiler.program.export import import_allowed_modules

            import_allowed_modules(self.modules, self.where, allowed=self._allowed, recorded=self._recorded)
            try:
                self._spec = loads(self.text, self.where, allowed=self._allowed, recorded=self._recorded)
            except (ValueError, TypeError, KeyError, AttributeError) as exc:
                raise PackageCorruptError(f"{self.where} is malformed: {exc!r:.300}") from exc
        return self._spec

    def __eq__(self, other: object) -> bool:  # a comparison asks for the type: decoded for it
        if isinstance(other, DeferredSpec | pytree.TreeSpec):
            return self.resolve() == resolved(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.resolve())


def resolved(spec: pytree.TreeSpec | DeferredSpec) -> pytree.TreeSpec:
    return spec.resolve() if isinstance(spec, DeferredSpec) else spec


def type_names(text: str, where: str) -> set[str]:
    """The serialized type names a spec's nodes carry (data: nothing resolved or imported)."""
    _, schema = json_reader.loads(text, f"{where} pytree spec", max_depth=2 * _MAX_DEPTH + 3)
    names: set[str] = set()

    def walk(node: Any, depth: int) -> None:
        if depth > _MAX_DEPTH or not isinstance(node, dict):
            raise ValueError("a pytree spec node is not {type, context, children_spec}")
        if isinstance(node.get("type"), str):
            names.add(node["type"])
        for child in node.get("children_spec") or ():
            walk(child, depth + 1)

    walk(schema, 0)
    return names


def _node(schema: Any, depth: int) -> tuple[Any, Any, list]:
    """One spec node's (type, context, children), its structure checked (a leaf: type None, no more)."""
    if depth > _MAX_DEPTH:
        raise ValueError("a pytree spec nests too deep")
    if not isinstance(schema, dict) or set(schema) != {"type", "context", "children_spec"}:
        raise ValueError("a pytree spec node is not {type, context, children_spec}")
    kind, context, children = schema["type"], schema["context"], schema["children_spec"]
    if not isinstance(children, list):
        raise ValueError("a pytree spec's children are not a list")
    if kind is None and (context is not None or children):
        raise ValueError("a pytree leaf with a context or children")
    return kind, context, children


def _leaves(schema: Any, depth: int) -> int:
    """How many leaves a spec has, its node structure checked as :func:`_spec` checks it."""
    kind, _, children = _node(schema, depth)
    if kind is None:
        return 1
    if not isinstance(kind, str):
        raise ValueError(f"pytree type {kind!r:.80}")
    return sum(_leaves(child, depth + 1) for child in children)
