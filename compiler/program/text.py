"""What ``torch.export.load`` acts on in a program's ``models/model.json``, checked before it does.

The program text is JSON, but torch turns some of its strings into code or imports:

* **value and node names** become the variable names of the Python code FX generates and ``exec``s
  for the graph module (torch's deserializer overwrites FX's sanitized names with the text's own), at
  ``torch.export.load`` already: a name like ``x=__import__('os').system(...)`` runs;
* **symbolic expressions** (``expr_str``) are parsed with ``sympy.sympify``, which evaluates Python;
* **guards** (``guards_code``) are pasted into a function ``exec``'d by ``ExportedProgram.module()``;
* **pytree contexts** import the module a defaultdict factory (``default_factory_module``) or an enum
  (``fqn``) names, and a defaultdict's factory runs whenever a missing key is read: only builtin
  containers and numbers are taken as factories (``compiler.program.module_policy.DEFAULT_FACTORIES``).

So, read the way torch reads it (UTF-8, ``json.loads``: escapes decoded, the last duplicate key wins,
and every string that is itself JSON read too), the text must have: names that are plain identifiers,
expressions and guards made only of the few constructs torch writes (checked on their Python syntax
tree), and module names, which are returned for the caller's allow rule. Anything else is an
:class:`UnsafeProgramError`, before torch reads the archive.
"""

from __future__ import annotations

import ast
import keyword
import re
from typing import Any

from compiler import json_reader
from compiler.errors import UnsafeProgramError, UntrustedJsonError
from compiler.program.module_policy import default_factory_refusal, op_module

# How deep the program text may nest JSON in JSON strings (torch's treespecs: 2 or 3) before it is
# refused rather than read.
_JSON_DEPTH = 16
_DOCUMENT_DEPTH = 256  # arrays and objects in one document (torch's own parse recurses ~1000 deep)
# Keys whose string values torch uses as names in generated code.
_NAME_KEYS = frozenset({"name", "as_name"})
_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,199}$")
_NUMBER = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
# The sympy constructors torch's serializer writes (``srepr`` form) and the functions its deserializer
# provides (torch.utils._sympy.functions); nothing else may be called in an ``expr_str``.
_SYMPY_CALLS = frozenset(
    {
        "Symbol",
        "Integer",
        "Rational",
        "Float",
        "Add",
        "Mul",
        "Pow",
        "Max",
        "Min",
        "Abs",
        "Eq",
        "Ne",
        "Lt",
        "Le",
        "Gt",
        "Ge",
        "StrictLessThan",
        "StrictGreaterThan",
        "LessThan",
        "GreaterThan",
        "Equality",
        "Unequality",
        "And",
        "Or",
        "Not",
        "Piecewise",
        "ExprCondPair",
        "FloorDiv",
        "ModularIndexing",
        "Where",
        "PythonMod",
        "Mod",
        "CleanDiv",
        "CeilToInt",
        "FloorToInt",
        "CeilDiv",
        "IntTrueDiv",
        "FloatTrueDiv",
        "IsNonOverlappingAndDenseIndicator",
        "TruncToFloat",
        "TruncToInt",
        "RoundToInt",
        "RoundDecimal",
        "ToFloat",
        "FloatPow",
        "PowByNatural",
        "Identity",
        "OpaqueUnaryFn_sqrt",
        "BitwiseFn_bitwise_and",
        "BitwiseFn_bitwise_or",
        "BitwiseFn_bitwise_xor",
        "LShift",
        "RShift",
    }
)
_SYMPY_NAMES = frozenset({"oo", "zoo", "nan", "true", "false", "S", "pi", "E", "I"})
_SYMBOL_KEYWORDS = frozenset(
    {
        "integer",
        "positive",
        "nonnegative",
        "negative",
        "nonpositive",
        "real",
        "finite",
        "zero",
        "commutative",
        "precision",
    }
)
# Guards: comparisons and arithmetic over input sizes, ``L['name'].size()[i]`` and the like.
_GUARD_METHODS = frozenset({"size", "stride", "storage_offset", "numel", "dim"})
_GUARD_CALLS = frozenset({"Max", "Min", "FloorDiv", "Mod", "PythonMod", "CeilDiv", "abs", "max", "min"})
_OPERATORS = (
    ast.Add,
    ast.Sub,
    ast.Mult,
    ast.Div,
    ast.FloorDiv,
    ast.Mod,
    ast.Pow,
    ast.USub,
    ast.UAdd,
    ast.Not,
    ast.And,
    ast.Or,
    ast.Eq,
    ast.NotEq,
    ast.Lt,
    ast.LtE,
    ast.Gt,
    ast.GtE,
    ast.BitAnd,
    ast.BitOr,
    ast.LShift,
    ast.RShift,
)


def check_program_text(model_json: bytes, where: str) -> list[str]:
    """Refuse program text torch would turn into code (see the module docstring); return the modules
    its pytree contexts name for import (the caller applies the allow rule to them)."""
    modules: set[str] = set()

    def hook(obj: dict[str, Any]) -> dict[str, Any]:
        if "default_factory_module" in obj:
            refusal = default_factory_refusal(
                obj.get("default_factory_module"), obj.get("default_factory_name")
            )
            if refusal is not None:
                raise UnsafeProgramError(f"{where}: the program's pytree names {refusal}")
        for key, field in (("__enum__", "fqn"), ("default_factory_module", "default_factory_module")):
            if key in obj:
                name = obj.get(field)
                if not isinstance(name, str):
                    raise UnsafeProgramError(f"{where}: pytree {key!r} names {name!r}, not a module")
                modules.add(name.partition(":")[0] if key == "__enum__" else name)
        return obj

    try:
        # The bytes are in memory already (checked archive entries): bounded in depth and integers.
        bounds = {"max_bytes": len(model_json), "max_depth": _DOCUMENT_DEPTH, "object_hook": hook}
        root = json_reader.loads(model_json, f"{where}: models/model.json", **bounds)
        pending: list[tuple[Any, int, str | None]] = [(root, 0, None)]
        while pending:  # iterative: a deep document must not exhaust the stack here
            value, level, key = pending.pop()
            if isinstance(value, dict):
                for name, item in value.items():
                    _check_entry(name, item, where)
                    pending.append((item, level, name))
            elif isinstance(value, list):
                pending.extend((item, level, key) for item in value)
            elif isinstance(value, str) and value.lstrip()[:1] in ("{", "[", '"'):
                if level >= _JSON_DEPTH:
                    raise UnsafeProgramError(f"{where}: program text nests JSON {_JSON_DEPTH} deep")
                try:
                    pending.append((json_reader.loads(value, f"{where}: {key}", **bounds), level + 1, None))
                except UntrustedJsonError as exc:
                    if getattr(exc, "syntax", False):
                        continue  # not JSON: torch reads no module from it either
                    raise  # JSON beyond the bounds: refused, whatever torch would make of it
    except (ValueError, RecursionError) as exc:
        raise UnsafeProgramError(f"{where}: models/model.json is not JSON torch would read: {exc}") from exc
    if isinstance(root, dict):
        _check_program(root, where)
    return sorted(modules)


def _check_entry(key: str, value: Any, where: str) -> None:
    # "" is a positional argument's name (it cannot become code).
    if key in _NAME_KEYS and isinstance(value, str) and value and not _plain_name(value):
        raise UnsafeProgramError(
            f"{where}: a graph value is named {value[:80]!r}; torch writes names into the code it generates "
            "and runs, so only plain identifiers are read"
        )
    if key == "expr_str":
        if not isinstance(value, str):
            raise UnsafeProgramError(f"{where}: a symbolic expression is {value!r:.80}, not text")
        _check_expression(value, where)


def _check_program(root: dict[str, Any], where: str) -> None:
    ranges = root.get("range_constraints")
    for symbol in ranges if isinstance(ranges, dict) else ():
        if not _plain_name(symbol):
            raise UnsafeProgramError(f"{where}: a range constraint names symbol {symbol[:80]!r}")
    guards = root.get("guards_code", [])
    if not isinstance(guards, list):
        raise UnsafeProgramError(f"{where}: guards_code is {type(guards).__name__}, expected a list")
    for guard in guards:
        if not isinstance(guard, str):
            raise UnsafeProgramError(f"{where}: a guard is {guard!r:.80}, not text")
        _check_guard(guard, where)


def _plain_name(name: str) -> bool:
    return bool(_IDENTIFIER.match(name)) and not keyword.iskeyword(name) and not name.startswith("__")


def _parse(text: str, what: str, where: str) -> ast.AST:
    if len(text) > 20_000:
        raise UnsafeProgramError(f"{where}: a {what} of {len(text)} characters; refused")
    try:
        return ast.parse(text, mode="eval")
    except (SyntaxError, ValueError, RecursionError) as exc:
        raise UnsafeProgramError(f"{where}: a {what} torch never writes: {text[:80]!r}") from exc


def _check_expression(text: str, where: str) -> None:
    """``sympy.sympify`` evaluates the text: only sympy constructors over numbers and symbols."""

    def ok(node: ast.AST) -> bool:
        if isinstance(node, ast.Expression):
            return ok(node.body)
        if isinstance(node, ast.Constant):
            return isinstance(node.value, int | float | bool) or (
                isinstance(node.value, str) and (_plain_name(node.value) or bool(_NUMBER.match(node.value)))
            )
        if isinstance(node, ast.Name):
            return node.id in _SYMPY_NAMES or node.id in _SYMPY_CALLS or _plain_name(node.id)
        if isinstance(node, ast.Call):
            return (
                isinstance(node.func, ast.Name)
                and node.func.id in _SYMPY_CALLS
                and all(ok(a) for a in node.args)
                and all(k.arg in _SYMBOL_KEYWORDS and ok(k.value) for k in node.keywords)
            )
        if isinstance(node, ast.BinOp | ast.UnaryOp | ast.BoolOp | ast.Compare):
            return _operators_ok(node) and all(ok(c) for c in ast.iter_child_nodes(node) if _is_operand(c))
        return False

    if not ok(_parse(text, "symbolic expression", where)):
        raise UnsafeProgramError(
            f"{where}: symbolic expression {text[:80]!r} is not one torch writes (sympy evaluates it)"
        )


def _check_guard(text: str, where: str) -> None:
    """``ExportedProgram.module()`` pastes guards into code it runs: only size comparisons."""

    def ok(node: ast.AST) -> bool:
        if isinstance(node, ast.Expression):
            return ok(node.body)
        if isinstance(node, ast.Constant):
            return isinstance(node.value, int | float | bool)
        if isinstance(node, ast.Name):
            return node.id == "L"
        if isinstance(node, ast.Subscript):
            index = node.slice
            key_ok = isinstance(index, ast.Constant) and (
                (isinstance(index.value, int) and not isinstance(index.value, bool))
                or (isinstance(index.value, str) and _plain_name(index.value))
            )
            return key_ok and ok(node.value)
        if isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                callee_ok = func.attr in _GUARD_METHODS and ok(func.value)
            else:
                callee_ok = isinstance(func, ast.Name) and func.id in _GUARD_CALLS
            return callee_ok and not node.keywords and all(ok(a) for a in node.args)
        if isinstance(node, ast.BinOp | ast.UnaryOp | ast.BoolOp | ast.Compare):
            return _operators_ok(node) and all(ok(c) for c in ast.iter_child_nodes(node) if _is_operand(c))
        return False

    if "\n" in text or "\r" in text or not ok(_parse(text, "guard", where)):
        raise UnsafeProgramError(f"{where}: guard {text[:80]!r} is not a size check torch writes; refused")


def _is_operand(node: ast.AST) -> bool:
    return not isinstance(node, ast.operator | ast.unaryop | ast.boolop | ast.cmpop)


def _operators_ok(node: ast.AST) -> bool:
    ops = getattr(node, "ops", None) or [getattr(node, "op", None)]
    return all(isinstance(op, _OPERATORS) for op in ops)


def registered_op_modules(archive: bytes) -> list[str]:
    """The modules defining the custom ops a program archive calls (its text names each call
    ``torch.ops.<namespace>.<op>.<overload>``), as this process registered them: what a process that
    never imported them must import before it reads the archive (the native build's worker). Only ops
    registered here count, so each module was imported by this process, never named by the archive."""
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(archive)) as archive_zip:
        name = next(n for n in archive_zip.namelist() if n.endswith("/models/model.json"))
        text = archive_zip.read(name)
    bounds = {"max_bytes": len(text), "max_depth": _DOCUMENT_DEPTH}  # as the program's check reads it
    stack: list[Any] = [json_reader.loads(text, "a program's text", **bounds)]
    targets: set[str] = set()
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            target = item.get("target")
            if isinstance(target, str) and target.startswith("torch.ops."):
                targets.add(target)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    parts = [target.split(".") for target in targets]
    named = (op_module(p[2], p[3]) for p in parts if len(p) >= 4 and p[2] not in ("aten", "prims"))
    return sorted({module for module in named if module is not None})
