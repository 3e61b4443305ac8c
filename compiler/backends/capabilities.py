"""What each backend can do, one record per backend, read without torch.

Every rule that depends on which backend builds the engines is a field of its :class:`BackendRecord`:
what its ``build`` takes (``graph_format``), which quantized precisions and quantization modes it builds
and on which devices, whether a PyTorch CUDA-graph capture records its engines, which shape profiles it
builds engines for, and how it quantizes (the settings that enter fingerprints). ``CompileOptions``
(``compiler/options.py``), the CUDA-graph policy (``compiler/runtime/cudagraph_policy.py``), the
backend protocol (``compiler/backends/base.py``), ``get_backend`` and the CLI's help read it; nothing
else compares a backend's name.

A new backend is its package (a class meeting ``EngineBackend``, and a ``create(name, device,
trust_engine_code)`` function) plus one record here, or one :func:`register` call for a backend that
lives outside kiln (the tests add one that way: ``tests/backends/``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from compiler.errors import BackendError, OptionsError
from compiler.inputs.profiles import fixed_profiles

if TYPE_CHECKING:
    from compiler.backends.base import EngineBackend

CPU_AND_CUDA = ("cpu", "cuda")
# What a build profile policy gives a backend's engines (BuildSettings.profiles): every profile (one
# optimization profile each), the fixed ones (one static-shape specialization each), or none (one
# dynamic engine serves every shape, and profiles stay out of its cache keys).
PROFILE_POLICIES = ("all", "fixed", "none")

# The graphs quantized engines are built from, named in their quantization settings (so in their keys):
# ONNX Runtime's quantizer runs on its basic optimizations' graph (Conv+BatchNorm fused); Inductor on the
# CPU uses torchao's X86InductorQuantizer on the partition's program (graph and weights frozen), and on
# CUDA makes each eligible linear a dynamic rowwise torch._scaled_mm (fp8) or torch._int_mm (int8),
# weights staying refit inputs. A change to one changes every such graph's fingerprint.
QUANTIZED_GRAPH = "ort-basic-optimized"
PT2E_GRAPH = "pt2e-x86-inductor"
ROWWISE_GRAPHS = {"fp8": "aten-scaled-mm-rowwise", "int8": "aten-int-mm-rowwise"}


@dataclass(frozen=True)
class Quantizing:
    """What a backend's quantization rules read of a compile (not the options object, which is built
    on this table): its device, ``CompileOptions.quantization`` and ``calibration.method``."""

    backend: str
    device: str
    mode: str
    method: str

    @property
    def device_kind(self) -> str:
        return self.device.split(":")[0]


def _no_rules(q: Quantizing, levels: tuple[str, ...]) -> None:
    return None


def _no_quantization(q: Quantizing, precision: str) -> dict[str, Any]:
    raise OptionsError(f"backend {q.backend!r} builds no {precision} engines")


@dataclass(frozen=True)
class BackendRecord:
    """One backend's capabilities; see the module docstring."""

    name: str
    summary: str  # one line for the CLI's help and the docs
    # "module:function" making the backend: function(name, device, trust_engine_code) -> EngineBackend
    # (None for a chooser, "auto", which get_backend resolves to one of its ``choices``).
    create: str | None
    graph_format: str  # "onnx" (the lowered ONNX model) or "torch.export" (a torch graph archive)
    runs_on: tuple[str, ...]  # device kinds its engines run on
    build_profiles: str  # one of PROFILE_POLICIES
    # Whether its engines run on PyTorch's current CUDA stream, so a CUDA-graph capture records them;
    # ``no_capture`` says why not, for the error.
    cuda_graph_capture: bool
    no_capture: str = ""
    # Quantized precision -> device kinds it builds them on; ``refusals``: why not, per precision.
    quantizes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    refusals: Mapping[str, str] = field(default_factory=dict)
    # Quantization mode (CompileOptions.quantization) -> device kinds it quantizes that way on.
    quantization_modes: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # The refusals of quantized compiles beyond the precision (modes, methods, devices), by name.
    check_quantizing: Callable[[Quantizing, tuple[str, ...]], None] = _no_rules
    # What decides a quantized graph's structure and types (fingerprinted): see the functions below.
    quantization_settings: Callable[[Quantizing, str], dict[str, Any]] = _no_quantization
    # A chooser, not a library ("auto"): device kind -> the backends to try, in order (the first that
    # builds here and whose engines run here; the last one as it is).
    choices: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # Device kind -> what a bandwidth-bound program (a generation's decode step, which reads every
    # weight once per token) is built with where the operator did not set it: ``backend_options`` keys
    # and ``profiles`` (CompileOptions fields).
    decode_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    # "module:function" (engine bytes -> the same engine weight-stripped) where a package stores its
    # engines stripped whatever ``strip_weights`` built: a package load passes every engine its weights
    # from the package's weights file and reads none of the engine's own, so that copy would be bytes
    # written, hashed and shipped for nothing. None: a package keeps the engine as built.
    package_strip: str | None = None
    # Whether its engines run kiln's own ops inside them (``kiln::decode_attention``, whose CUDA form is
    # Triton kernels): a decode program it builds at fp16/bf16 on CUDA is traced with the op. Elsewhere
    # a graph holding one would split around it.
    kiln_ops: bool = False

    def strip_for_package(self, engine: bytes) -> bytes | None:
        """``engine`` weight-stripped for a package (see ``package_strip``); None where it stays as built."""
        if self.package_strip is None:
            return None
        module, _, function = self.package_strip.partition(":")
        return getattr(importlib.import_module(module), function)(engine)

    def __post_init__(self) -> None:
        if self.build_profiles not in PROFILE_POLICIES:
            raise BackendError(
                f"backend record {self.name!r}: build_profiles {self.build_profiles!r}; expected one of "
                f"{PROFILE_POLICIES}"
            )
        if self.graph_format not in ("onnx", "torch.export"):
            raise BackendError(f"backend record {self.name!r}: graph_format {self.graph_format!r}")

    def profiles_built(self, profiles: tuple[Mapping[str, Any], ...]) -> tuple[Mapping[str, Any], ...]:
        """The profiles its engines are built for (so they enter cache keys only where they change them)."""
        if self.build_profiles == "fixed":
            return tuple(fixed_profiles(profiles))
        return () if self.build_profiles == "none" else tuple(profiles)

    def make(self, device: str, trust_engine_code: bool) -> EngineBackend:
        """The backend itself (imports its library: BackendUnavailableError where it is missing)."""
        if self.create is None:
            raise BackendError(f"backend {self.name!r} is one of its choices, made by get_backend")
        module, _, function = self.create.partition(":")
        return getattr(importlib.import_module(module), function)(self.name, device, trust_engine_code)


# An int8 product on an x86 CPU without VNNI (AVX2 only, as this workplace's Zen 3 machines, or AVX-512
# without VNNI) goes through VPMADDUBSW, which adds two uint8 x int8 products into int16 and saturates: 255 x
# 127 x 2 > 32767. One side at 7 bits keeps every pair inside it, so an int8 engine computes the same on
# every x86 CPU as on the one it was validated on (a package moves between them; its engine target is
# "cpu"). Without it, on Zen 3 the suite's int8 models missed bounds they meet on AVX-512 VNNI: a
# rebuilt int8 package erred 0.133 rel_l2 (bound 0.1), a BERT with a layer kept in float erred more than
# all-int8, and an Inductor int8 engine compiled at load answered 0.03 away from its native package.
# ONNX Runtime narrows the weights (its reduce_range), torchao's x86 recipe the activations (its only way).
REDUCE_RANGE = {"reduce_range": True}


# ---- ONNX Runtime: uint8 activations with a zero point, int8 weights at 7 bits (REDUCE_RANGE), int32
# biases (its fast U8S8 kernels); scales are put in like weights ("refit"), so one engine serves every
# instance of a block.
def _onnxruntime_quantization(q: Quantizing, precision: str) -> dict[str, Any]:
    settings = _qdq_quantization(q, precision, scales="refit", types="u8s8")
    return settings if precision == "fp8" else {**settings, **REDUCE_RANGE}


# ---- TensorRT: symmetric activations (zero point 0, which it requires), biases left in float; scales
# are compiled into its kernels and it refuses to refit them ("graph": each instance its own engine).
# fp8 is E4M3 on both sides, calibrated by ONNX Runtime's float8 calibrator (``distribution``, its only
# one: ``calibration.method`` applies to int8).
def _tensorrt_quantization(q: Quantizing, precision: str) -> dict[str, Any]:
    return _qdq_quantization(q, precision, scales="graph", types="s8s8-symmetric")


def _qdq_quantization(q: Quantizing, precision: str, *, scales: str, types: str) -> dict[str, Any]:
    common = {"per_channel": True, "graph": QUANTIZED_GRAPH, "scales": scales}
    if q.mode == "dynamic":
        return {"mode": "dynamic", **common}
    if precision == "fp8":
        return {"mode": "static", "method": "distribution", "types": "e4m3fn-symmetric", **common}
    return {"mode": "static", "method": q.method, "types": types, **common}


def _tensorrt_rules(q: Quantizing, levels: tuple[str, ...]) -> None:
    if levels and q.mode == "dynamic":
        raise OptionsError(
            f"quantization 'dynamic' with backend {q.backend!r}: TensorRT takes explicit Q/DQ "
            "graphs only, with activation scales calibrated ahead; use quantization: static"
        )


# ---- Inductor: on the CPU, uint8 activations at 7 bits (REDUCE_RANGE) and per-channel int8 weights
# (X86InductorQuantizer's recipe), weights and scales frozen into each instance's program as oneDNN's
# prepacked kernels need; on CUDA, weights with row scales (refit tensors), activations scaled per row
# at run time, the other ops in bf16 ("compute").
def _inductor_quantization(q: Quantizing, precision: str) -> dict[str, Any]:
    if q.device_kind == "cuda":
        return {
            "mode": "dynamic",
            "types": "e4m3fn-rowwise" if precision == "fp8" else "s8s8-rowwise-symmetric",
            "per_channel": True,
            "graph": ROWWISE_GRAPHS[precision],
            "scales": "refit",
            "compute": "bf16",
        }
    return {
        "mode": "static",
        "method": "minmax",
        "types": "u8s8",
        "per_channel": True,
        "graph": PT2E_GRAPH,
        "scales": "graph",
        "weights": "frozen",
        **REDUCE_RANGE,
    }


def _inductor_rules(q: Quantizing, levels: tuple[str, ...]) -> None:
    """int8 on the CPU is static (oneDNN); on CUDA int8 and fp8 are dynamic rowwise (torch._int_mm,
    torch._scaled_mm)."""
    cuda = q.device_kind == "cuda"
    if "int8" in levels and not cuda:
        if q.mode == "dynamic":
            raise OptionsError(
                "quantization 'dynamic' with backend 'inductor' and int8 on the CPU: its oneDNN int8 "
                "kernels take activation scales calibrated ahead; use quantization: static (dynamic "
                "int8 is Inductor's recipe on CUDA)"
            )
        if q.method != "minmax":
            raise OptionsError(
                f"calibration.method {q.method!r} is ONNX Runtime's calibrator; "
                "backend 'inductor' calibrates with torchao's observers: use 'minmax'"
            )
    if "fp8" in levels and not cuda:
        raise OptionsError(
            f"precision fp8 with backend 'inductor' on {q.device}: fp8 GEMMs "
            "(torch._scaled_mm) run on CUDA GPUs of compute capability 8.9+; use device: cuda"
        )
    if cuda and levels and q.mode != "dynamic":
        raise OptionsError(
            f"precision {' and '.join(levels)} with backend 'inductor' on CUDA scales activations per "
            "row at run time (torchao's dynamic rowwise recipes): use quantization: dynamic (no "
            "calibration data)"
        )


_ORT_STREAMS = "ONNX Runtime runs its engines on its own streams, outside a PyTorch capture"


def _tensorrt(name: str, summary: str) -> BackendRecord:
    # No package_strip: a built plan is stripped only by TensorRT on its GPU (serialized again without
    # its weights). Its package load refits every engine from the package's weights either way, so a
    # full engine costs its bytes, not a refit: strip_weights=True builds them stripped.
    return BackendRecord(
        name=name,
        summary=summary,
        create="compiler.backends.tensorrt.builder:create",
        graph_format="onnx",
        runs_on=("cuda",),
        build_profiles="all",  # one optimization profile per profile, beside the declared range's
        cuda_graph_capture=True,
        quantizes={"int8": ("cuda",), "fp8": ("cuda",)},  # fp8 GEMMs: compute capability 8.9+, at build
        quantization_modes={"static": ("cuda",)},
        check_quantizing=_tensorrt_rules,
        quantization_settings=_tensorrt_quantization,
    )


_RECORDS: dict[str, BackendRecord] = {
    record.name: record
    for record in (
        BackendRecord(
            name="onnxruntime",
            summary="ONNX Runtime: the embedded default (CPU; CUDA with onnxruntime-gpu)",
            create="compiler.backends.onnxruntime:create",
            graph_format="onnx",
            runs_on=CPU_AND_CUDA,
            build_profiles="none",  # one dynamic engine
            cuda_graph_capture=False,
            no_capture=_ORT_STREAMS,
            quantizes={"int8": CPU_AND_CUDA},
            refusals={"fp8": "ONNX Runtime has no fp8 kernels on the CPU"},
            quantization_modes={"static": CPU_AND_CUDA, "dynamic": CPU_AND_CUDA},
            quantization_settings=_onnxruntime_quantization,
            # Its load supplies every weight initializer from memory (stripping a full engine's first).
            package_strip="compiler.backends.onnxruntime:strip_engine",
        ),
        _tensorrt("tensorrt", "NVIDIA TensorRT 10/11 (CUDA; pip install kiln[tensorrt])"),
        _tensorrt("tensorrt-rtx", "TensorRT for RTX (CUDA; pip install kiln[tensorrt-rtx])"),
        BackendRecord(
            name="inductor",
            summary="PyTorch's own compiler (CPU and CUDA)",
            create="compiler.backends.inductor.backend:create",
            graph_format="torch.export",  # it compiles the partition's exported program itself
            runs_on=CPU_AND_CUDA,
            build_profiles="fixed",  # one static-shape specialization per fixed profile
            cuda_graph_capture=True,
            quantizes={"int8": CPU_AND_CUDA, "fp8": ("cuda",)},  # int8: PT2E on x86, rowwise on CUDA
            quantization_modes={"static": ("cpu",), "dynamic": ("cuda",)},
            check_quantizing=_inductor_rules,
            quantization_settings=_inductor_quantization,
            # Decode GEMMs at batch 1-8 are matrix-vector products: on the H100 Inductor's autotuned
            # Triton templates read a 1.5B Llama's weights at 83% of copy bandwidth at batch 1 (68% at
            # 8), cuBLAS at 53% (benchmarks/probes/probe_decode_gemm.h100.json); but tuned for a dynamic
            # batch they read them at 51% at batch 1 (probe_decode_profile2.h100.json), so batch 1 gets
            # its own static-shape engine. A step is ~190 short kernels: programmatic dependent launch
            # (Hopper+, Triton's gdc_wait; ignored below sm_90) starts each while the one before drains:
            # 1.383 -> 1.244 ms a step (benchmarks/probes/probe_decode_pdl_{off,on}.h100.json).
            decode_options={
                "cuda": {
                    "backend_options": {
                        "mode": "max-autotune-no-cudagraphs",
                        "compile_options": {"triton.enable_pdl": True},
                    },
                    "profiles": ({"batch": 1},),
                }
            },
            package_strip="compiler.backends.inductor.format:strip_engine",  # weights are graph inputs
            kiln_ops=True,
        ),
        # Not a library: get_backend picks TensorRT on CUDA where one runs, else Inductor, and ONNX
        # Runtime on the CPU. Its options are checked as TensorRT's (its first choice on CUDA), and it
        # quantizes nothing: a quantized compile names the backend that builds it.
        BackendRecord(
            name="auto",
            summary="TensorRT on CUDA where it runs, else Inductor; ONNX Runtime on the CPU",
            create=None,
            graph_format="onnx",
            runs_on=CPU_AND_CUDA,
            build_profiles="all",
            cuda_graph_capture=True,  # on CUDA it is TensorRT or Inductor; the CPU captures nothing
            choices={"cpu": ("onnxruntime",), "cuda": ("tensorrt", "tensorrt-rtx", "inductor")},
        ),
    )
}
AUTO = "auto"
_BUILT_IN = frozenset(_RECORDS)


def register(record: BackendRecord) -> None:
    """Add a backend that lives outside this module (its package names itself in ``record.create``);
    a record of the same name is replaced, so a re-import registers again harmlessly."""
    _RECORDS[record.name] = record


def unregister(name: str) -> None:
    """Remove a registered backend (a test's, or a plugin's that is unloaded); kiln's own stay."""
    if name in _BUILT_IN:
        raise BackendError(f"backend {name!r} is one of kiln's own; it cannot be removed")
    _RECORDS.pop(name, None)


def backend_names() -> tuple[str, ...]:
    """Every backend a compile may name, "auto" last."""
    return (*(n for n in _RECORDS if n != AUTO), AUTO)


def capabilities(name: str) -> BackendRecord:
    """The record of backend ``name``; an OptionsError naming the known ones where there is none."""
    record = _RECORDS.get(name)
    if record is None:
        raise OptionsError(f"backend {name!r} is not a backend; expected one of {backend_names()}")
    return record


def is_backend(name: str) -> bool:
    return name in _RECORDS


def capturable(name: str) -> bool:
    """Whether engines of backend ``name`` run on PyTorch's CUDA stream (an unknown name: no)."""
    record = _RECORDS.get(name)
    return record is not None and record.cuda_graph_capture


def quantizing_backends(precision: str) -> tuple[str, ...]:
    """The backends that build ``precision`` engines on some device."""
    return tuple(n for n, r in _RECORDS.items() if precision in r.quantizes)


def _where(record: BackendRecord, devices: tuple[str, ...]) -> str:
    # "inductor on cuda" where a backend does something on fewer devices than it runs on.
    return record.name if set(record.runs_on) <= set(devices) else f"{record.name} on {'/'.join(devices)}"


def backend_help() -> str:
    """``onnxruntime, tensorrt, tensorrt-rtx, inductor, auto``: the CLI's ``--backend`` help."""
    return ", ".join(backend_names())


def precision_help(float_precisions: tuple[str, ...], quantized: tuple[str, ...]) -> str:
    """``fp32, fp16, bf16, int8 (onnxruntime, ...), fp8 (tensorrt, ..., inductor on cuda)``, from the
    precisions of ``compiler.backends.base`` (which reads this table: it passes them in)."""
    parts = list(float_precisions)
    for precision in quantized:
        names = [_where(r, r.quantizes[precision]) for r in _RECORDS.values() if precision in r.quantizes]
        parts.append(f"{precision} ({', '.join(names)})")
    return ", ".join(parts)


def quantization_help() -> str:
    """``static (calibrated, default) or dynamic (onnxruntime; inductor on cuda)``."""
    dynamic = [
        _where(r, r.quantization_modes["dynamic"])
        for r in _RECORDS.values()
        if "dynamic" in r.quantization_modes
    ]
    return f"static (calibrated, default) or dynamic ({'; '.join(dynamic)})"
