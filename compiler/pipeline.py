"""compile(): the stages chained in one call. The Prefect flows chain the very same functions as tasks."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from torch.export import ExportedProgram

from compiler.cache.local import EngineCache, resolve_setting
from compiler.device import program_on, resolve
from compiler.engine_build.engine import build_engine
from compiler.inputs.data import ValidationData
from compiler.options import CompileOptions
from compiler.partitioning.dedup import dedup
from compiler.partitioning.partition import partition
from compiler.quantization.quantize import quantize
from compiler.runtime.module import CompiledModule, assemble


def compile(
    program: ExportedProgram,
    options: CompileOptions | None = None,
    *,
    cache: EngineCache | str | os.PathLike | bool | None = None,
    calibration_data: str | os.PathLike | ValidationData | None = None,
    **settings: Any,
) -> CompiledModule:
    """Partition, quantize (int8 partitions only), dedup, build (through the engine cache), refit and
    assemble; no inputs needed. ``calibration_data`` overrides ``options.calibration.data`` (e.g. a
    ``compiler.inputs.hf_data.dataset_data`` result).

    ``settings`` override fields of ``options`` (``backend="onnxruntime"``, ``precision="fp16"``,
    ``strip_weights=True``, ``min_block_size=3``, ``torch_executed_ops=("aten.gelu",)``,
    ``split_modules="auto"``, ...).
    """
    options = dataclasses.replace(options or CompileOptions(), **settings)
    engine_cache = resolve_setting(cache)  # resolved once; False where there is none (None: the default)
    # The program runs where the options say: a program exported elsewhere is moved (weights and the
    # devices its ops name); better to export on the device (compiler.device.to_device).
    program = program_on(program, resolve(options.device))
    plan = quantize(partition(program, options), calibration_data)
    unique = dedup(plan)
    engines = {fp: build_engine(plan, unique, fp, cache=engine_cache) for fp in unique.fingerprints}
    # The same cache for what a load compiles (Inductor).
    return assemble(plan, unique, engines, cache=engine_cache)
