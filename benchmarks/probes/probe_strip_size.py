"""Probe on a GPU machine (not a test): what the fixed part of a weight-stripped TensorRT-RTX engine
is made of, and which build settings shrink it. Run from the project root with TensorRT-RTX
importable; writes JSON to the path given (default strip_probe.json).

For a few zoo partitions it builds stripped (and full) engines under several settings: the
portable default targets vs one compute capability, builder optimization levels, and the flags
that govern kernel code in the plan. Per plan it records the bytes, how many embedded ELF
(cubin) images and PTX modules it holds, and how well it compresses (zlib, lzma).
"""

from __future__ import annotations

import json
import lzma
import sys
import time
import traceback
import zlib

import compiler
from compiler.backends.base import BuildSettings
from compiler.backends.tensorrt.build_settings import builder_flag_names, optimization_profile
from compiler.backends.tensorrt.builder import TensorRTBackend
from compiler.backends.tensorrt.onnx_rewrites import canonical_initializers
from compiler.engine_build.lower import lower
from zoo import models as zoo

CASES = {
    "tiny_bert": (zoo.tiny_bert, None),
    "tiny_resnet": (zoo.tiny_resnet, None),
    "bert_encoder_768": (lambda: zoo.bert_encoder(num_layers=2, hidden=768), None),
    "tiny_bert_block": (zoo.tiny_bert, "auto"),
}


def content(plan: bytes) -> dict:
    return {
        "bytes": len(plan),
        "elf_images": plan.count(b"\x7fELF"),
        "ptx_modules": plan.count(b".version ") if b".target sm_" in plan else 0,
        "zlib9": len(zlib.compress(plan, 9)),
        "lzma": len(lzma.compress(plan, preset=6)),
    }


def build(be: TensorRTBackend, lowered, settings: BuildSettings, variant: dict) -> dict:
    """One build with ``variant`` applied on top of what TensorRTBackend.build sets."""
    import onnx

    trt = be.trt
    model = onnx.load_model_from_string(lowered.onnx)
    weights = canonical_initializers(model)
    logger, builder, network, _parser = be._parsed(lowered.onnx, lowered.io, "probe")
    config = builder.create_builder_config()
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in optimization_profile(lowered.io).items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    flags = builder_flag_names(settings)
    for flag in flags:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    if "REFIT_INDIVIDUAL" in flags:
        for name in weights:
            network.mark_weights_refittable(name)
    for flag in variant.get("flags", ()):
        config.set_flag(getattr(trt.BuilderFlag, flag))
    if "level" in variant:
        config.builder_optimization_level = variant["level"]
    if "tiling" in variant:
        config.tiling_optimization_level = getattr(trt.TilingOptimizationLevel, variant["tiling"])
    if "cc" in variant:
        config.num_compute_capabilities = 1
        config.set_compute_capability(getattr(trt.ComputeCapability, variant["cc"]), 0)
    t0 = time.perf_counter()
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        return {"error": "; ".join(logger.errors())[:1500]}
    out = content(bytes(memoryview(plan)))
    out["seconds"] = round(time.perf_counter() - t0, 3)
    return out


VARIANTS = {
    "default": {},
    "sm_89": {"cc": "SM89"},
    "sm_86": {"cc": "SM86"},
    "sm_120": {"cc": "SM120"},
    "level0": {"level": 0},
    "level1": {"level": 1},
    "level5": {"level": 5},
    "no_compilation_cache": {"flags": ("DISABLE_COMPILATION_CACHE",)},
    "sm_89_level0": {"cc": "SM89", "level": 0},
}


def main(out_path: str) -> None:
    be = TensorRTBackend("tensorrt-rtx")
    trt = be.trt
    res: dict = {
        "library": be.library_version(),
        "builder_flags": sorted(m for m in dir(trt.BuilderFlag) if m.isupper()),
        "config_attrs": sorted(a for a in dir(trt.IBuilderConfig) if not a.startswith("_")),
        "cases": {},
    }
    for case_name, (factory, split) in CASES.items():
        case = factory()
        program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
        options = compiler.CompileOptions(backend="tensorrt-rtx", split_modules=split)
        plan = compiler.partition(program, options)
        dedup = compiler.dedup(plan)
        fp = max(dedup.fingerprints, key=lambda f: len(lower(plan, dedup, f).onnx))
        lowered = lower(plan, dedup, fp)
        entry: dict = {"fingerprint": fp, "partitions": len(plan.partitions), "unique": len(dedup.unique)}
        for variant_name, variant in VARIANTS.items():
            for strip in (True, False):
                if not strip and variant_name not in ("default", "sm_89", "level0", "sm_89_level0"):
                    continue
                key = f"{variant_name}/{'stripped' if strip else 'full'}"
                try:
                    entry[key] = build(be, lowered, BuildSettings(strip_weights=strip), variant)
                except Exception as exc:
                    entry[key] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
                print(case_name, key, entry[key], flush=True)
        res["cases"][case_name] = entry
        with open(out_path, "w") as fh:
            json.dump(res, fh, indent=1, default=str)
    print("done")


if __name__ == "__main__":
    try:
        main(sys.argv[1] if len(sys.argv) > 1 else "strip_probe.json")
    except Exception:
        traceback.print_exc()
        raise
