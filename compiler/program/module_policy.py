"""Which modules loading a program or package may import: one policy, decided here.

A program that calls a custom op or returns a custom pytree type (transformers' ``ModelOutput``) loads
only once the module defining it is imported, and importing a module runs its code. A load imports a
module its package names only if this process allows it:

* it is already imported (importing it again runs nothing);
* it matches, as a module prefix, the caller's ``allowed_modules`` (``--allow-op-module`` on the CLI);
* it matches ``$KILN_ALLOWED_OP_MODULES`` (comma-separated prefixes) or, where that variable is not set
  at all, ``DEFAULT_ALLOWED_MODULES``.

``DEFAULT_ALLOWED_MODULES`` names only modules of well-known installed libraries that define the data
types a compiled Hugging Face model's outputs are (so an ``hf:`` package loads with no argument);
importing them defines classes and runs no user-supplied code. docs/security.md gives the reasoning.
Setting ``KILN_ALLOWED_OP_MODULES`` replaces the defaults; setting it empty is the strict mode: nothing
is imported on a package's word but what the caller passes, and an MLflow pyfunc model ignores the
module list it was logged with (:func:`is_strict`).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import Future, wait
from typing import Any

ALLOWED_MODULES_ENV = "KILN_ALLOWED_OP_MODULES"

# Exact modules, matched as prefixes (so their submodules too; these have none). Not "transformers":
# that prefix would admit every model's modeling code, which a package has no business choosing.
DEFAULT_ALLOWED_MODULES: tuple[str, ...] = (
    "transformers.modeling_outputs",  # BaseModelOutput, SequenceClassifierOutput, ...: HF outputs
    "transformers.cache_utils",  # DynamicCache and friends: a causal LM that returns its cache
)

# kiln's own op modules: a program that calls ``kiln::`` ops names one, and importing it runs kiln's
# code (the op's definition), nothing of the package's: allowed in every mode, strict included.
KILN_OP_MODULES: tuple[str, ...] = ("compiler.generation.attention",)

MODULE_NAME = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


def configured_prefixes() -> tuple[str, ...]:
    """``$KILN_ALLOWED_OP_MODULES`` where set (empty: none, the strict mode), else the defaults."""
    env = os.environ.get(ALLOWED_MODULES_ENV)
    if env is None:
        return DEFAULT_ALLOWED_MODULES
    return tuple(p.strip() for p in env.split(",") if p.strip())


def is_strict() -> bool:
    """The user set ``KILN_ALLOWED_OP_MODULES`` to nothing: only the caller's own allow list counts."""
    env = os.environ.get(ALLOWED_MODULES_ENV)
    return env is not None and not env.strip(",").strip()


def allowed_module_prefixes(allowed: Sequence[str] | None = None) -> tuple[str, ...]:
    """The caller's allow list plus :func:`configured_prefixes`."""
    return tuple(p.strip() for p in [*(allowed or ()), *configured_prefixes()] if p and p.strip())


def is_allowed_module(module: str, prefixes: Sequence[str]) -> bool:
    return module in KILN_OP_MODULES or any(
        module == p or module.startswith(p.rstrip(".") + ".") for p in prefixes
    )


# A pytree defaultdict's factory is called whenever a missing key is read, so naming one is naming
# code to run: only these builtin containers and numbers are taken (by module and qualified name, as
# torch's pytree writes them), whatever modules are imported or allowed.
DEFAULT_FACTORIES: frozenset[tuple[str, str]] = frozenset(
    ("builtins", name)
    for name in ("list", "dict", "set", "frozenset", "tuple", "int", "float", "str", "bool")
)


def default_factory_refusal(module: object, name: object) -> str | None:
    """Why a pytree defaultdict factory is refused, or None for one of :data:`DEFAULT_FACTORIES`."""
    if (module, name) in DEFAULT_FACTORIES:
        return None
    return (
        f"a defaultdict factory {module!s:.60}.{name!s:.60} (only builtin containers and numbers are taken)"
    )


# Modules import_in_background is importing now -> its future (set when its thread is done).
_BACKGROUND: dict[str, Future] = {}
_BACKGROUND_LOCK = threading.Lock()


def import_in_background(modules: Sequence[str]) -> None:
    """Start importing ``modules`` on a thread of their own: modules a load has held to this policy
    (``compiler.program.export.import_allowed_modules``, with them as ``defer``) and needs only later (a
    package's output types: transformers' ModelOutput, 1.4-2.2 s on the H100 host). The load's reads and
    engines run beside it; ``import_allowed_modules`` waits for it (:func:`wait_for_background_import`)
    before it imports one of them itself, so an import that failed here fails there again, typed."""
    with _BACKGROUND_LOCK:
        todo = [m for m in modules if m not in sys.modules and m not in _BACKGROUND]
        if not todo:
            return
        done: Future = Future()
        for module in todo:
            _BACKGROUND[module] = done

    def run() -> None:
        try:
            for module in todo:
                importlib.import_module(module)
            done.set_result(None)
        except BaseException as exc:  # raised again by the caller's own import of it
            done.set_exception(exc)
        finally:
            with _BACKGROUND_LOCK:
                for module in todo:
                    _BACKGROUND.pop(module, None)

    # Not a daemon: the interpreter waits for it at exit. A daemon thread still importing (torch's and
    # transformers' C++ extensions) while the interpreter finalizes aborts the process ("terminate called
    # without an active exception"), e.g. a script that loads a package and exits at once.
    threading.Thread(target=run, name="kiln-import", daemon=False).start()


def wait_for_background_import(module: str) -> None:
    """Wait until :func:`import_in_background` is done with ``module`` (at once where it has none)."""
    pending = _BACKGROUND.get(module)
    if pending is not None:
        wait([pending])


def custom_op_modules(program: Any) -> set[str]:
    """Modules defining the custom ops (``torch.library.custom_op``) an exported program calls."""
    import torch

    modules: set[str] = set()
    for node in program.graph.nodes:
        target = node.target
        custom = isinstance(target, torch._ops.OpOverload) and target.namespace not in ("aten", "prims")
        if node.op == "call_function" and custom:
            module = op_module(target.namespace, target._opname)
            if module is not None:
                modules.add(module)
    return modules


def op_module(namespace: str, op: str) -> str | None:
    """The module that defined custom op ``namespace::op`` in this process (its ``custom_op``
    function's module); None for an op this process did not register, or one defined in ``__main__``."""
    import torch

    definition = torch._library.custom_ops.OPDEFS.get(f"{namespace}::{op}")
    function = getattr(definition, "_init_fn", None)
    if function is None or function.__module__ == "__main__":
        return None
    return function.__module__
