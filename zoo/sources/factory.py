"""``factory:`` sources: a Python function that builds the model (``zoo.models:tiny_bert``).

The factory returns ``zoo.models.ModelCase(model, args, kwargs, dynamic_shapes)`` and is called with the
entry's ``factory_kwargs`` under ``torch.manual_seed(seed)``, so every build has the same random weights.

Trust (docs/security.md): a zoo file names code, so only code the operator vouched for may run. The
factory must be a function *defined* in its module (``os:system`` is refused: it is defined in ``posix``),
the module must not be part of the standard library, and it must live in a package the settings allow
(``settings.factory_packages``, default ``[zoo]``) or in the zoo file's own directory. Nothing is
imported before the name passes these checks.

Identity without loading: the module's source bytes (sha256), the function, its kwargs and seed, and
the torch version that draws the random weights.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import re
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from zoo.errors import UntrustedCodeError, ZooConfigError
from zoo.sources.base import LoadedCase, SourceIdentity, digest_of, torch_version

FACTORY_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
DEFAULT_FACTORY_PACKAGES = ("zoo",)


@dataclass(frozen=True)
class FactoryPolicy:
    """Where factories may come from: module prefixes, and the zoo file's own directory."""

    packages: tuple[str, ...] = DEFAULT_FACTORY_PACKAGES
    zoo_dir: str | None = None

    def allows_package(self, module: str) -> bool:
        return any(module == p or module.startswith(p + ".") for p in self.packages)


def _origin_dir(top: str) -> Path | None:
    spec = importlib.util.find_spec(top)  # a top-level name: finding it runs nothing
    if spec is None:
        return None
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations))).resolve()
    return Path(spec.origin).resolve().parent if spec.origin else None


def check_factory_allowed(spec: str, policy: FactoryPolicy, where: str = "factory") -> None:
    """Refuse a factory outside the policy, before anything is imported."""
    if not FACTORY_RE.match(spec):
        raise ZooConfigError(
            f"{where}: {spec!r} must look like 'package.module:function', e.g. zoo.models:tiny_bert"
        )
    module = spec.partition(":")[0]
    top = module.split(".")[0]
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        raise UntrustedCodeError(
            f"{where}: {spec!r} is in the standard library; a factory must be a model-building function "
            "of your own package (docs/security.md)"
        )
    if policy.allows_package(module):
        return
    zoo_dir = Path(policy.zoo_dir).resolve() if policy.zoo_dir else None
    with _on_path(zoo_dir):
        origin = _origin_dir(top)
    if origin is None:
        raise ZooConfigError(
            f"{where}: cannot import module {module!r} (no module named {top!r}); "
            "make sure it is installed or on PYTHONPATH (run from the repository root)"
        )
    if zoo_dir is not None and origin.is_relative_to(zoo_dir):
        return
    allowed = ", ".join(policy.packages) or "none"
    raise UntrustedCodeError(
        f"{where}: module {module!r} is not trusted for factories; allowed packages: {allowed}"
        + (f", or modules in the zoo file's directory {policy.zoo_dir}" if policy.zoo_dir else "")
        + "; add its package to settings.factory_packages if you vouch for it (docs/security.md)"
    )


class _on_path:
    """The zoo file's directory on sys.path while its own modules are found and imported."""

    def __init__(self, directory: Path | None):
        self.directory = str(directory) if directory is not None else None
        self.added = False

    def __enter__(self) -> None:
        if self.directory and self.directory not in sys.path:
            sys.path.insert(0, self.directory)
            self.added = True

    def __exit__(self, *exc: object) -> None:
        if self.added:
            sys.path.remove(self.directory)


def resolve_factory(spec: str, policy: FactoryPolicy, where: str = "factory") -> Callable[..., Any]:
    """Check ``module:function`` against the policy, import it, and return the function."""
    check_factory_allowed(spec, policy, where)
    module_name, _, attr = spec.partition(":")
    try:
        with _on_path(Path(policy.zoo_dir) if policy.zoo_dir else None):
            module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ZooConfigError(
            f"{where}: cannot import module {module_name!r} ({exc}); "
            "make sure it is installed or on PYTHONPATH (run from the repository root)"
        ) from None
    except Exception as exc:  # a module that raises on import is still the user's module to fix
        raise ZooConfigError(
            f"{where}: importing {module_name!r} raised {type(exc).__name__}: {exc}"
        ) from None
    fn = getattr(module, attr, None)
    defined = sorted(
        n
        for n, v in vars(module).items()
        if inspect.isfunction(v) and v.__module__ == module.__name__ and not n.startswith("_")
    )
    if fn is None:
        raise ZooConfigError(
            f"{where}: module {module_name!r} has no {attr!r}; functions there: {', '.join(defined[:15])}"
        )
    if not inspect.isfunction(fn) or fn.__module__ != module.__name__:
        raise UntrustedCodeError(
            f"{where}: {spec!r} is not a function defined in {module_name!r} (it is "
            f"{getattr(fn, '__module__', None) or type(fn).__name__}.{getattr(fn, '__name__', attr)}); "
            f"name one of: {', '.join(defined[:15])}"
        )
    return fn


@dataclass(frozen=True)
class FactorySource:
    """A model built by calling a trusted factory function with kwargs under a seed."""

    factory: str
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    seed: int = 0
    policy: FactoryPolicy = field(default_factory=FactoryPolicy)

    @property
    def uri(self) -> str:
        return f"factory:{self.factory}"

    @property
    def trusted_modules(self) -> tuple[str, ...]:
        """The factory's module, trusted by the zoo file: it registers the custom ops its models call."""
        return (self.factory.partition(":")[0],)

    def identity(self) -> SourceIdentity:
        resolve_factory(self.factory, self.policy)  # trusted, importable, a function defined there
        module = self.factory.partition(":")[0]
        with _on_path(Path(self.policy.zoo_dir) if self.policy.zoo_dir else None):
            spec = importlib.util.find_spec(module)
        if spec is None or not spec.origin or not Path(spec.origin).is_file():
            raise ZooConfigError(f"factory: cannot find the source of module {module!r}")
        source_sha = hashlib.sha256(Path(spec.origin).read_bytes()).hexdigest()
        digest = digest_of("factory", self.factory, dict(self.kwargs), self.seed, source_sha, torch_version())
        return SourceIdentity("factory", self.uri, source_sha[:16], digest)

    def load(self) -> LoadedCase:
        import torch

        fn = resolve_factory(self.factory, self.policy)
        kwargs = dict(self.kwargs)
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            params = {}
        if "seed" in params and "seed" not in kwargs:
            kwargs["seed"] = self.seed
        # Random weights must be the same every time the model is built (export, validation, release).
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            try:
                case = fn(**kwargs)
            except TypeError as exc:
                raise ZooConfigError(
                    f"factory_kwargs: {self.factory}(**{kwargs}) failed: {exc}; "
                    "check the keyword names against the factory's signature"
                ) from None
        model = getattr(case, "model", None)
        if not isinstance(model, torch.nn.Module):
            raise ZooConfigError(
                f"factory: {self.factory} returned {type(case).__name__}; expected "
                "zoo.models.ModelCase(model, args, kwargs, dynamic_shapes) with an nn.Module as model"
            )
        args = tuple(getattr(case, "args", ()) or ())
        return LoadedCase(model.eval(), args, dict(getattr(case, "kwargs", {}) or {}), case.dynamic_shapes)
