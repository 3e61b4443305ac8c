"""``pt2:`` sources: a ``torch.export.save`` program file (absolute, or relative to the zoo file).

Identity without loading: the file's sha256 (and the torch version that reads it); a file that is not a
zip archive at all (truncated, or not a program) is refused here already, before any build.

Loading goes through ``compiler.load_program``, which refuses an archive holding anything torch would
unpickle (pickled weights or constants, custom objects, non-tensor sample inputs) and imports the
modules it names only where this process allows them. The model is ``program.module()``; its example
inputs are drawn from the program's input specs at their opt shape (inside the entry's ``inputs:``
ranges where given) and its dynamic shapes are the specs' ranges, so a re-export keeps the ranges the
program was exported with. A program whose ranges are unbounded is refused: export it with
``torch.export.Dim(name, min=..., max=...)``.
"""

from __future__ import annotations

import inspect
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from compiler.errors import KilnError, OpModuleNotAllowedError, SpecialFileError, UnsafeProgramError
from compiler.inputs.files import regular_file
from compiler.inputs.specs import InputSpec
from zoo.errors import UntrustedCodeError, ZooConfigError
from zoo.sources.base import LoadedCase, SourceIdentity, digest_of, torch_version
from zoo.sources.common import example_size, fit_example_shape, override_dims, resolve_path, sha256_file

if TYPE_CHECKING:  # the identity is a file hash: torch only where the program loads
    import torch
    from torch.export import Dim


@dataclass(frozen=True)
class Pt2Source:
    """A torch.export program file (see the module docstring)."""

    path: str  # what follows "pt2:"
    inputs: Mapping[str, Any] = field(default_factory=dict)  # the entry's ranges: examples sit inside
    base_dir: str | None = None

    @property
    def uri(self) -> str:
        return f"pt2:{self.path}"

    def file(self) -> Path:
        path = resolve_path(self.path, self.base_dir)
        try:
            regular_file(path, f"source: {self.uri}:")
        except SpecialFileError as exc:
            raise ZooConfigError(str(exc)) from None
        except OSError:
            pass  # named below
        if not path.is_file():
            relative = self.base_dir and not Path(self.path).is_absolute()
            where = f" (relative to {self.base_dir})" if relative else ""
            raise ZooConfigError(
                f"source: {self.uri}: file {str(path)!r}{where} does not exist; write the path of a "
                "torch.export.save file"
            )
        return path

    def identity(self) -> SourceIdentity:
        path = self.file()
        if not zipfile.is_zipfile(path):
            raise ZooConfigError(
                f"source: {self.uri}: {str(path)!r} is not a torch.export archive (no zip directory: "
                "truncated or another format); save it again with torch.export.save"
            )
        sha = sha256_file(path)
        return SourceIdentity("pt2", self.uri, sha[:16], digest_of("pt2", sha, torch_version()))

    def load(self) -> LoadedCase:
        import compiler

        path = self.file()
        try:
            program = compiler.load_program(path)
            specs = compiler.input_specs(program)
        except (UnsafeProgramError, OpModuleNotAllowedError) as exc:
            raise UntrustedCodeError(f"source: {self.uri}: {exc}") from exc
        except KilnError as exc:  # ExportError (corrupt, truncated), InputSpecError (unbounded ranges)
            raise ZooConfigError(f"source: {self.uri}: cannot be compiled: {exc}") from exc
        return program_case(program, specs, self.inputs)


def program_case(program: Any, specs: Sequence[InputSpec], inputs: Mapping[str, Any] | None) -> LoadedCase:
    """``program.module()`` with example inputs and dynamic shapes from ``specs`` (see the module
    docstring); ``inputs``: the entry's ranges, which the examples are moved inside."""
    import torch
    from torch.export import Dim

    model = program.module()
    flat = [_example(spec, override_dims(inputs, spec.name)) for spec in specs]
    dims: dict[str, Dim] = {}
    shapes = []
    for spec in specs:
        per_axis = {}
        for axis, name in spec.dynamic_dims.items():
            lo, hi = spec.dim_range(axis)
            per_axis[axis] = dims.setdefault(name, Dim(name, min=lo, max=hi))
        shapes.append(per_axis or None)
    args, kwargs = torch.utils._pytree.tree_unflatten(flat, program.call_spec.in_spec)
    # torch.export takes dynamic shapes by the forward's parameter names: bind the examples to them.
    try:
        bound = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    except TypeError as exc:
        raise ZooConfigError(f"source: the program's inputs do not bind to its module: {exc}") from None
    if len(bound) != len(flat) or not all(isinstance(v, torch.Tensor) for v in bound.values()):
        raise ZooConfigError("source: kiln re-exports programs whose inputs are tensors, one per argument")
    return LoadedCase(model, tuple(args), dict(kwargs), dict(zip(bound, shapes, strict=True)))


def _example(spec: InputSpec, override: list[Any] | None) -> torch.Tensor:
    """A deterministic example for ``spec`` at its opt shape (dynamic sizes at least 2: export would
    specialize 0 or 1), inside the override's ranges; integers span the spec's value range."""
    import torch

    shape = list(spec.opt_shape)
    for axis in spec.dynamic_dims:
        lo, hi = spec.dim_range(axis)
        shape[axis] = example_size(shape[axis], lo, hi)
    shape = fit_example_shape(shape, override)
    generator = torch.Generator().manual_seed(0)
    dtype = spec.torch_dtype
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    lo, hi = (int(v) for v in spec.value_range) if spec.value_range else (0, 1)
    value = torch.randint(lo, hi + 1, shape, generator=generator, dtype=dtype)
    if value.numel() >= 2:  # the example's range is what validation later draws from: keep it whole
        value.view(-1)[0], value.view(-1)[-1] = lo, hi
    return value
