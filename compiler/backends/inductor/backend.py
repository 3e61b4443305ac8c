"""Inductor: PyTorch's own compiler as an engine backend (CPU and CUDA), as standalone compiled graphs.

Why not AOTInductor: on the H100 image (torch 2.11+cu130) AOTInductor packages build (74 s for one
256-wide MLP block) but segfault when loaded, inside the generated wrapper's ``std::regex`` (its C++
was compiled by ``CXX=/opt/gcc/bin/g++``, whose libstdc++ is not the one the process loaded;
``benchmarks/probes/probe_inductor_aoti.h100.json`` holds the backtrace). Why not ``torch.compile`` at load
(this backend's first form): every engine call then goes through dynamo's frame hook and guards, 40-60
us on this CPU, paid once per engine per call (14 engines for BERT split per block). Inductor's
standalone compile (``torch._inductor.standalone_compile``, what vLLM ships its compiled graphs with)
compiles the partition's graph once, symbolic in its dynamic dims, into a callable with no guards, and
saves it as one binary artifact that loads without tracing.

An engine is a zip (uncompressed) of:

    kiln_inductor_engine.json   the header: format, torch version, device it was built for, host
                                compiler, precision, canonical weight names/shapes/dtypes, options
    program.pt2                 the partition's exported program (torch.export.save: no pickle), which
                                takes its activations and then its weights ``w0..wN`` as inputs: what
                                was compiled, and what is compiled again where the artifact cannot load
    constants.safetensors       tensors the program holds that are not weights (lifted constants)
    weights.safetensors         the representative instance's weights; absent when stripped
    inductor_compiled.bin       the compiled graph (``CompiledArtifact.save``: Inductor's own cache
                                entries, kernels included)
    inductor_static_<i>.bin     one static-shape specialization per shape profile (``BuildSettings.
                                profiles``), compiled from the same program at the profile's shapes;
                                the header's ``specializations`` lists their activation shapes

A call whose activation shapes equal a specialization's exactly runs it (no symbolic sizes, no guards);
every other call runs the dynamic graph (``InductorEngine.last_dispatch`` says which ran last). A profile
that does not fix every dynamic dimension of an engine's inputs by name (a derived size such as
``batch*seq``) gets no specialization in that engine, nor does one whose compile fails (warned).

Loading checks the header (:class:`EngineCompatibilityError` for another torch version, a kind of
device that is not here, or another CUDA index, which Inductor writes into its code;
:mod:`compiler.backends.inductor.compat`) and loads the artifact; where it does not load (another build
of the same torch version, another Inductor configuration), or is another GPU's (a
:class:`~compiler.errors.ForeignEngineCodeWarning`), the program is compiled again, with a warning.
Weights are inputs of the compiled graph, so the instances of one fingerprint share one compiled graph
(dedup) and each passes its own weights (refit is new weights, stripping is leaving them out). A
compiled graph is kept per process, so a build followed by a load (or many instances) compiles once.

The op table is everything ATen and prims; custom ops (other namespaces) and higher-order ops stay in
PyTorch, and ``torch_executed_ops`` decides the rest. The artifact holds Inductor's own (pickled) cache
entries and compiled kernels: it is code, so it runs as stored only where the backend trusts engine
code (``trust_engine_code``: engines this process built or took from its engine cache, and packages
``compiler.load`` trusts); otherwise the engine is compiled here from its program, which is read as a
package's program is, with kiln's own settings: of the header's options only a checked list of tuning
switches is used (``inductor_options``), never a compiler, flag, path or environment (docs/security.md).

Here: the backend (build, load, refit, compatibility); the loaded engine is
:mod:`compiler.backends.inductor.engine`. The compile of a program and the compiled graph's bytes are
:mod:`compiler.backends.inductor.graph`; the engine file format is
:mod:`compiler.backends.inductor.format`; static specializations :mod:`compiler.backends.inductor.static`;
the graphs this process compiled :mod:`compiler.backends.inductor.memo`; AOTInductor packages
:mod:`compiler.backends.inductor.aot`; the program cut at its repeated block for an untrusted first load
:mod:`compiler.backends.inductor.blocks`.
"""

from __future__ import annotations

import functools
import json
import os
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from compiler.backends.base import BuildSettings, EngineIO, RecordedBackend, unpack_torch_graph
from compiler.backends.inductor.aot import AotGraph, aot_from_program
from compiler.backends.inductor.compat import check_compatible, cxx_runtime, device_index, foreign_code
from compiler.backends.inductor.engine import InductorEngine, ordered_weights
from compiler.backends.inductor.format import (
    AOT,
    COMPILED,
    CONSTANTS,
    ENGINE_PROGRAM,
    ENGINE_WEIGHTS,
    FORMAT,
    HEADER,
    MAGIC,
    load_tensors,
    pack,
    read_engine,
    save_tensors,
    static_entry,
)
from compiler.backends.inductor.graph import (
    LocalCompiled,
    ProgramGraph,
    example_inputs,
    graph_args,
    load_artifact,
    save_artifact,
    short_error,
)
from compiler.backends.inductor.memo import COMPILE_LOCK, library_key, recall, recall_aot, remember
from compiler.backends.inductor.native import LocalAot
from compiler.backends.inductor.options import (
    build_options,
    engine_options,
    host_compiler,
)
from compiler.backends.inductor.static import build_specializations, specializations, static_key
from compiler.cache.local import CacheSetting
from compiler.errors import (
    BackendError,
    EngineBuildError,
    ForeignEngineCodeWarning,
    RefitError,
)
from compiler.inputs.specs import dtype_name


def warm_inductor_imports() -> None:
    """Import what loading a compiled graph imports lazily (Inductor's code cache, its compile_fx and
    lowering tables): a package load runs this while its worker threads read and check files."""
    import torch._inductor.codecache
    import torch._inductor.compile_fx  # noqa: F401
    from torch._inductor import CompiledArtifact  # noqa: F401


def inductor_supports(target: Any) -> bool:
    """ATen, prims and kiln's own ops (``kiln::``: compiler.generation.attention) go to Inductor;
    other custom ops and higher-order ops stay in PyTorch."""
    return isinstance(target, torch._ops.OpOverload) and target.namespace in ("aten", "prims", "kiln")


def create(name: str, device: str, trust_engine_code: bool) -> InductorBackend:
    return InductorBackend(device, trust_engine_code=trust_engine_code)  # its record's maker


class InductorBackend(RecordedBackend):
    name = "inductor"  # its record: graph_format "torch.export" (compiler.backends.capabilities)

    def __init__(self, device: str = "cpu", *, trust_engine_code: bool = True) -> None:
        # Untrusting (a package from an untrusted source): engines are compiled from their programs, and
        # their compiled graphs (pickled cache entries, kernels) are never loaded.
        self.device, self.trust_engine_code = torch.device(device), trust_engine_code

    # -- what engines depend on ------------------------------------------------------------------
    def library_version(self) -> str:
        # The engine format is part of it: engine cache keys change when the format does.
        version = f"{torch.__version__}+engine{FORMAT}"
        if self.device.type == "cuda":
            try:
                import triton

                version += f"/triton-{triton.__version__}"
            except ImportError:
                pass
        return version

    def engine_target(self) -> str:
        if self.device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(self.device)
            return f"cuda:sm_{major}{minor}"
        return "cpu"

    def supports(self, target: Any) -> bool:
        return inductor_supports(target)

    # -- build -----------------------------------------------------------------------------------
    def build(
        self,
        lowered: bytes,  # a torch graph archive (graph_format "torch.export")
        io: EngineIO,
        settings: BuildSettings,
        *,
        partition: str | None = None,
        cache_dir: str | os.PathLike | None = None,  # Inductor keeps its own caches
    ) -> bytes:
        options = build_options(settings, aot_default=self.device.type == "cuda")
        compiler = host_compiler(options)
        if settings.precision == "fp8" and self._fp8_missing():
            raise EngineBuildError(
                f"partition {partition}: precision fp8 needs a CUDA GPU of compute capability 8.9 or later "
                f"(torch._scaled_mm); this backend targets {self.engine_target()}",
                partition=partition,
            )
        program, weight_bytes = unpack_torch_graph(lowered)
        weights = load_tensors(weight_bytes, self.device)
        # int8 (compiler.quantization.pt2e): weights and scales are the program's constants, frozen in.
        frozen = (settings.quantization or {}).get("weights") == "frozen"
        graph = ProgramGraph.load(program, self.device, frozen=frozen)
        header = {
            "magic": MAGIC,
            "format": FORMAT,
            "torch": torch.__version__,
            "library": self.library_version(),
            "device": self.engine_target(),
            "device_index": device_index(self.device),
            "compiler": compiler,
            "precision": settings.precision,
            "stripped": settings.strip_weights,
            "options": options,
            "weights": {k: [list(v.shape), dtype_name(v.dtype)] for k, v in weights.items()},
            "constants": sorted(graph.constants),
            **({"frozen": True} if frozen else {}),
        }
        key = library_key(program, header)
        artifact, static = None, {}
        with COMPILE_LOCK:
            # An AOTInductor package serves every shape with no compiler present: an engine that has one
            # needs no standalone graph. Where it cannot be built, the standalone graph is the engine.
            aot_bytes, aot_note = self._build_aot(
                program, io, options, settings, weights, key, partition, graph
            )
            if aot_bytes is None:
                if aot_note is not None:  # a failed AOTInductor compile may have consumed the graph
                    graph = ProgramGraph.load(program, self.device, frozen=frozen)
                artifact, static = self._build_standalone(
                    graph, io, settings, options, weights, key, partition
                )
        header["specializations"] = [[list(s) for s in shapes] for shapes in static]
        if aot_note is not None:  # its compiler, or why there is none
            header["aot" if aot_bytes is not None else "aot_skipped"] = aot_note
        if aot_bytes is not None and (runtime := cxx_runtime(aot_note)) is not None:
            header["aot_libstdcxx"] = runtime  # what a loading process's libstdc++ must be at least
        files = {HEADER: json.dumps(header, sort_keys=True).encode(), ENGINE_PROGRAM: program}
        if aot_bytes is not None:
            files[AOT] = aot_bytes
        for index, data in enumerate(static.values()):
            files[static_entry(index)] = data
        if graph.constants:
            files[CONSTANTS] = save_tensors({str(i): t for i, t in graph.constants.items()})
        if not settings.strip_weights:
            files[ENGINE_WEIGHTS] = weight_bytes
        if artifact is not None:
            files[COMPILED] = artifact
        return pack(files)

    def _build_standalone(
        self,
        graph: ProgramGraph,
        io: EngineIO,
        settings: BuildSettings,
        options: Mapping[str, Any],
        weights: Mapping[str, torch.Tensor],
        key: str,
        partition: str | None,
    ) -> tuple[bytes | None, dict]:
        """(the standalone graph's artifact, its static specializations); compiled once per process per
        library key (a stripped or full twin recalls it). Under COMPILE_LOCK."""
        frozen = graph.frozen
        compiled, artifact = recall(key)
        if compiled is None or (artifact is None and not frozen):
            try:
                compiled = graph.compile(io, options, tuple(weights.values()))
                artifact = None if frozen else save_artifact(compiled)  # a frozen graph has none
            except Exception as exc:  # Inductor raises many types; the report needs the cause
                raise EngineBuildError(
                    f"Inductor could not compile partition {partition or '?'}: {short_error(exc)}",
                    partition=partition,
                ) from exc
            remember(key, compiled, artifact)
        if frozen and settings.profiles:
            warnings.warn(
                f"Inductor: partition {partition or '?'} is int8 (weights frozen in): it gets no static "
                "specialization, its dynamic graph serves every shape",
                stacklevel=3,
            )
            return artifact, {}
        if frozen:
            return artifact, {}
        return artifact, build_specializations(graph, io, settings, options, weights, key, partition)

    def _fp8_missing(self) -> bool:
        return self.device.type != "cuda" or torch.cuda.get_device_capability(self.device) < (8, 9)

    def _build_aot(
        self,
        program: bytes,
        io: EngineIO,
        options: Mapping[str, Any],
        settings: BuildSettings,
        weights: Mapping[str, torch.Tensor],
        key: str,
        partition: str | None,
        graph: ProgramGraph,
    ) -> tuple[bytes | None, str | None]:
        """(the AOTInductor package, its compiler) where ``backend_options`` ask for one (the default on
        CUDA); (None, why) where it could not be built or did not pass its fresh-process check (warned:
        the engine gets its standalone graph); (None, None) where not asked for. Once per process per
        library key."""
        if not options.get("aot"):
            return None, None

        def build() -> tuple[bytes | None, str | None]:
            built, note = aot_from_program(
                program,
                io,
                tuple(weights.values()),
                options,
                self.device,
                settings.precision,
                frozen=graph.frozen,
                graph=graph,  # consumed by the compile
            )
            if built is None:
                warnings.warn(
                    f"Inductor: no AOTInductor package for partition {partition or '?'}: {note}; its engine "
                    "is its standalone graph",
                    stacklevel=4,
                )
            return built, note

        return recall_aot(key, build)

    # -- load, refit -----------------------------------------------------------------------------
    def load(
        self,
        engine: bytes,
        io: EngineIO,
        weights: Mapping[str, torch.Tensor] | None,
        *,
        siblings: int = 0,
        cache: CacheSetting = None,  # where graphs compiled here are kept (graph.LocalCompiled)
    ) -> InductorEngine:
        header, files = read_engine(engine)
        self.check_compatible(header)
        options = engine_options(header, self.trust_engine_code)
        foreign = self.foreign_code(header, files)
        if foreign is not None:
            rebuilt = ", and this machine's own AOTInductor package is built for the loads after it"
            warnings.warn(
                ForeignEngineCodeWarning(
                    f"Inductor engine: {foreign}: not run; the engine is compiled here from its program"
                    f"{rebuilt if AOT in files else ''}"
                ),
                stacklevel=2,
            )
        if weights is None:
            if ENGINE_WEIGHTS not in files:
                raise RefitError("this Inductor engine is weight-stripped: load it with its weights")
            weights = load_tensors(files[ENGINE_WEIGHTS], self.device)
        ordered = ordered_weights(header, weights, self.device)
        constants = {int(i): t for i, t in load_tensors(files.get(CONSTANTS), self.device).items()}
        aot = None if foreign is not None else self._load_aot(files, header)
        # A package that may not run here (untrusted: its bytes never run; built for another GPU or C++
        # runtime; or it does not load): this machine's own, if built
        wanted = AOT in files and aot is None
        local = LocalAot(
            wanted, files[ENGINE_PROGRAM], options, self.device, self.engine_target(), header, cache
        )
        aot = aot or local.loaded()
        if aot is not None:  # serves every shape: no Inductor, no Triton imported
            return self._aot_engine(aot, ordered, io, constants, header)
        host_compiler(options)
        key = library_key(files[ENGINE_PROGRAM], {**header, "options": options})
        why = foreign or (
            "its package is not trusted to run code"
            if not self.trust_engine_code
            else "it does not load here"
        )
        local.prepare(io, ordered, why)  # its job written while the graph is compiled (native.py)
        load = functools.partial(self._load_compiled, options, files, io, ordered, constants, cache)
        with COMPILE_LOCK, local.discarded_on_error():
            compiled = recall(key)[0]
            if compiled is None:
                compiled = load(frozen=bool(header.get("frozen")), foreign=foreign, native=local)
                remember(key, compiled, None)
            static = {}
            for index, shapes in enumerate(specializations(header, io)):
                shape_key = static_key(key, shapes)
                loaded = recall(shape_key)[0]
                if loaded is None:
                    loaded = load(shapes=shapes, name=static_entry(index), foreign=foreign)
                    remember(shape_key, loaded, None)
                static[shapes] = loaded
        engine = InductorEngine(compiled, ordered, io, constants, static, expected_weights=header["weights"])
        if local.wanted:  # this graph serves; this machine's own package is built for the loads after this
            engine.native_build = local.start(io, ordered, why)
            aot = local.loaded()  # there already where it was built inline ($KILN_NATIVE_BUILD=inline)
            if aot is not None:
                return self._aot_engine(aot, ordered, io, constants, header)
        return engine

    def _aot_engine(
        self,
        aot: AotGraph,
        weights: tuple[torch.Tensor, ...],
        io: EngineIO,
        constants: Mapping[int, torch.Tensor],
        header: Mapping[str, Any],
    ) -> InductorEngine:
        engine = InductorEngine(aot, weights, io, constants, expected_weights=header["weights"])
        engine.last_dispatch = "aot"
        return engine

    def _load_aot(self, files: Mapping[str, bytes], header: Mapping[str, Any]) -> AotGraph | None:
        """The engine's AOTInductor package, loaded, where it has one and engine code is trusted (it is
        native code); None otherwise, or when it does not load here (warned: the standalone graph
        serves)."""
        if AOT not in files or not self.trust_engine_code:
            return None
        try:
            return AotGraph(files[AOT], self.device, header["constants"])
        except Exception as exc:  # the loader raises RuntimeError with the cause
            warnings.warn(
                f"Inductor engine: its AOTInductor package does not load here ({short_error(exc)}); "
                "this machine builds its own (meanwhile its engine is compiled here)",
                stacklevel=3,
            )
            return None

    def _load_compiled(
        self,
        options: Mapping[str, Any],
        files: Mapping[str, bytes],
        engine_io: EngineIO,
        weights: tuple[torch.Tensor, ...],
        constants: Mapping[int, torch.Tensor],
        cache: CacheSetting,
        *,
        shapes: tuple[tuple[int, ...], ...] | None = None,
        name: str = COMPILED,
        frozen: bool = False,
        foreign: str | None = None,
        native: LocalAot | None = None,
    ) -> Callable[..., Any]:
        """The engine's compiled graph (``name``; a static specialization at ``shapes`` where given),
        run once at its shapes (the opt shapes for the dynamic graph); compiled again from its program
        where it is not trusted, its code is ``foreign`` (another GPU's), or its artifact does not load
        here (another build of this torch version, another Inductor configuration). Where this load
        starts building this machine's ``native`` package, it is the only one that compiles: one
        repeated block at a time (inductor/blocks.py), and not kept."""
        if frozen:  # int8, weights frozen in: no artifact to load or keep; compiled here, by design
            return self._compile_stored(files, engine_io, options, weights, shapes, frozen=True)
        examples = example_inputs(engine_io, self.device, shapes)
        if not self.trust_engine_code:
            reason = (
                "its compiled graph is code and its package is not trusted to run code (sign packages and "
                "verify them with KILN_SIGNING_PUBLIC_KEY, or load with trust_engine_code=True)"
            )
        elif foreign is not None:
            reason = foreign
        elif name not in files:  # an engine whose AOTInductor package serves: it holds no standalone graph
            reason = "its AOTInductor package does not run here and it holds no standalone graph"
        else:
            try:
                compiled = load_artifact(files[name])
                with torch.no_grad():
                    compiled(*graph_args(examples, weights, constants))
                return compiled
            except Exception as exc:  # a cache miss or a torch build mismatch: both mean compile again
                reason = f"its compiled graph does not load here ({short_error(exc)})"
        # Keyed by the options it is compiled with here (an untrusted header's are filtered already).
        local = LocalCompiled(files[ENGINE_PROGRAM], options, self.engine_target(), shapes, cache=cache)
        compiled = local.load(examples, weights, constants)
        if compiled is not None:  # compiled here from this very program before: as trusted as a build
            return compiled
        what = "it" if shapes is None else f"its static specialization at {[list(s) for s in shapes]}"
        if foreign is None:  # a foreign engine's warning (ForeignEngineCodeWarning, in load) said it
            warnings.warn(f"Inductor engine: {reason}; compiling {what} from its program", stacklevel=3)
        by_block = native is not None and native.will_build() and shapes is None
        compiled = self._compile_stored(files, engine_io, options, weights, shapes, by_block=by_block)
        if not by_block:
            local.store(compiled)
        return compiled

    def _compile_stored(
        self,
        files: Mapping[str, bytes],
        engine_io: EngineIO,
        options: Mapping[str, Any],
        weights: tuple[torch.Tensor, ...],
        shapes: tuple[tuple[int, ...], ...] | None,
        *,
        frozen: bool = False,
        by_block: bool = False,
    ) -> Callable[..., Any]:
        """The engine's program compiled here (read as a package's program: an unsafe one is its own
        typed error), dynamic (one repeated block at a time with ``by_block``) or at ``shapes``."""
        graph = ProgramGraph.load(files[ENGINE_PROGRAM], self.device, frozen=frozen)
        try:
            if shapes is None:
                return graph.compile(engine_io, options, weights, by_block=by_block)
            return graph.compile_static(shapes, engine_io, options, weights)
        except Exception as exc:
            raise BackendError(f"Inductor could not compile a stored engine: {short_error(exc)}") from exc

    def refit(self, engine: bytes, weights: Mapping[str, torch.Tensor]) -> bytes:
        header, files = read_engine(engine)
        ordered = ordered_weights(header, weights, torch.device("cpu"))
        new = save_tensors(dict(zip(header["weights"], ordered, strict=True)))
        return pack({**files, ENGINE_WEIGHTS: new})

    def check_compatible(self, header: Mapping[str, Any]) -> None:
        """EngineCompatibilityError unless an engine with this header runs here, on this backend's device."""
        check_compatible(header, self.device, self.engine_target())

    def foreign_code(self, header: Mapping[str, Any], files: Mapping[str, bytes]) -> str | None:
        """Why the engine's stored native code must not run here though the engine may (compat.py)."""
        return foreign_code(header, AOT in files, self.device, self.engine_target())
