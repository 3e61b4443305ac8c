"""The TensorRT / TensorRT-RTX backend: one class for both libraries (same Python API) that parses
lowered partitions, builds engines, and loads and refits them.

Build: ONNX parser -> strongly typed network (precision is already in the graph) -> one
optimization profile from the EngineIO specs -> refittable engine whose refittable weights are
exactly the canonical initializers ``w0, w1, ...`` (REFIT_INDIVIDUAL), stripped of them
(STRIP_PLAN) when ``settings.strip_weights``, then wrapped in kiln's engine header
(:mod:`~compiler.backends.tensorrt.engine_format`, which xz-compresses stripped plans). The timing
cache persists beside the engine cache (TensorRT only).

Guarantees: constructing a backend imports its library and needs a CUDA GPU (else
BackendUnavailableError, so ``auto`` falls back to ONNX Runtime), except ``require_gpu=False`` for
TensorRT-RTX's CPU-only builds and parsing; a build or parse failure is an EngineBuildError naming
the partition and, where TensorRT says it, the ONNX node; an engine is loaded only after its
header matched this library, version and GPU.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import onnx
import torch

from compiler.atomic import write_bytes_atomic
from compiler.backends.base import BuildSettings, EngineIO, RecordedBackend
from compiler.backends.onnx_inline import check_self_contained
from compiler.backends.tensorrt.build_settings import (
    builder_flag_names,
    optimization_profile,
    optimization_profiles,
    refit_mode,
)
from compiler.backends.tensorrt.engine_format import (
    HEADER_FORMAT,
    EngineTarget,
    check_engine_compatible,
    check_header,
    decode_engine,
    encode_engine,
    sm_number,
)
from compiler.backends.tensorrt.library import (
    LIBRARIES,
    RTX_DEFAULT_COMPUTE_CAPABILITIES,
    LogWindow,
    current_compute_capability,
    import_library,
    log_collector,
)
from compiler.backends.tensorrt.onnx_rewrites import canonical_initializers, unfold_batch_norm
from compiler.backends.tensorrt.runtime import TensorRTEngine, deserialize, refit_in_place
from compiler.backends.tensorrt.support import tensorrt_supports
from compiler.errors import (
    BackendError,
    BackendUnavailableError,
    BuildSettingsError,
    EngineBuildError,
    InputSpecError,
    RefitError,
)


def _check_fp8_target(settings: BuildSettings, targets: Sequence[str], partition: str | None) -> None:
    """fp8 Q/DQ needs FP8 tensor cores: compute capability 8.9 (Ada) or later, for every target."""
    older = [cc for cc in targets if sm_number(cc) < 89]
    if settings.precision == "fp8" and older:
        raise EngineBuildError(
            f"partition {partition}: precision fp8 needs compute capability 8.9 or later (FP8 tensor "
            f"cores); the engine targets {', '.join(older)}",
            partition=partition,
        )


def _error_node(text: str, node_names: Sequence[str]) -> str | None:
    """The ONNX node a TensorRT error message names (layers carry their node's name), longest first
    so that ``node_linear_1`` wins over ``node_linear``."""
    for name in sorted((n for n in node_names if n), key=len, reverse=True):
        if re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text):
            return name
    return None


def create(name: str, device: str, trust_engine_code: bool) -> TensorRTBackend:
    """Its records' maker (compiler.backends.capabilities): plans run with host code disallowed, so
    trust changes nothing; engines run on the GPU of the CUDA ``device``."""
    return TensorRTBackend(name)


class TensorRTBackend(RecordedBackend):
    """EngineBackend for ``tensorrt`` (TensorRT 10/11) and ``tensorrt-rtx`` (TensorRT for RTX).

    Construction imports the library and needs a CUDA GPU (BackendUnavailableError otherwise, so
    that ``auto`` falls back to ONNX Runtime). ``require_gpu=False`` allows TensorRT-RTX's CPU-only
    ahead-of-time builds of non-refittable engines (``options['refit']='none'``) and parsing.
    ``timing_cache_dir``: where the builder's timing cache persists across builds and processes
    (TensorRT only; TensorRT-RTX's timing cache is a no-op that would also force a GPU query).
    ``compute_capabilities``: the one compute capability a TensorRT-RTX engine is built for, such as
    ``("sm_89",)``; by default the library's portable set (:data:`RTX_DEFAULT_COMPUTE_CAPABILITIES`
    and later). TensorRT-RTX 1.7.1 fails to build for several explicit compute capabilities at once
    (Myelin ``sm_vers_.size() == 1``), so kiln takes one.
    """

    def __init__(
        self,
        name: str = "tensorrt",
        *,
        timing_cache_dir: str | os.PathLike | None = None,
        compute_capabilities: Sequence[str] | None = None,
        require_gpu: bool = True,
    ) -> None:
        if name not in LIBRARIES:
            raise BackendError(f"unknown TensorRT backend {name!r}; expected one of {sorted(LIBRARIES)}")
        self.name = name
        self.rtx = name == "tensorrt-rtx"
        self.timing_cache_dir = Path(timing_cache_dir) if timing_cache_dir is not None else None
        if compute_capabilities is not None and not self.rtx:
            raise BackendError("compute_capabilities is a TensorRT-RTX setting; TensorRT builds for this GPU")
        self.compute_capabilities = tuple(compute_capabilities) if compute_capabilities else None
        for cc in self.compute_capabilities or ():
            if not re.fullmatch(r"sm_\d+", cc):
                raise BackendError(f"compute capability {cc!r}: expected the form 'sm_86'")
        if self.compute_capabilities and len(self.compute_capabilities) != 1:
            raise BackendError(
                f"compute_capabilities {self.compute_capabilities}: TensorRT-RTX builds for one explicit "
                "target "
                "at a time (or, with none given, for its portable default set)"
            )
        self._module: Any = None
        self.trt  # noqa: B018 - import now: a missing library must fail here, not at the first build
        if require_gpu:
            self._require_gpu("this backend")

    # -- library and device ------------------------------------------------------------------

    @property
    def trt(self) -> Any:
        """The imported library module (BackendUnavailableError naming the extra if absent)."""
        if self._module is None:
            self._module = import_library(self.name)
        return self._module

    def _require_gpu(self, what: str) -> str:
        sm = current_compute_capability()
        if sm is None:
            raise BackendUnavailableError(
                f"{what} ({self.name}) needs a CUDA GPU, and torch sees none here "
                "(torch.cuda.is_available() "
                "is False); use the onnxruntime backend or run on a GPU machine"
            )
        return sm

    def check_runnable(self) -> None:
        """BackendUnavailableError unless engines built now can also run on this machine's GPU
        (TensorRT-RTX 1.7 builds on an H100 but its runtime refuses sm_90)."""
        sm = self._require_gpu(f"running {self.name} engines")
        engine_target = self._engine_target()
        if not engine_target.runs_on(sm):
            raise BackendUnavailableError(
                f"{self.name} engines run on {engine_target.describe()}; this GPU is {sm}"
            )

    def library_version(self) -> str:
        return str(self.trt.__version__)

    def _engine_target(self) -> EngineTarget:
        """The compute capabilities engines built now run on (TensorRT: this GPU's)."""
        if self.rtx:
            if self.compute_capabilities:
                return EngineTarget(self.compute_capabilities)
            return EngineTarget(RTX_DEFAULT_COMPUTE_CAPABILITIES, and_later=True)
        return EngineTarget((self._require_gpu("building an engine"),))

    def engine_target(self) -> str:
        """The engine target of builds now, e.g. ``cuda:sm_90``."""
        return str(self._engine_target())

    def supports(self, target: Any) -> bool:  # ``target``: the protocol's name for an fx node's op
        return tensorrt_supports(target)

    def _logger(self) -> LogWindow:
        return LogWindow(log_collector(self.trt))

    # -- build ---------------------------------------------------------------------------------

    def build(
        self,
        onnx_model: bytes,
        io: EngineIO,
        settings: BuildSettings,
        *,
        partition: str | None = None,
        cache_dir: str | os.PathLike | None = None,
    ) -> bytes:
        """Engine bytes for a lowered partition (kiln header + TensorRT plan).

        ``partition`` names the partition in errors; by default the ONNX graph's name. ``cache_dir``
        (the engine cache's directory) keeps the timing cache in ``<cache_dir>/timing`` unless the
        backend was given a ``timing_cache_dir``.
        """
        import onnx

        model = onnx.load_model_from_string(bytes(onnx_model))
        partition = partition or model.graph.name or None
        node_names = [n.name for n in model.graph.node]
        flag_names = builder_flag_names(settings)
        profiles = optimization_profiles(io, settings)
        weights = canonical_initializers(model)
        trt = self.trt
        # TensorRT-RTX compiles ahead of time without a GPU, except refittable engines (its Myelin
        # JIT then queries the device, seen on TensorRT-RTX 1.7.1); TensorRT always needs one.
        if not self.rtx or flag_names:
            self._require_gpu(f"building a{' refittable' if flag_names else 'n'} engine")
        if flag_names and unfold_batch_norm(model):  # refit needs BatchNorm weights by name
            onnx_model = model.SerializeToString()
        logger, builder, network, _parser = self._parsed(onnx_model, io, partition)

        config = builder.create_builder_config()
        for shapes in profiles:  # the declared range's first: the default a context starts with
            profile = builder.create_optimization_profile()
            for name, (lo, opt, hi) in shapes.items():
                profile.set_shape(name, lo, opt, hi)
            if config.add_optimization_profile(profile) < 0:
                raise EngineBuildError(
                    f"{self.name} refused optimization profile {shapes} for partition {partition}",
                    partition=partition,
                )
        if settings.workspace_bytes is not None:
            if settings.workspace_bytes <= 0:
                raise BuildSettingsError(f"workspace_bytes must be positive, got {settings.workspace_bytes}")
            config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(settings.workspace_bytes))
        if settings.optimization_level is not None:
            if not 0 <= settings.optimization_level <= 5:
                raise BuildSettingsError(
                    "optimization_level must be 0..5 (TensorRT builder levels), "
                    f"got {settings.optimization_level}"
                )
            config.builder_optimization_level = int(settings.optimization_level)
        for flag in flag_names:
            config.set_flag(getattr(trt.BuilderFlag, flag))
        if "REFIT_INDIVIDUAL" in flag_names:
            for name in weights:
                if not network.mark_weights_refittable(name):
                    raise EngineBuildError(
                        f"partition {partition}: weight {name!r} cannot be made refittable "
                        "(TensorRT does not "
                        "see it as weights; is it used as a shape?)",
                        partition=partition,
                    )
        engine_target = self._engine_target()
        _check_fp8_target(settings, engine_target.compute_capabilities, partition)
        if self.rtx and self.compute_capabilities:
            config.num_compute_capabilities = len(engine_target.compute_capabilities)
            for i, cc in enumerate(engine_target.compute_capabilities):
                member = getattr(trt.ComputeCapability, "SM" + cc.removeprefix("sm_"), None)
                if member is None:
                    raise BuildSettingsError(f"{self.name} {self.library_version()} cannot target {cc}")
                config.set_compute_capability(member, i)
        timing_dir = self.timing_cache_dir or (Path(cache_dir) / "timing" if cache_dir else None)
        timing_path = self._load_timing_cache(config, engine_target.compute_capabilities[0], timing_dir)

        plan = builder.build_serialized_network(network, config)
        if plan is None:
            text = "\n".join(logger.errors()) or "no message from TensorRT"
            node = _error_node(text, node_names)
            where = f" at node {node!r}" if node else ""
            raise EngineBuildError(
                f"{self.name} could not build partition {partition}{where}: {text}",
                partition=partition,
                node=node,
            )
        if timing_path is not None:
            write_bytes_atomic(timing_path, bytes(memoryview(config.get_timing_cache().serialize())))
        header = {
            "format": HEADER_FORMAT,
            "backend": self.name,
            "library_version": self.library_version(),
            **engine_target.header_fields(),
            "stripped": bool(settings.strip_weights),
            "refit": refit_mode(settings),
            "weights": weights,
            "inputs": [s.name for s in io.inputs],
            "outputs": list(io.output_names),
        }
        if len(profiles) > 1:  # the runtime picks one per call (build_settings.choose_profile)
            header["profiles"] = [{n: [list(b) for b in bounds] for n, bounds in p.items()} for p in profiles]
        return encode_engine(header, bytes(memoryview(plan)), compress=bool(settings.strip_weights))

    def parse(self, onnx_model: bytes, io: EngineIO, *, partition: str | None = None) -> int:
        """Parse a lowered partition into a strongly typed network without building it (no GPU
        needed): the number of network layers, or EngineBuildError naming the rejected nodes."""
        return self._parsed(onnx_model, io, partition)[2].num_layers

    def _parsed(self, onnx_model: bytes, io: EngineIO, partition: str | None) -> tuple[Any, Any, Any, Any]:
        trt = self.trt
        shapes = optimization_profile(io)
        logger = self._logger()
        builder = trt.Builder(logger.logger)
        flags = 0
        if hasattr(trt.NetworkDefinitionCreationFlag, "STRONGLY_TYPED"):  # TensorRT >= 9
            flags |= 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, logger.logger)
        # The parser reads external data relative to the working directory: only inline models are parsed.
        check_self_contained(onnx.load_from_string(bytes(onnx_model)))
        if not parser.parse(bytes(onnx_model)):
            raise self._parse_error(parser, partition)
        self._check_network_io(network, io, shapes, partition)
        return logger, builder, network, parser  # the parser owns weights the network points at

    def _parse_error(self, parser: Any, partition: str | None) -> EngineBuildError:
        problems, first = [], None
        for i in range(parser.num_errors):
            err = parser.get_error(i)
            node = err.node_name() or None
            first = first or node
            problems.append(f"node {node!r} ({err.node_operator() or '?'}): {err.desc()} [{err.code()}]")
        text = "; ".join(problems) or "no parser error recorded"
        return EngineBuildError(
            f"{self.name}'s ONNX parser rejected partition {partition}: {text}",
            partition=partition,
            node=first,
        )

    def _check_network_io(self, network: Any, io: EngineIO, shapes: Mapping, partition: str | None) -> None:
        inputs = {network.get_input(i).name: network.get_input(i) for i in range(network.num_inputs)}
        outputs = [network.get_output(i).name for i in range(network.num_outputs)]
        if set(inputs) != set(shapes) or set(outputs) != set(io.output_names):
            raise EngineBuildError(
                f"partition {partition}: the ONNX graph has inputs {sorted(inputs)} and outputs "
                f"{outputs}, but "
                f"its EngineIO declares inputs {list(shapes)} and outputs {list(io.output_names)}",
                partition=partition,
            )
        for name, (lo, _opt, hi) in shapes.items():
            dims = tuple(inputs[name].shape)
            bad = len(dims) != len(lo) or any(
                d >= 0 and not a <= d <= b for d, a, b in zip(dims, lo, hi, strict=False)
            )
            if bad:
                raise InputSpecError(
                    f"partition {partition}: input {name!r} has shape {dims} in the ONNX graph "
                    "(-1 = dynamic), "
                    f"which the spec range min {lo} max {hi} does not fit"
                )

    def _load_timing_cache(self, config: Any, compute_capability: str, directory: Path | None) -> Path | None:
        if self.rtx or directory is None:
            return None
        path = directory / f"{self.name}-{self.library_version()}-{compute_capability}.timing"
        blob = path.read_bytes() if path.is_file() else b""
        cache = config.create_timing_cache(blob)
        if cache is None and blob:  # an unreadable cache file only costs tuning time: start afresh
            cache = config.create_timing_cache(b"")
        config.set_timing_cache(cache, False)
        return path

    # -- runtime ---------------------------------------------------------------------------------

    def _deserialize(self, engine: bytes) -> tuple[dict[str, Any], Any, Any, LogWindow]:
        header, plan = decode_engine(engine)
        check_header(header)  # a tampered header is a typed refusal before the checks that read it
        sm = self._require_gpu("running an engine")
        check_engine_compatible(header, self.name, self.library_version(), sm)
        return (header, *deserialize(self.trt, self.name, plan, sm))

    def load(
        self,
        engine: bytes,
        io: EngineIO,
        weights: Mapping[str, torch.Tensor] | None,
        *,
        siblings: int = 0,
        cache: object = None,  # keeps nothing compiled at load
    ) -> TensorRTEngine:
        header, runtime, cuda_engine, logger = self._deserialize(engine)
        if weights:
            refit_in_place(self.trt, self.name, header, cuda_engine, logger, weights)
        elif header["stripped"] and header["weights"]:
            raise RefitError(
                f"this engine is weight-stripped; load it with its weights {list(header['weights'])}"
            )
        return TensorRTEngine(self.trt, runtime, cuda_engine, io, profiles=header.get("profiles"))

    def refit(self, engine: bytes, weights: Mapping[str, torch.Tensor]) -> bytes:
        header, _runtime, cuda_engine, logger = self._deserialize(engine)
        refit_in_place(self.trt, self.name, header, cuda_engine, logger, weights)
        config = cuda_engine.create_serialization_config()
        config.clear_flag(self.trt.SerializationFlag.EXCLUDE_WEIGHTS)  # a refit engine carries its weights
        plan = cuda_engine.serialize_with_config(config)
        return encode_engine({**header, "stripped": False}, bytes(memoryview(plan)))
