"""Compiling a partition's program with Inductor, and the compiled graph as bytes.

:class:`ProgramGraph` is a partition's exported program as Inductor compiles it: once, symbolic in its
dynamic dims (:meth:`~ProgramGraph.compile`), or specialized to one shape profile
(:meth:`~ProgramGraph.compile_static`). :func:`save_artifact` / :func:`load_artifact` turn a compiled
graph into bytes and back (``CompiledArtifact``: code, loaded only where it is trusted).
:class:`LocalCompiled` keeps graphs this machine compiled from stored programs in the local engine
cache. The engine format is :mod:`compiler.backends.inductor.format`; building, loading and running
engines is :mod:`compiler.backends.inductor.backend`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from compiler.backends.base import EngineIO
from compiler.backends.inductor.blocks import compile_cut, cut_by_block
from compiler.backends.inductor.format import FORMAT
from compiler.backends.inductor.options import inductor_config
from compiler.inputs.specs import torch_dtype


class ProgramGraph:
    """A partition's exported program as Inductor compiles it: the flat ATen graph, its placeholders
    in order (activations, then weights), with lifted constants at their positions.

    ``frozen`` (int8 programs, ``compiler.quantization.pt2e``): the program's tensors stay attributes of
    the graph and Inductor freezes them, which its oneDNN int8 kernels need (weights prepacked once).
    Prepacked weights are oneDNN tensors, which Inductor cannot save: a frozen graph has no artifact
    and is compiled from its program wherever it loads."""

    def __init__(self, exported: torch.export.ExportedProgram, device: torch.device, *, frozen: bool = False):
        self.exported, self.device, self.frozen = exported, device, frozen
        self.module = exported.module() if frozen else exported.graph_module
        tensors = {**exported.state_dict, **exported.constants}
        self.constants = {
            position: tensors[spec.target].detach().to(device)
            for position, spec in enumerate(exported.graph_signature.input_specs)
            if spec.kind != torch.export.graph_signature.InputKind.USER_INPUT and not frozen
        }

    @classmethod
    def load(cls, program: bytes, device: torch.device, *, frozen: bool = False) -> ProgramGraph:
        """The program read as a package's is: nothing unpickled, no module imported (ATen, and for a
        frozen int8 program torch's own quantize/dequantize ops)."""
        from compiler.program.export import load_program_bytes
        from compiler.program.tracing import TRACING

        if frozen:
            import torch.ao.quantization.fx._decomposed  # noqa: F401 - registers quantized_decomposed ops
        with TRACING:
            return cls(
                load_program_bytes(program, "Inductor engine program", modules=()), device, frozen=frozen
            )

    def compile(
        self,
        engine_io: EngineIO,
        options: Mapping[str, Any],
        weights: tuple[torch.Tensor, ...],
        *,
        by_block: bool = False,
    ) -> Callable[..., Any]:
        """The graph compiled once, symbolic in its dynamic dims (the export's ranges), then run once at
        the opt shapes so that a first call does no autotuning. With ``by_block``, one repeated block
        at a time where the program has one (:mod:`compiler.backends.inductor.blocks`): that graph
        has no artifact to keep (:func:`save_artifact` takes a whole graph)."""
        args = graph_args(example_inputs(engine_io, self.device), weights, self.constants)
        cut = cut_by_block(self.module) if by_block and not self.frozen else None
        if cut is not None:
            try:
                return self._run_once(compile_cut(cut, lambda piece: self._from_graph(piece, options)), args)
            except Exception as exc:  # an op Inductor compiles in the whole graph only: compile it whole
                warnings.warn(
                    f"Inductor engine: compiling its program one block at a time failed "
                    f"({short_error(exc)}); compiling it whole",
                    stacklevel=2,
                )
        return self._run_once(self._from_graph(self.module, options), args)

    def compile_static(
        self,
        shapes: tuple[tuple[int, ...], ...],
        engine_io: EngineIO,
        options: Mapping[str, Any],
        weights: tuple[torch.Tensor, ...],
    ) -> Callable[..., Any]:
        """The graph specialized to one set of activation shapes (a shape profile): Inductor traces it
        again from real inputs at those shapes, so every size is a constant (no guards, no symbolic
        index math); run once so that a first call does no autotuning."""
        args = graph_args(example_inputs(engine_io, self.device, shapes), weights, self.constants)
        return self._run_once(self._standalone(self.module, args, "from_example_inputs", options), args)

    def _from_graph(self, module: torch.fx.GraphModule, options: Mapping[str, Any]) -> Callable[..., Any]:
        """``module`` (the program's graph, or a piece of it) compiled symbolic in its dynamic dims."""
        # Inductor takes the export's own fake inputs and shape environment: exactly its dynamic dims,
        # with their ranges. (Given real tensors it would mark every dim dynamic and give equal sizes one
        # symbol: a batch of 2 and a 2-row embedding table would then have to stay equal.)
        fake_inputs = [n.meta["val"] for n in module.graph.nodes if n.op == "placeholder"]
        drop_expression_hints(fake_inputs)
        output = next(iter(reversed(module.graph.nodes)))
        for node in output.args[0] if isinstance(output.args[0], list | tuple) else (output.args[0],):
            if isinstance(node, torch.fx.Node) and "val" in node.meta:
                node.meta["example_value"] = node.meta["val"]  # where "from_graph" finds the fake mode
        return self._standalone(module, fake_inputs, "from_graph", options)

    def _standalone(
        self,
        module: torch.fx.GraphModule,
        inputs: Sequence[Any],
        dynamic_shapes: str,
        options: Mapping[str, Any],
    ) -> Callable[..., Any]:
        """Inductor's standalone compile of ``module`` from ``inputs`` (fake or real)."""
        from compiler.program.tracing import TRACING

        patches = inductor_config(options, frozen=self.frozen)
        # Freezing applies to graphs compiled without autograd only.
        with TRACING, torch.no_grad(), _quiet_if(self.frozen):
            return torch._inductor.standalone_compile(
                module, inputs, dynamic_shapes=dynamic_shapes, options={"config_patches": patches}
            )

    def _run_once(self, compiled: Callable[..., Any], args: list[torch.Tensor]) -> Callable[..., Any]:
        """``compiled`` run once on ``args``, so that a first call does no autotuning."""
        from compiler.program.tracing import TRACING

        with TRACING, torch.no_grad(), _quiet_if(self.frozen):
            compiled(*args)
        return compiled


@contextlib.contextmanager
def _quiet_if(frozen: bool) -> Iterator[None]:
    """A frozen graph's expected notices left out: Inductor warns that it cannot save it (by design
    here, ``ProgramGraph``) and its oneDNN lowering warns about a tensor copy of its own. Called under
    the trace lock."""
    from compiler.program.tracing import quiet_loggers

    if not frozen:
        yield
        return
    with quiet_loggers("torch._inductor.standalone_compile"), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="To copy construct from a tensor")
        yield


class LocalCompiled:
    """Graphs this machine compiled from stored engines' programs (untrusted packages, artifacts that do
    not load here), kept in the local engine cache: the second load of the same engine loads what this
    machine built instead of compiling again. Keyed by what was compiled (the program's bytes, the
    options, torch and the device), never by the package's own compiled graph, which is not read."""

    def __init__(
        self,
        program: bytes,
        options: Mapping[str, Any],
        target: str,
        shapes: tuple[tuple[int, ...], ...] | None = None,
        *,
        aot: bool = False,
        cache: Any = None,
    ):
        self.cache = cache  # the cache the load was handed (compiler.cache.local.CacheSetting)
        meta = {"torch": torch.__version__, "target": target, "options": options, "format": FORMAT}
        if shapes is not None:  # a static specialization: its own entry
            meta["static_shapes"] = [list(s) for s in shapes]
        if aot:  # its AOTInductor package (built with this machine's compiler): its own entry
            meta["aot"] = True
        self.key = hashlib.sha256(program + json.dumps(meta, sort_keys=True).encode()).hexdigest()
        kind = "inductor-local-aot" if aot else "inductor-local-compile"
        self.meta = {"kind": kind, "torch": torch.__version__, "target": target}

    def _cache(self) -> Any:
        from compiler.cache.local import resolve_cache
        from compiler.errors import CacheError

        try:  # the load's cache (None: the default one): trusted input (docs/security.md)
            return resolve_cache(self.cache)
        except CacheError:  # one kiln may not use: the graph is compiled again next time
            return None

    def load(
        self,
        examples: Sequence[torch.Tensor],
        weights: tuple[torch.Tensor, ...],
        constants: Mapping[int, torch.Tensor],
    ) -> Callable[..., Any] | None:
        data = self.read()
        if data is None:
            return None
        try:
            compiled = load_artifact(data)
            with torch.no_grad():
                compiled(*graph_args(examples, weights, constants))
            return compiled
        except Exception:  # another Inductor configuration since: compile again (and overwrite)
            return None

    def read(self) -> bytes | None:
        """The entry's bytes, None where there is none (or no cache)."""
        cache = self._cache()
        return cache.get(self.key) if cache is not None else None

    def store(self, compiled: Any) -> None:
        self.write(save_artifact(compiled))

    def write(self, data: bytes) -> None:
        cache = self._cache()
        if cache is not None:
            try:
                cache.put(self.key, data, self.meta)
            except Exception as exc:  # never fail a load because the cache cannot take an entry
                warnings.warn(
                    f"Inductor engine: not kept in the local cache ({short_error(exc)})", stacklevel=4
                )


def drop_expression_hints(fake_inputs: Sequence[Any]) -> None:
    """torch.export.load gives its shape environment hints for expressions (``32*s85: 256``) beside
    those of its symbols; Inductor's passes expect symbols only (``expected sympy.Symbol``). The
    symbols' hints determine the rest, so the others go."""
    import sympy

    for value in fake_inputs:
        shape_env = getattr(getattr(value, "fake_mode", None), "shape_env", None)
        if shape_env is not None:
            # torch 2.13 calls the table backed_var_to_val (var_to_val is its deprecated alias); 2.11 not.
            hints = getattr(shape_env, "backed_var_to_val", None)
            hints = shape_env.var_to_val if hints is None else hints
            for key in [k for k in hints if not isinstance(k, sympy.Symbol)]:
                del hints[key]
            return  # one environment for the whole graph


def save_artifact(compiled: Any) -> bytes:
    with tempfile.TemporaryDirectory(prefix="kiln-inductor-") as scratch:
        path = os.path.join(scratch, "compiled.bin")
        compiled.save(path=path, format="binary")
        with open(path, "rb") as file:
            return file.read()


def load_artifact(data: bytes) -> Callable[..., Any]:
    from torch._inductor import CompiledArtifact

    with tempfile.TemporaryDirectory(prefix="kiln-inductor-") as scratch:
        path = os.path.join(scratch, "compiled.bin")
        with open(path, "wb") as file:
            file.write(data)
        return CompiledArtifact.load(path=path, format="binary")


def graph_args(
    activations: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    constants: Mapping[int, torch.Tensor],
) -> list[torch.Tensor]:
    """The compiled graph's inputs: activations, then weights, with lifted constants at their positions."""
    args = [*activations, *weights]
    for position, tensor in sorted(constants.items()):
        args.insert(position, tensor)
    return args


def example_inputs(
    engine_io: EngineIO, device: torch.device, shapes: Sequence[Sequence[int]] | None = None
) -> list[torch.Tensor]:
    """Activations at ``shapes``, else the opt shapes: the size hints Inductor tunes for (the dynamic
    graph stays symbolic)."""
    tensors = []
    for index, spec in enumerate(engine_io.inputs):
        dtype = torch_dtype(spec.dtype)
        # Zeros for integers and masks: valid indices for any embedding the partition may hold.
        make = torch.randn if dtype.is_floating_point else torch.zeros
        shape = spec.opt_shape if shapes is None else tuple(shapes[index])
        tensors.append(make(shape, dtype=dtype, device=device))
    return tensors


def short_error(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return " ".join(lines[:6])[:1500]
