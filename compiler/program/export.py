"""Export: torch.export with the input specs captured once and attached to the program.

The specs ride on the program's user-input placeholders (``node.meta["custom"]``, which survives
``run_decompositions``) and, on disk, in the ``.pt2`` archive's extra files. Programs exported with plain
``torch.export`` carry no specs: :func:`input_specs` then derives them from the program's own range
constraints and example inputs, and refuses unbounded ranges.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import io
import itertools
import json
import os
import re
import sys
import types
import typing
import zipfile
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.export import ExportedProgram

from compiler import json_reader
from compiler.atomic import write_bytes_atomic
from compiler.errors import ExportError, InputSpecError, OpModuleNotAllowedError, UnsafeProgramError
from compiler.inputs.specs import InputSpec, dtype_name, specs_from_json, specs_to_json
from compiler.program import module_policy
from compiler.program.module_policy import ALLOWED_MODULES_ENV, allowed_module_prefixes, is_allowed_module
from compiler.program.module_policy import MODULE_NAME as _MODULE_NAME
from compiler.program.outputs import index_bounds
from compiler.program.text import check_program_text
from compiler.program.tracing import TRACING

if TYPE_CHECKING:  # sympy itself costs ~0.3 s at import, which a package load does not need
    import sympy


SPEC_META_KEY = "kiln_input_spec"
SPEC_EXTRA_FILE = "kiln_input_specs.json"
# Modules that register what the program refers to by name: pytree types of its inputs/outputs (e.g.
# transformers' ModelOutput classes) and custom ops (torch.library). torch.export.load needs them
# imported first, so a program or package loads in a process that never imported the model.
MODULES_EXTRA_FILE = "kiln_import_modules.json"


def export(
    model: torch.nn.Module,
    args: tuple = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    dynamic_shapes: Any = None,
    strict: bool = False,
) -> ExportedProgram:
    """``torch.export.export`` plus input specs (names, dtypes, min/opt/max, named dims), attached once.

    ``opt`` is the example input's shape; ``min``/``max`` come from the ``Dim`` ranges in
    ``dynamic_shapes``; dimension names are the ``Dim`` names.
    """
    kwargs = dict(kwargs or {})
    try:
        with TRACING, _sdpa_for_tracing(model, args, kwargs):
            program = torch.export.export(
                model, tuple(args), kwargs, dynamic_shapes=dynamic_shapes, strict=strict
            )
    except Exception as exc:  # torch raises many types here; the user needs one with the cause
        raise ExportError(
            f"torch.export could not trace {type(model).__name__}: {type(exc).__name__}: {exc}".strip()[:4000]
        ) from exc
    dim_names = _dim_names(model, args, kwargs, dynamic_shapes)
    specs = _specs_from_program(program, dim_names, require_bounded=True)
    attach_specs(program, specs)
    return program


def _sdpa_for_tracing(model: torch.nn.Module, args: tuple, kwargs: Mapping[str, Any]) -> Any:
    """On CUDA, the math attention kernel while tracing. The traced graph keeps
    ``aten.scaled_dot_product_attention`` either way (the kernel is chosen again where the engine is
    built); only the shape propagation differs. CUDA's memory-efficient kernel aligns an explicit mask by
    padding and slicing it, which with a dynamic sequence length adds guards (``seq % 8 == 0``...) that
    no range satisfies: ``Constraints violated (seq)!`` for every Hugging Face text model with an
    attention mask (torch 2.11 on an H100; pytorch/pytorch#124502)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    leaves = torch.utils._pytree.tree_leaves((args, dict(kwargs)))
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    tensors += itertools.islice(model.parameters(), 1)  # a model whose inputs are all Python values
    on_cuda = any(t.device.type == "cuda" for t in tensors)
    return sdpa_kernel([SDPBackend.MATH]) if on_cuda else contextlib.nullcontext()


def attach_specs(program: ExportedProgram, specs: Sequence[InputSpec]) -> None:
    """Attach specs to the program's user-input placeholders (in place)."""
    placeholders = _user_input_nodes(program)
    if len(placeholders) != len(specs):
        raise InputSpecError(f"program has {len(placeholders)} user inputs but {len(specs)} specs were given")
    for node, spec in zip(placeholders, specs, strict=True):
        node.meta.setdefault("custom", {})[SPEC_META_KEY] = json.dumps(spec.to_dict(), sort_keys=True)


def input_specs(program: ExportedProgram) -> tuple[InputSpec, ...]:
    """The program's specs: attached ones, else derived from its range constraints (bounded only)."""
    placeholders = _user_input_nodes(program)
    attached = [n.meta.get("custom", {}).get(SPEC_META_KEY) for n in placeholders]
    if placeholders and all(attached):
        return tuple(InputSpec.from_dict(json_reader.loads(text, "an input spec")) for text in attached)
    return _specs_from_program(program, {}, require_bounded=True)


def save_program(program: ExportedProgram, path: str | os.PathLike, *, record_modules: bool = True) -> Path:
    """``torch.export.save`` with the specs as an extra file; written atomically, byte-for-byte
    reproducible (equal programs, equal files) and without pickled sample inputs.

    ``record_modules``: also list the modules that register the program's custom ops and pytree
    types (:func:`import_modules`), for a standalone program; a package records them in its manifest.
    """
    path = Path(path)
    write_bytes_atomic(path, program_bytes(program, record_modules=record_modules))
    return path


def program_bytes(program: ExportedProgram, *, record_modules: bool = True) -> bytes:
    """The ``.pt2`` archive of ``program`` as bytes (see :func:`save_program`)."""
    specs = input_specs(program)
    extra = {SPEC_EXTRA_FILE: specs_to_json(specs)}
    if record_modules:
        extra[MODULES_EXTRA_FILE] = json.dumps(import_modules(program))
    # No example inputs: torch pickles them (data/sample_inputs), and kiln carries its inputs as specs.
    bare = copy.copy(program)
    bare.example_inputs = None
    # Saved into memory, the archive's root folder is always "archive" (a file's would be named after
    # the temporary file), so equal programs give equal bytes and an equal package content hash.
    buffer = io.BytesIO()
    torch.export.save(bare, buffer, extra_files=extra)
    return buffer.getvalue()


def import_modules(program: ExportedProgram) -> list[str]:
    """Modules defining the program's non-builtin container types and custom ops."""
    modules = module_policy.custom_op_modules(program)

    def walk(spec: Any) -> None:
        kind = getattr(spec, "type", None)
        if kind is not None and kind.__module__ not in (
            "builtins",
            "collections",
            "torch.fx.immutable_collections",
        ):
            modules.add(kind.__module__)
        for child in spec.children() if hasattr(spec, "children") else ():
            walk(child)

    for spec in (program.call_spec.in_spec, program.call_spec.out_spec):
        if spec is not None:
            walk(spec)
    return sorted(modules)


def load_program(path: str | os.PathLike, *, allowed_modules: Sequence[str] | None = None) -> ExportedProgram:
    """Load a ``.pt2`` archive without unpickling anything; re-attaches specs saved by :func:`save_program`.

    The modules the archive records (custom ops, pytree types) are imported only when this process
    allows them: already imported, in ``allowed_modules`` or in ``$KILN_ALLOWED_OP_MODULES`` (module
    prefixes, comma-separated); else :class:`OpModuleNotAllowedError`. An archive holding anything
    torch would unpickle is refused with :class:`UnsafeProgramError`.
    """
    data = Path(path).read_bytes()  # once: what is checked is what torch reads
    return load_program_bytes(data, str(path), allowed_modules=allowed_modules)


def load_program_bytes(
    data: bytes,
    where: str,
    *,
    modules: Sequence[str] | None = None,
    allowed_modules: Sequence[str] | None = None,
) -> ExportedProgram:
    """:func:`load_program` on the archive's bytes. ``modules``: the modules its owner recorded (a
    package's manifest); None reads the list the archive itself carries."""
    named = check_archive(data, where)
    recorded = list(modules) if modules is not None else recorded_modules(data)
    import_allowed_modules(
        sorted(set(recorded) | set(named)), where, allowed=allowed_modules, recorded=recorded
    )
    extra = {SPEC_EXTRA_FILE: "", MODULES_EXTRA_FILE: ""}
    _cache_schema_type_hints()
    try:
        program = torch.export.load(io.BytesIO(data), extra_files=extra)
    except Exception as exc:
        raise ExportError(f"{where} is not a loadable torch.export archive: {exc}") from exc
    _check_calls_by_name(program, where, allowed_modules, recorded)
    if extra[SPEC_EXTRA_FILE]:
        attach_specs(program, specs_from_json(extra[SPEC_EXTRA_FILE]))
    return program


class _SchemaTyping(types.ModuleType):
    """``typing`` as torch.export's deserializer sees it, with ``get_type_hints`` answered once per
    class. The deserializer asks it for every serialized dataclass instance it rebuilds (~11k calls for
    a BERT-base graph, about 40% of its load, a cold-start cost); the schema classes never change, so
    the answer per class never does. Every other name is typing's own."""

    def __init__(self) -> None:
        super().__init__("typing")
        # typing's own names as attributes (no per-call lookup), then this class's get_type_hints.
        self.__dict__.update({k: v for k, v in vars(typing).items() if k != "get_type_hints"})
        self._hints: dict[tuple, dict] = {}

    def get_type_hints(
        self, obj: Any, globalns: Any = None, localns: Any = None, include_extras: bool = False
    ):
        if localns is not None or not isinstance(obj, type):
            return typing.get_type_hints(obj, globalns, localns, include_extras)
        key = (obj, id(globalns), include_extras)
        hints = self._hints.get(key)
        if hints is None:
            hints = self._hints[key] = typing.get_type_hints(obj, globalns, None, include_extras)
        return dict(hints)  # a copy: a caller may edit what it gets, as with typing's own


def _cache_schema_type_hints() -> None:
    """Install :class:`_SchemaTyping` in torch's deserializer once (where its module reads ``typing``
    as a global, as torch 2.11 to 2.13 do; otherwise nothing changes)."""
    from torch._export.serde import serialize

    if getattr(serialize, "typing", None) is typing:
        serialize.typing = _SchemaTyping()


# ---------------------------------------------------------------- what loading an archive may run

# Every entry torch.export.save writes for one program, below the archive's root folder. Anything
# else (legacy pickled weights, custom or opaque objects, AOTInductor code, a second model) is refused.
_ARCHIVE_ENTRIES = re.compile(
    r"^(archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
    r"|models/model\.json|data/sample_inputs/model\.pt"
    r"|data/weights/model_weights_config\.json|data/weights/weight_\d+"
    r"|data/constants/model_constants_config\.json|data/constants/tensor_\d+"
    r"|extra/[A-Za-z0-9_.-]+)$"
)


def check_archive(data: bytes, where: str) -> list[str]:
    """Refuse an archive that torch.export.load would unpickle anything from; return the modules its
    program text names for import, after refusing text torch would turn into code
    (:func:`compiler.program.text.check_program_text`: names, symbolic expressions, guards).

    torch.export.load unpickles weights and constants marked ``use_pickle``, custom and opaque
    objects, and falls back to a full unpickle of the sample inputs when a weights-only read fails.
    Here: no pickled entry, no entry outside ``_ARCHIVE_ENTRIES``, and sample inputs that are empty
    (kiln writes none) or read weights-only, which makes torch's own first (weights-only) read succeed.
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        names = archive.namelist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise UnsafeProgramError(f"{where} is not a torch.export archive: {exc}") from exc
    if any(info.compress_type != zipfile.ZIP_STORED for info in archive.infolist()):
        # torch.export.save stores its entries; nothing here is inflated (a deflate bomb) to find out.
        raise UnsafeProgramError(f"{where} holds compressed entries; torch.export.save writes none")
    roots = {name.split("/", 1)[0] for name in names}
    if len(roots) != 1 or any("/" not in name for name in names):
        raise UnsafeProgramError(
            f"{where}: a torch.export archive has one root folder; found {sorted(roots)[:5]}"
        )
    root = roots.pop() + "/"
    entries = {name[len(root) :]: name for name in names}
    unknown = sorted(rel for rel in entries if not _ARCHIVE_ENTRIES.match(rel))
    if unknown:
        raise UnsafeProgramError(
            f"{where} holds entries a kiln program never has (they may be pickles torch would load): "
            f"{unknown[:5]}; refused"
        )
    for required in ("archive_version", "models/model.json"):
        if required not in entries:
            raise UnsafeProgramError(f"{where} lacks {required}; not a torch.export archive")
    for config, prefix in (
        ("data/weights/model_weights_config.json", "weight_"),
        ("data/constants/model_constants_config.json", "tensor_"),
    ):
        if config not in entries:
            continue
        try:
            payloads = json_reader.loads(archive.read(entries[config]), f"{where}: {config}")["config"]
            items = list(payloads.items())
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise UnsafeProgramError(f"{where}: {config} is malformed: {exc}") from exc
        for fqn, meta in items:
            if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
                raise UnsafeProgramError(
                    f"{where}: {fqn!r} is stored pickled (use_pickle), which loading would unpickle; refused"
                )
            if not re.fullmatch(rf"{prefix}\d+", str(meta.get("path_name", ""))):
                raise UnsafeProgramError(f"{where}: {fqn!r} is not a plain tensor entry; refused")
    samples = entries.get("data/sample_inputs/model.pt")
    if samples is not None:
        payload = archive.read(samples)
        if payload:
            try:
                torch.load(io.BytesIO(payload), weights_only=True)
            except Exception as exc:
                raise UnsafeProgramError(
                    f"{where}: its sample inputs are not plain tensors (torch would unpickle them with "
                    f"weights_only=False): {type(exc).__name__}; refused"
                ) from exc
    return check_program_text(archive.read(entries["models/model.json"]), where)


def _check_calls_by_name(
    program: ExportedProgram, where: str, allowed: Sequence[str] | None, recorded: Sequence[str]
) -> None:
    """The one call torch's verifier lets a graph make by name: a custom autograd function, imported
    from the string the node carries when the graph runs. Its module follows the op-module rule."""
    from torch.export.custom_ops import _call_custom_autograd_function_in_pre_dispatch as by_name

    modules = []
    for module in program.graph_module.modules():
        for node in module.graph.nodes if isinstance(module, torch.fx.GraphModule) else ():
            if node.op == "call_function" and node.target is by_name:
                name = node.args[0] if node.args else None
                if not isinstance(name, str) or "." not in name:
                    raise UnsafeProgramError(f"{where}: a graph node calls {name!r} by name; refused")
                modules.append(name.rsplit(".", 1)[0])
    if modules:
        import_allowed_modules(sorted(set(modules)), where, allowed=allowed, recorded=recorded)


def recorded_modules(data: bytes) -> list[str]:
    """The modules a standalone archive records in its extra file (data: never imported from here)."""
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            names = [n for n in archive.namelist() if n.endswith("/extra/" + MODULES_EXTRA_FILE)]
            modules = json_reader.loads(archive.read(names[0]), MODULES_EXTRA_FILE) if names else []
    except (OSError, zipfile.BadZipFile, ValueError, KeyError):
        return []
    if not isinstance(modules, list) or not all(isinstance(m, str) for m in modules):
        raise UnsafeProgramError(f"{MODULES_EXTRA_FILE} must be a list of module names")
    return modules


def import_allowed_modules(
    modules: Sequence[str],
    where: str,
    *,
    allowed: Sequence[str] | None = None,
    recorded: Sequence[str] | None = None,
    defer: Collection[str] = (),
) -> None:
    """Import ``modules`` where this process allows it (already imported, or allowed by prefix);
    else raise :class:`OpModuleNotAllowedError` naming them and how to allow them. ``defer``: checked
    the same, imported later by whoever needs them (a load's output types: ``DeferredSpec``)."""
    prefixes = allowed_module_prefixes(allowed)
    bad_names = [m for m in modules if not _MODULE_NAME.match(m)]
    needed = [
        m for m in modules if m in bad_names or (m not in sys.modules and not is_allowed_module(m, prefixes))
    ]
    if needed:
        listed = list(recorded if recorded is not None else modules)
        raise OpModuleNotAllowedError(
            f"{where} needs modules imported that this process does not allow: {needed} (the package "
            f"records {listed} for its custom ops and input/output types). Importing runs their code: "
            f"if you trust them, pass allowed_modules={needed!r} to compiler.load, or set "
            f"{ALLOWED_MODULES_ENV}={','.join(needed)} (module prefixes, comma-separated), or import "
            "them before loading",
            needed=needed,
            recorded=listed,
        )
    for module in (m for m in modules if m not in defer):
        module_policy.wait_for_background_import(module)  # imported there, or failed there: tried here
        if module in sys.modules:
            continue
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ExportError(
                f"{where} uses types or ops from {module!r}, which cannot be imported here: {exc}; install it"
            ) from exc


def _user_input_nodes(program: ExportedProgram) -> list[torch.fx.Node]:
    names = set(program.graph_signature.user_inputs)
    return [n for n in program.graph.nodes if n.op == "placeholder" and n.name in names]


def _dim_names(
    model: torch.nn.Module, args: tuple, kwargs: dict, dynamic_shapes: Any
) -> dict[tuple[str, int], str]:
    """(input name, axis) -> Dim name, read from the user's ``dynamic_shapes``."""
    if dynamic_shapes is None:
        return {}
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs)
        order = list(bound.arguments)
    except (TypeError, ValueError):
        order = [f"arg{i}" for i in range(len(args))] + list(kwargs)
    if isinstance(dynamic_shapes, Mapping):
        per_input = dict(dynamic_shapes)
    else:
        per_input = dict(zip(order, dynamic_shapes, strict=False))
    names: dict[tuple[str, int], str] = {}
    for input_name, axes in per_input.items():
        items = axes.items() if isinstance(axes, Mapping) else enumerate(axes or ())
        for axis, dim in items:
            dim_name = getattr(dim, "__name__", None)
            if dim_name and dim_name not in ("AUTO", "STATIC", "DYNAMIC"):
                names[(input_name, int(axis))] = dim_name
    return names


def _specs_from_program(
    program: ExportedProgram, dim_names: dict[tuple[str, int], str], *, require_bounded: bool
) -> tuple[InputSpec, ...]:
    ranges = program.range_constraints
    examples = _example_values(program)
    bounds = index_bounds(program)
    symbol_names: dict[sympy.Symbol, str] = {}
    specs = []
    for index, node in enumerate(_user_input_nodes(program)):
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            raise InputSpecError(
                f"input {node.name!r} is a {type(val).__name__}, not a tensor; "
                "kiln compiles tensor inputs only"
            )
        example = examples[index] if examples is not None else None
        lo, opt, hi, dyn = [], [], [], {}
        for axis, size in enumerate(val.shape):
            if isinstance(size, int) or not isinstance(size, torch.SymInt) or size.node.expr.is_number:
                value = int(size)
                lo.append(value), opt.append(value), hi.append(value)
                continue
            expr = size.node.expr
            low, high = _expr_range(expr, ranges)
            if require_bounded and (high is None or low is None):
                raise InputSpecError(
                    f"input {node.name!r} axis {axis} ({expr}) has an unbounded range; export with "
                    f"torch.export.Dim(name, min=..., max=...) so engines get a finite profile"
                )
            for sym in expr.free_symbols:
                symbol_names.setdefault(sym, dim_names.get((node.name, axis), str(sym)))
            dyn[axis] = symbol_names[expr] if expr in symbol_names else str(expr)
            guess = int(example.shape[axis]) if isinstance(example, torch.Tensor) else high
            lo.append(low), hi.append(high), opt.append(min(max(guess, low), high))
        values = None
        if isinstance(example, torch.Tensor) and not example.is_floating_point() and example.numel():
            values = (float(example.min()), float(example.max()))
        specs.append(
            InputSpec(
                node.name,
                dtype_name(val.dtype),
                tuple(lo),
                tuple(opt),
                tuple(hi),
                dyn,
                values,
                index_bound=bounds.get(node.name),
            )
        )
    return tuple(specs)


def _expr_range(expr: sympy.Expr, ranges: Mapping) -> tuple[int | None, int | None]:
    """Integer bounds of a shape expression from the program's per-symbol ranges (monotone exprs)."""

    def bound(which: str) -> int | None:
        subs = {}
        for sym in expr.free_symbols:
            vr = ranges.get(sym)
            value = None if vr is None else getattr(vr, which)
            if value is None or not getattr(value, "is_finite", True) or abs(float(value)) > 2**62:
                return None
            subs[sym] = int(value)
        return int(expr.subs(subs))

    return bound("lower"), bound("upper")


def _example_values(program: ExportedProgram) -> list | None:
    example = getattr(program, "example_inputs", None)
    if not example:
        return None
    flat, _ = torch.utils._pytree.tree_flatten(example)
    return flat if len(flat) == len(program.graph_signature.user_inputs) else None
