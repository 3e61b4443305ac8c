"""Inductor settings: what a build may ask for, what an untrusted engine may ask for, and the header check.

A build's ``backend_options`` come from the operator (a zoo file, ``kiln compile`` flags, the library
call): any Inductor config key is accepted there, toolchain settings included (``cpp.cxx`` on a machine
whose compiler lives elsewhere). An engine's header records those options, and an engine from an
untrusted package is compiled again from its program: the header is then attacker-chosen data, and
Inductor config reaches the C++ compiler's command line (``cpp.march``, ``cpp.cxx``), its environment
and the file system (cache and debug directories). So an untrusted compile takes only
:data:`UNTRUSTED_COMPILE_OPTIONS`, kiln's own list of tuning switches whose values are checked by type
and range; every other key is dropped (the loading process's own configuration applies) and named in a
warning. Dropping them changes how fast the engine is, never what it computes.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from collections.abc import Mapping
from typing import Any

import torch

from compiler.backends.base import BuildSettings, check_backend_options
from compiler.errors import BackendUnavailableError, BuildSettingsError, UnsafeEngineError
from compiler.inputs.specs import DTYPES

# backend_options keys: "mode" (torch.compile's mode names, as Inductor config), "compile_options"
# (Inductor config, torch.compile's ``options``), "aot" (an AOTInductor package per engine, for fast
# loads: compiler.backends.inductor.aot; on by default on CUDA devices).
BACKEND_OPTIONS = frozenset({"mode", "compile_options", "aot"})
# CUDA graphs ("reduce-overhead", "max-autotune") need a runtime that replays captured graphs on static
# buffers; a standalone compiled graph is a plain function, so those modes are refused.
MODES = ("default", "max-autotune-no-cudagraphs")


def _flag(value: Any) -> bool:
    return isinstance(value, bool)


def _int_in(low: int, high: int, *, none: bool = False):
    def check(value: Any) -> bool:
        if value is None:
            return none
        return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high

    return check


# What an untrusted engine may still choose: switches that change which kernels Inductor generates,
# never which program runs, which files it touches or what the C++ compiler is told. Value checked.
UNTRUSTED_COMPILE_OPTIONS = {
    **{
        key: _flag
        for key in (
            "aggressive_fusion",
            "alignment_asserts",
            "comprehensive_padding",
            "coordinate_descent_tuning",
            "emulate_precision_casts",
            "epilogue_fusion",
            "fallback_random",
            "freezing",
            "keep_output_stride",
            "layout_optimization",
            "max_autotune",
            "max_autotune_gemm",
            "max_autotune_pointwise",
            "nan_asserts",
            "pattern_matcher",
            "reorder_for_locality",
            "scalar_asserts",
            "shape_padding",
            "size_asserts",
            "split_reductions",
            "triton.autotune_pointwise",
            "triton.enable_pdl",
            "triton.persistent_reductions",
        )
    },
    "max_fusion_size": _int_in(1, 4096),
    "unroll_reductions_threshold": _int_in(0, 1024),
    "cpp.threads": _int_in(-1, 4096),
    "cpp.min_chunk_size": _int_in(1, 1 << 24),
}


def build_options(settings: BuildSettings, *, aot_default: bool = False) -> dict[str, Any]:
    """The options a build records in its engines' headers (the operator's: any Inductor config).
    ``aot_default``: whether an engine gets an AOTInductor package when ``aot`` is not given (on CUDA
    devices: the form that loads in seconds with no compiler present, issue 34)."""
    check_backend_options(settings, BACKEND_OPTIONS, "Inductor")
    mode = settings.options.get("mode", "default")
    if mode not in MODES:
        raise BuildSettingsError(
            f"backend_options mode {mode!r}: expected one of {MODES} (CUDA graph modes are not offered: "
            "an Inductor engine is a plain compiled function)"
        )
    compile_options = settings.options.get("compile_options") or {}
    if not isinstance(compile_options, Mapping):
        raise BuildSettingsError("backend_options compile_options must be a mapping of Inductor config")
    unknown = sorted(set(compile_options) - set(torch._inductor.config.get_config_copy()))
    if unknown:
        raise BuildSettingsError(
            f"backend_options compile_options {unknown}: not Inductor config settings "
            "(torch._inductor.config names them)"
        )
    if settings.workspace_bytes is not None or settings.optimization_level is not None:
        raise BuildSettingsError(
            "workspace_bytes and optimization_level are TensorRT settings; Inductor takes backend_options "
            "mode and compile_options"
        )
    aot = settings.options.get("aot", aot_default)
    if not isinstance(aot, bool):
        raise BuildSettingsError(f"backend_options aot must be true or false, not {aot!r}")
    built = {"mode": mode, "compile_options": dict(sorted(compile_options.items()))}
    return {**built, "aot": True} if aot else built  # absent when off: engine cache keys stay


def engine_options(header: Mapping[str, Any], trusted: bool) -> dict[str, Any]:
    """The options an engine is compiled with here: its header's where its package is trusted, else
    only kiln's own list of tuning switches (:func:`untrusted_options`, the dropped ones warned): a
    header must not choose the C++ compiler, its flags, paths or environment."""
    if trusted:
        return dict(header["options"])
    options, dropped = untrusted_options(header["options"])
    if dropped:
        warnings.warn(
            f"Inductor engine from an untrusted package: its header's settings {dropped} are not used "
            "(an untrusted engine is compiled with this process's own toolchain settings and only "
            "kiln's list of tuning switches); sign packages and verify them (KILN_SIGNING_PUBLIC_KEY) "
            "to keep them",
            stacklevel=3,
        )
    return options


def untrusted_options(options: Any) -> tuple[dict[str, Any], list[str]]:
    """(the options an untrusted engine is compiled with, the settings of its header left out).

    Only :data:`UNTRUSTED_COMPILE_OPTIONS` with values of their type and range, and a mode of
    :data:`MODES`; everything else the header asks for is left out (see the module docstring)."""
    options = options if isinstance(options, Mapping) else {}
    dropped = [] if isinstance(options, Mapping) else ["options"]
    mode = options.get("mode", "default")
    if mode not in MODES:
        dropped.append(f"mode={_shown(mode)}")
        mode = "default"
    requested = options.get("compile_options") or {}
    if not isinstance(requested, Mapping):
        dropped.append("compile_options")
        requested = {}
    kept = {}
    for key, value in requested.items():
        check = UNTRUSTED_COMPILE_OPTIONS.get(key) if isinstance(key, str) else None
        if check is not None and check(value):
            kept[key] = value
        else:
            dropped.append(f"{_shown(key)}={_shown(value)}")
    return {"mode": mode, "compile_options": dict(sorted(kept.items()))}, dropped


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


def inductor_config(options: Mapping[str, Any], *, frozen: bool = False) -> dict[str, Any]:
    """Inductor config for a compile: the mode's settings, then the compile_options over them; with
    ``frozen`` (int8 programs), freezing on: the program's constants folded in, weights prepacked."""
    mode = options.get("mode", "default")
    from_mode = torch._inductor.list_mode_options(mode) if mode != "default" else {}
    return {
        **from_mode,
        **dict(options.get("compile_options") or {}),
        **({"freezing": True} if frozen else {}),
    }


_WEIGHT = re.compile(r"^w\d{1,9}$")
_DIM_LIMIT = 1 << 40


_VERSION = re.compile(r"\d{1,4}(\.\d{1,4}){2}")


def check_header(header: Mapping[str, Any]) -> None:
    """UnsafeEngineError unless every header field a load acts on has its type (read before use, so a
    tampered header is a typed refusal, never a crash inside the backend)."""

    def bad(field: str, expected: str) -> UnsafeEngineError:
        return UnsafeEngineError(
            f"Inductor engine header field {field!r} is {_shown(header.get(field))}; expected {expected}"
        )

    for field in ("torch", "library", "device", "compiler", "precision"):
        if not isinstance(header.get(field), str):
            raise bad(field, "a string")
    index = header.get("device_index")
    if index is not None and not _int_in(0, 1024)(index):
        raise bad("device_index", "null or a device index")
    if not isinstance(header.get("stripped"), bool):
        raise bad("stripped", "true or false")
    if not isinstance(header.get("options"), Mapping):
        raise bad("options", "a mapping")
    weights = header.get("weights")
    if not isinstance(weights, Mapping):
        raise bad("weights", "a mapping of w<N> to [shape, dtype]")
    for name, entry in weights.items():
        ok = isinstance(name, str) and _WEIGHT.match(name) and isinstance(entry, list) and len(entry) == 2
        if ok:
            shape, dtype = entry
            ok = (
                isinstance(shape, list)
                and len(shape) <= 16
                and all(_int_in(0, _DIM_LIMIT)(d) for d in shape)
                and isinstance(dtype, str)
                and dtype in DTYPES
            )
        if not ok:
            raise bad("weights", f"w<N>: [shape, dtype] entries (dtype one of {sorted(DTYPES)})")
    constants = header.get("constants")
    if not isinstance(constants, list) or not all(_int_in(0, 1 << 20)(c) for c in constants):
        raise bad("constants", "a list of input positions")
    if not isinstance(header.get("frozen", False), bool):
        raise bad("frozen", "true or false")
    for field in ("aot", "aot_skipped"):  # the AOTInductor package's compiler, or why there is none
        if field in header and not isinstance(header[field], str):
            raise bad(field, "a string")
    runtime = header.get("aot_libstdcxx")  # the C++ runtime the package's wrapper was compiled against
    if runtime is not None and not (isinstance(runtime, str) and _VERSION.fullmatch(runtime)):
        raise bad("aot_libstdcxx", "a libstdc++ version such as 6.0.30")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
