"""Probe: where ResNet-50's int8 time goes on ONNX Runtime (why static int8 is no faster than fp32
on the GPU machine's AMX/VNNI host, while it is 0.53x on the 2-core AVX2 CI machine).

Builds ResNet-50 (transformers config, random weights) fp32 and static int8 through kiln, then runs
each engine's ONNX graph in ONNX Runtime with profiling on, at 4 and all threads and two optimization
levels, and sums kernel time per op type. Writes $OUT/probe_resnet_int8.json (or argv[1]).

    python3 benchmarks/probes/probe_resnet_int8.py [OUT.json]
"""

from __future__ import annotations

import collections
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import onnxruntime as ort
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import compiler
from benchmarks.quantization import cpu_info, resnet50_case


def profile(model: bytes, feed: dict, threads: int, level: str, runs: int = 20) -> dict:
    options = ort.SessionOptions()
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    options.intra_op_num_threads = threads
    options.log_severity_level = 3
    with tempfile.TemporaryDirectory() as tmp:
        options.enable_profiling = True
        options.profile_file_prefix = str(Path(tmp) / "p")
        session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        for _ in range(3):
            session.run(None, feed)
        start = time.perf_counter()
        for _ in range(runs):
            session.run(None, feed)
        ms = (time.perf_counter() - start) / runs * 1e3
        trace = json.loads(Path(session.end_profiling()).read_text())
    by_op: dict[str, float] = collections.defaultdict(float)
    counts: dict[str, int] = collections.defaultdict(int)
    for event in trace:
        if event.get("cat") == "Node" and event["name"].endswith("_kernel_time"):
            op = event["args"].get("op_name", "?")
            by_op[op] += event["dur"] / 1e3 / (runs + 3)
            counts[op] += 1
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:12]
    return {
        "ms_per_run_profiled": round(ms, 3),
        "kernel_ms_by_op": {k: round(v, 3) for k, v in top},
        "nodes_by_op": {k: counts[k] // (runs + 3) for k, _ in top},
    }


def main() -> None:
    default = Path(os.environ.get("OUT", ".")) / "probe_resnet_int8.json"
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else default
    model, example, shapes, _, inputs, _ = resnet50_case()
    program = compiler.export(model, (), example, dynamic_shapes=shapes)
    generator = torch.Generator().manual_seed(1)
    recorded = inputs(16, 1, generator)
    results: dict = {"cpu": cpu_info(), "onnxruntime": ort.__version__, "platform": platform.platform()}
    engines = {}
    for name, settings in (("fp32", {}), ("int8", {"precision": "int8"})):
        options = compiler.CompileOptions(calibration={"samples": 16}, **settings)
        compiled = compiler.compile(program, options, cache=False, calibration_data=recorded)
        (artifact,) = [a for a in compiled.engines.values() if a.is_engine]
        engines[name] = artifact
    for batch in (1, 8):
        x = torch.randn(batch, 3, 224, 224).numpy()
        for name, artifact in engines.items():
            feed = {artifact.io.inputs[0].name: x}
            for threads in (4, os.cpu_count() or 1):
                for level in ("ORT_ENABLE_ALL", "ORT_ENABLE_EXTENDED"):
                    key = f"{name} b{batch} t{threads} {level}"
                    results[key] = profile(artifact.engine, feed, threads, level)
                    print(key, results[key]["ms_per_run_profiled"], flush=True)
    out.write_text(json.dumps(results, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()
