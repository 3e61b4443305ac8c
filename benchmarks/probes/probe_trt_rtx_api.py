"""Probe of the real TensorRT-RTX API on a GPU machine (not a test): what builds, what strips, what
the runtime says about this GPU, which names the Refitter sees. Run from the project root with
TensorRT-RTX importable; writes JSON to the path given (default probe.json).

Findings feed compiler/backends/tensorrt/ (builder.py: flag choice, error handling) and the final report.
"""

from __future__ import annotations

import json
import sys
import time
import traceback

import onnx
import torch
from torch import nn

from compiler.backends.base import BuildSettings, EngineIO
from compiler.backends.tensorrt.builder import TensorRTBackend
from compiler.backends.tensorrt.engine_format import decode_engine
from compiler.inputs.specs import InputSpec


class MLP(nn.Module):
    def __init__(self, width: int = 1024):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Block(nn.Module):
    """A tiny pre-norm attention block: LayerNorm, QKV, softmax attention, GELU MLP."""

    def __init__(self, d: int = 64, heads: int = 4):
        super().__init__()
        self.h, self.d = heads, d
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, self.h, d // self.h).transpose(1, 2) for t in (q, k, v))
        att = torch.softmax(q @ k.transpose(-1, -2) / (d // self.h) ** 0.5, dim=-1)
        x = x + self.proj((att @ v).transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(self.ln2(x))))


def lowered(model: nn.Module, x: torch.Tensor, dynamic: dict, optimize: bool = True) -> tuple:
    """torch.onnx export with parameters renamed to canonical w0..wN (the lowering contract)."""
    model = model.eval()
    prog = torch.onnx.export(
        model,
        (x,),
        dynamo=True,
        input_names=["x"],
        output_names=["y"],
        dynamic_shapes=(dynamic,),
        optimize=optimize,
    )
    mp = prog.model_proto
    params = {name: f"w{i}" for i, (name, _) in enumerate(model.named_parameters())}
    for init in mp.graph.initializer:
        if init.name in params:
            old, init.name = init.name, params[init.name]
            for node in mp.graph.node:
                for j, name in enumerate(node.input):
                    if name == old:
                        node.input[j] = init.name
    mp.graph.name = type(model).__name__.lower()
    return (
        mp.SerializeToString(),
        sorted({n.op_type for n in mp.graph.node}),
        [i.name for i in mp.graph.initializer],
    )


def main(out_path: str) -> None:
    res: dict = {
        "torch": torch.__version__,
        "onnx": onnx.__version__,
        "gpu": torch.cuda.get_device_name(),
        "capability": torch.cuda.get_device_capability(),
    }
    be = TensorRTBackend("tensorrt-rtx")
    trt = be.trt
    res["library"] = be.library_version()
    batch = torch.export.Dim("batch", min=1, max=8)
    mlp_spec = InputSpec("x", "float32", (1, 1024), (2, 1024), (8, 1024), {0: "batch"})
    block_spec = InputSpec("x", "float32", (1, 16, 64), (2, 16, 64), (8, 16, 64), {0: "batch"})
    cases = {
        "mlp1024": (MLP(), torch.randn(2, 1024), {0: batch}, mlp_spec, True),
        "block64": (Block(), torch.randn(2, 16, 64), {0: batch}, block_spec, True),
        "block64_unoptimized": (Block(), torch.randn(2, 16, 64), {0: batch}, block_spec, False),
    }
    res["cases"] = {}
    for name, (model, x, dyn, spec, optimize) in cases.items():
        case: dict = {}
        try:
            onnx_bytes, ops, inits = lowered(model, x, dyn, optimize)
        except Exception:
            case["export_error"] = traceback.format_exc()[-2000:]
            res["cases"][name] = case
            continue
        case.update(onnx_bytes=len(onnx_bytes), ops=ops, initializers=inits)
        io = EngineIO((spec,), ("y",), ("float32",))
        engines = {}
        for refit in ("none", "weights", "all", "identical"):
            for strip in (False, True):
                if strip and refit == "none":
                    continue
                key = f"refit={refit},strip={strip}"
                t0 = time.perf_counter()
                try:
                    eng = be.build(
                        onnx_bytes, io, BuildSettings(strip_weights=strip, options={"refit": refit})
                    )
                    engines[key] = eng
                    case[key] = {
                        "bytes": len(decode_engine(eng)[1]),
                        "seconds": round(time.perf_counter() - t0, 3),
                    }
                except Exception as exc:
                    case[key] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
        # What the runtime says on this GPU, and what the Refitter would see.
        logger = trt.Logger(trt.Logger.WARNING)
        runtime = trt.Runtime(logger)
        for key in ("refit=weights,strip=False", "refit=all,strip=True", "refit=none,strip=False"):
            if key not in engines:
                continue
            plan = bytes(decode_engine(engines[key])[1])
            info: dict = {}
            try:
                validity, diag = runtime.get_engine_validity(plan)
                info["validity"] = [validity.name, int(diag)]
            except Exception as exc:
                info["validity_error"] = repr(exc)
            eng = runtime.deserialize_cuda_engine(plan)
            info["deserialized"] = eng is not None
            if eng is not None:
                try:
                    refitter = trt.Refitter(eng, logger)
                    info["refit_all_weights"] = sorted(refitter.get_all_weights())
                    info["refit_missing"] = sorted(refitter.get_missing_weights())
                except Exception as exc:
                    info["refitter_error"] = repr(exc)
                try:
                    declared = decode_engine(engines[key])[0]["weights"]
                    params = {f"w{i}": p.detach() for i, p in enumerate(model.parameters())}
                    runner = be.load(engines[key], io, {k: v for k, v in params.items() if k in declared})
                    y = runner(x.cuda())[0]
                    info["max_abs_err"] = float((y.cpu() - model(x)).abs().max())
                except Exception as exc:
                    info["run_error"] = f"{type(exc).__name__}: {exc}"[:800]
            case["runtime " + key] = info
        try:
            be.load(engines["refit=weights,strip=False"], io, None)
            case["backend_load"] = "loaded"
        except Exception as exc:
            case["backend_load"] = f"{type(exc).__name__}: {exc}"[:800]
        res["cases"][name] = case

    # Target compute capabilities: CURRENT (sm_90 here) and an explicit RTX target.
    onnx_bytes = lowered(MLP(256), torch.randn(2, 256), {0: batch})[0]
    spec = InputSpec("x", "float32", (1, 256), (2, 256), (8, 256), {0: "batch"})
    io = EngineIO((spec,), ("y",), ("float32",))
    for ccs in (("sm_89",), ("sm_86", "sm_89", "sm_120")):
        try:
            eng = TensorRTBackend("tensorrt-rtx", compute_capabilities=ccs).build(
                onnx_bytes, io, BuildSettings()
            )
            res[f"targets {ccs}"] = len(eng)
        except Exception as exc:
            res[f"targets {ccs}"] = f"{type(exc).__name__}: {exc}"[:800]
    try:
        logger = trt.Logger(trt.Logger.WARNING)
        builder = trt.Builder(logger)
        net = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
        parser = trt.OnnxParser(net, logger)
        parser.parse(onnx_bytes)
        cfg = builder.create_builder_config()
        prof = builder.create_optimization_profile()
        prof.set_shape("x", (1, 256), (2, 256), (8, 256))
        cfg.add_optimization_profile(prof)
        cfg.num_compute_capabilities = 1
        cfg.set_compute_capability(trt.ComputeCapability.CURRENT, 0)
        plan = builder.build_serialized_network(net, cfg)
        res["targets CURRENT"] = None if plan is None else plan.nbytes
        if plan is not None:
            v, d = trt.Runtime(logger).get_engine_validity(bytes(memoryview(plan)))
            res["targets CURRENT validity"] = [v.name, int(d)]
    except Exception as exc:
        res["targets CURRENT"] = repr(exc)
    with open(out_path, "w") as fh:
        json.dump(res, fh, indent=1, default=str)
    print(json.dumps(res, indent=1, default=str)[:11000])


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "probe.json")
