"""Inductor: PyTorch's own compiler as an engine backend (CPU and CUDA), in its JIT form.

Why the JIT form and not AOTInductor: on the H100 image (torch 2.11+cu130) AOTInductor packages build
(74 s for one 256-wide MLP block) but segfault when loaded, inside the generated wrapper's
``std::regex`` (its C++ was compiled by ``CXX=/opt/gcc/bin/g++``, whose libstdc++ is not the one the
process loaded; ``tests/gpu/probe_inductor_aoti.h100.json`` holds the backtrace). The JIT form builds
and loads there, and compiles a block in 6-18 s instead of 74 s.

An engine is a zip (uncompressed) of:

    kiln_inductor_engine.json   the header: format, torch version, device it was built for, host
                                compiler, precision, canonical weight names/shapes/dtypes, options
    program.pt2                 the partition's exported program (torch.export.save: no pickle), which
                                takes its activations and then its weights ``w0..wN`` as inputs
    weights.safetensors         the representative instance's weights; absent when stripped
    inductor_cache.bin          Inductor's portable cache artifacts of the build
                                (``torch.compiler.save_cache_artifacts``: compiled kernels, autotuning)

Loading checks the header (:class:`EngineCompatibilityError` for another torch version or a device
that is not here), primes Inductor's caches with the artifacts and compiles the program with
``torch.compile`` (cache hits: seconds, no autotuning). Weights are inputs of the compiled graph, so
the instances of one fingerprint share one compiled graph (dedup) and each passes its own weights
(refit is new weights, stripping is leaving them out). A compiled graph is kept per process, so a
build followed by a load (or many instances) compiles once.

The op table is everything ATen and prims; custom ops (other namespaces) and higher-order ops stay in
PyTorch, and ``torch_executed_ops`` decides the rest. The cache artifacts are Inductor's own (pickled)
cache entries and the program runs compiled kernels: an engine is code, trusted as far as the package
that carries it (its content hash covers the engine file).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import threading
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import torch

from compiler.backends.base import BuildSettings, EngineIO, check_backend_options, unpack_torch_graph
from compiler.errors import (
    BackendError,
    BackendUnavailableError,
    BuildSettingsError,
    EngineBuildError,
    EngineCompatibilityError,
    RefitError,
)
from compiler.specs import dtype_name, torch_dtype

HEADER, PROGRAM, WEIGHTS, ARTIFACTS = (
    "kiln_inductor_engine.json",
    "program.pt2",
    "weights.safetensors",
    "inductor_cache.bin",
)
FORMAT = 1
MAGIC = "kiln-inductor-engine"
# backend_options keys: "mode" (torch.compile's mode; "default", "max-autotune-no-cudagraphs", ...),
# "compile_options" (Inductor config, torch.compile's ``options``).
BACKEND_OPTIONS = frozenset({"mode", "compile_options"})
_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
# One compile at a time: dynamo and Inductor's cache-artifact recording are process-wide. Always taken
# before the compiler's tracing lock (compiler.export.TRACING, taken inside), so exports never overlap
# a compile and the two locks are never taken in the other order.
_COMPILE_LOCK = threading.RLock()
# Per process: library key -> the compiled graph, and -> the cache artifacts its build recorded.
_COMPILED: dict[str, Callable[..., Any]] = {}
_BUILT: dict[str, bytes] = {}


def inductor_supports(target: Any) -> bool:
    """ATen and prims ops go to Inductor; custom ops and higher-order ops stay in PyTorch."""
    if not isinstance(target, torch._ops.OpOverload):
        return False
    return target.namespace in ("aten", "prims")


class InductorEngine:
    """A loaded engine: the compiled graph and this instance's weights, on the engine's device."""

    def __init__(self, compiled: Callable[..., Any], weights: tuple[torch.Tensor, ...], io: EngineIO):
        self.compiled, self.weights, self.io = compiled, weights, io
        self.device = weights[0].device if weights else None

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(self.compiled(*inputs, *self.weights))


class InductorBackend:
    name = "inductor"
    graph_format = "torch.export"

    def __init__(self, device: str = "cpu") -> None:
        self.device = torch.device(device)

    # -- what engines depend on ------------------------------------------------------------------
    def library_version(self) -> str:
        version = torch.__version__
        if self.device.type == "cuda":
            try:
                import triton

                version += f"/triton-{triton.__version__}"
            except ImportError:
                pass
        return version

    def target_device(self) -> str:
        if self.device.type == "cuda":
            major, minor = torch.cuda.get_device_capability(self.device)
            return f"cuda:sm_{major}{minor}"
        return "cpu"

    def supports(self, target: Any) -> bool:
        return inductor_supports(target)

    # -- build -----------------------------------------------------------------------------------
    def build(
        self,
        onnx_model: bytes,
        io: EngineIO,
        settings: BuildSettings,
        *,
        partition: str | None = None,
        cache_dir: str | os.PathLike | None = None,  # Inductor keeps its own caches
    ) -> bytes:
        options = _options(settings)
        compiler = host_compiler(options)
        program, weight_bytes = unpack_torch_graph(onnx_model)
        weights = _load_weights(weight_bytes, self.device)
        header = {
            "magic": MAGIC,
            "format": FORMAT,
            "torch": torch.__version__,
            "library": self.library_version(),
            "device": self.target_device(),
            "compiler": compiler,
            "precision": settings.precision,
            "stripped": settings.strip_weights,
            "options": options,
            "weights": {k: [list(v.shape), dtype_name(v.dtype)] for k, v in weights.items()},
        }
        from torch.compiler._cache import CacheArtifactManager

        key = _library_key(program, header)
        with _COMPILE_LOCK:
            if key in _BUILT:  # this process compiled the same graph (a stripped or full twin): reuse it
                artifacts = _BUILT[key]
            else:
                # Only this build's artifacts go into the engine: start recording afresh.
                CacheArtifactManager.clear()
                try:
                    compiled = _compile(program, io, options, self.device, tuple(weights.values()))
                except Exception as exc:  # Inductor/dynamo raise many types; the report needs the cause
                    raise EngineBuildError(
                        f"Inductor could not compile partition {partition or '?'}: {_short(exc)}",
                        partition=partition,
                    ) from exc
                saved = torch.compiler.save_cache_artifacts()
                artifacts = saved[0] if saved else b""
                _COMPILED[key], _BUILT[key] = compiled, artifacts
        files = {HEADER: json.dumps(header, sort_keys=True).encode(), PROGRAM: program}
        if not settings.strip_weights:
            files[WEIGHTS] = weight_bytes
        files[ARTIFACTS] = artifacts
        return _pack(files)

    # -- load, refit -----------------------------------------------------------------------------
    def load(self, engine: bytes, io: EngineIO, weights: Mapping[str, torch.Tensor] | None) -> InductorEngine:
        header, files = read_engine(engine)
        self.check_compatible(header)
        if weights is None:
            if WEIGHTS not in files:
                raise RefitError("this Inductor engine is weight-stripped: load it with its weights")
            weights = _load_weights(files[WEIGHTS], self.device)
        ordered = _ordered(header, weights, self.device)
        key = _library_key(files[PROGRAM], header)
        with _COMPILE_LOCK:
            compiled = _COMPILED.get(key)
            if compiled is None:
                if files.get(ARTIFACTS):
                    torch.compiler.load_cache_artifacts(files[ARTIFACTS])
                try:
                    compiled = _compile(files[PROGRAM], io, header["options"], self.device, ordered)
                except Exception as exc:
                    raise BackendError(f"Inductor could not compile a stored engine: {_short(exc)}") from exc
                _COMPILED[key] = compiled
        return InductorEngine(compiled, ordered, io)

    def refit(self, engine: bytes, weights: Mapping[str, torch.Tensor]) -> bytes:
        header, files = read_engine(engine)
        ordered = _ordered(header, weights, torch.device("cpu"))
        import safetensors.torch

        files[WEIGHTS] = safetensors.torch.save(
            {name: t.contiguous() for name, t in zip(header["weights"], ordered, strict=True)}
        )
        return _pack(files)

    def check_compatible(self, header: Mapping[str, Any]) -> None:
        """EngineCompatibilityError unless an engine with this header runs here, on this backend's device."""
        if header.get("torch") != torch.__version__:
            raise EngineCompatibilityError(
                f"Inductor engine built with torch {header.get('torch')}; this is torch {torch.__version__}: "
                "recompile with this torch (Inductor's kernels and caches are version-specific)"
            )
        built_for, here = header.get("device"), self.target_device()
        if built_for != here:
            raise EngineCompatibilityError(
                f"Inductor engine built for {built_for}; this backend runs on {self.device} ({here}): "
                f"recompile for {here}, or load it on a machine with {built_for}"
            )
        host_compiler(header.get("options") or {})


def read_engine(engine: bytes) -> tuple[dict, dict[str, bytes]]:
    """(header, files) of an Inductor engine; BackendError when the bytes are not one."""
    try:
        with zipfile.ZipFile(io.BytesIO(engine)) as archive:
            files = {name: archive.read(name) for name in archive.namelist()}
        header = json.loads(files[HEADER])
    except (zipfile.BadZipFile, KeyError, ValueError) as exc:
        raise BackendError(f"not a kiln Inductor engine: {exc}") from exc
    if header.get("magic") != MAGIC or not isinstance(header.get("format"), int):
        raise BackendError("not a kiln Inductor engine: its header lacks the magic and format")
    if header["format"] > FORMAT:
        raise EngineCompatibilityError(
            f"Inductor engine format {header['format']} is newer than this kiln reads ({FORMAT}): "
            "upgrade kiln"
        )
    return header, files


def host_compiler(options: Mapping[str, Any]) -> str:
    """The C++ compiler Inductor will call (CPU kernels, Triton's launchers); BackendUnavailableError
    when there is none, since no Inductor engine builds or loads without one."""
    from torch._inductor import config

    configured = (options.get("compile_options") or {}).get("cpp.cxx", config.cpp.cxx)
    names = [c for c in (configured if isinstance(configured, list | tuple) else (configured,)) if c]
    names = names or [os.environ.get("CXX", "g++")]
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise BackendUnavailableError(
        f"backend 'inductor' needs a C++ compiler and none of {names} is on PATH: install g++ (or set CXX)"
    )


def _options(settings: BuildSettings) -> dict[str, Any]:
    check_backend_options(settings, BACKEND_OPTIONS, "Inductor")
    mode = settings.options.get("mode", "default")
    if mode not in _MODES:
        raise BuildSettingsError(f"backend_options mode {mode!r}: expected one of {_MODES}")
    compile_options = settings.options.get("compile_options") or {}
    if not isinstance(compile_options, Mapping):
        raise BuildSettingsError("backend_options compile_options must be a mapping of Inductor config")
    if settings.workspace_bytes is not None or settings.optimization_level is not None:
        raise BuildSettingsError(
            "workspace_bytes and optimization_level are TensorRT settings; Inductor takes backend_options "
            "mode and compile_options"
        )
    return {"mode": mode, "compile_options": dict(sorted(compile_options.items()))}


def _compile(
    program: bytes,
    engine_io: EngineIO,
    options: Mapping[str, Any],
    device: torch.device,
    weights: tuple[torch.Tensor, ...],
) -> Callable[..., Any]:
    """torch.compile of the partition program, run once at each shape class it will see (the opt shapes
    and, where a dynamic dim may be 1, the minimum: dynamo specialises size 1), so no call compiles."""
    from compiler.export import TRACING

    with TRACING:
        exported = torch.export.load(io.BytesIO(program))
        module = exported.module()
        # The unlifted module re-checks its inputs' shapes against the export's constraints in a forward
        # pre-hook that dynamo runs eagerly (pytree + sympy: ~0.5 ms a call on the H100 machine, per
        # engine). The compiled module checked the model's inputs already, and engine inputs follow
        # from them: drop it.
        module._forward_pre_hooks.clear()
        mode = options.get("mode", "default")
        compiled = torch.compile(
            module,
            mode=None if mode == "default" else mode,
            options=dict(options.get("compile_options") or {}) or None,
        )
        with torch.no_grad():
            for point in _warm_points(engine_io):
                compiled(*_examples(engine_io, point, device), *weights)
    return compiled


def _warm_points(engine_io: EngineIO) -> tuple[str, ...]:
    small = any(spec.min_shape[axis] < 2 for spec in engine_io.inputs for axis in spec.dynamic_dims)
    return ("opt", "min") if small else ("opt",)


def _examples(engine_io: EngineIO, point: str, device: torch.device) -> list[torch.Tensor]:
    tensors = []
    for spec in engine_io.inputs:
        shape = spec.opt_shape if point == "opt" else spec.min_shape
        dtype = torch_dtype(spec.dtype)
        # Zeros for integers and masks: valid indices for any embedding the partition may hold.
        tensor = (
            torch.randn(shape, dtype=dtype, device=device)
            if dtype.is_floating_point
            else torch.zeros(shape, dtype=dtype, device=device)
        )
        for axis in spec.dynamic_dims:
            lo, hi = spec.dim_range(axis)
            if shape[axis] >= 2:  # size 0/1 is specialised by dynamo whatever we mark
                torch._dynamo.mark_dynamic(tensor, axis, min=max(lo, 2), max=hi)
        tensors.append(tensor)
    return tensors


def _load_weights(data: bytes, device: torch.device) -> dict[str, torch.Tensor]:
    import safetensors.torch

    loaded = safetensors.torch.load(data)
    return {k: v.to(device) for k, v in sorted(loaded.items(), key=lambda kv: int(kv[0][1:]))}


def _ordered(
    header: Mapping[str, Any], weights: Mapping[str, torch.Tensor], device: torch.device
) -> tuple[torch.Tensor, ...]:
    """The weights in the engine's input order, checked against the header's names, shapes and dtypes."""
    expected = header["weights"]
    missing, unknown = sorted(set(expected) - set(weights)), sorted(set(weights) - set(expected))
    if missing or unknown:
        raise RefitError(f"weights do not match the engine: missing {missing}, unexpected {unknown}")
    ordered = []
    for name in sorted(expected, key=lambda n: int(n[1:])):
        shape, dtype = expected[name]
        tensor = weights[name]
        if list(tensor.shape) != list(shape) or dtype_name(tensor.dtype) != dtype:
            raise RefitError(
                f"weight {name!r}: expected shape {tuple(shape)} dtype {dtype}, got shape "
                f"{tuple(tensor.shape)} dtype {dtype_name(tensor.dtype)}"
            )
        ordered.append(tensor.detach().to(device))
    return tuple(ordered)


def _library_key(program: bytes, header: Mapping[str, Any]) -> str:
    """One compiled graph per program, device and options: what instances and rebuilds share."""
    meta = {k: header[k] for k in ("torch", "device", "options")}
    return hashlib.sha256(program + json.dumps(meta, sort_keys=True).encode()).hexdigest()


def _pack(files: Mapping[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for name in (HEADER, PROGRAM, WEIGHTS, ARTIFACTS):  # header first: readable without the rest
            if name in files:
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))  # equal builds, equal bytes
                archive.writestr(info, files[name])
    return buffer.getvalue()


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    lines = [line for line in text.splitlines() if line.strip()]
    return " ".join(lines[:6])[:1500]
