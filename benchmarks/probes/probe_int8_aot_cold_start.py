"""Probe (issue 19): what ``aot: true`` costs and saves for Inductor's int8 (CPU) engines on the GPU
machine's AMX host. Frozen int8 graphs cannot be saved by Inductor, so without AOT every load
compiles each engine; with AOT a trusted load runs AOTInductor's package. Measures, for BERT with
``--layers`` layers: compile seconds, package bytes, trusted load seconds and first call, each in a
fresh process. Writes probe_int8_aot_cold_start.<cpu>.json next to this file.

    python3 benchmarks/probes/probe_int8_aot_cold_start.py [--layers 2]
"""

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
import compiler  # noqa: E402
from benchmarks.quantization import bert_case, cpu_info  # noqa: E402

LOAD = """
import json, sys, time, torch
start = time.perf_counter()
import compiler
from benchmarks.quantization import bert_case
loaded = compiler.load(sys.argv[1], trust_engine_code=True)
ready = time.perf_counter()
_, kwargs, *_ = bert_case({layers})
with torch.no_grad():
    loaded(**kwargs)
done = time.perf_counter()
print(json.dumps({{"load_s": ready - start, "first_call_s": done - ready,
                  "dispatch": sorted(set(loaded.last_dispatch().values()))}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    model, kwargs, shapes, split, inputs, sample_batch = bert_case(args.layers)
    program = compiler.export(model, (), kwargs, dynamic_shapes=shapes)
    recorded = inputs(16, sample_batch, torch.Generator().manual_seed(1))
    result: dict = {"cpu": cpu_info(), "torch": torch.__version__, "layers": args.layers, "variants": {}}
    with tempfile.TemporaryDirectory(prefix="kiln-aot-probe-") as tmp:
        for name, backend_options in (("int8", {}), ("int8 aot", {"aot": True})):
            options = compiler.CompileOptions(
                backend="inductor",
                precision="int8",
                split_modules=split,
                calibration={"samples": 16},
                backend_options=backend_options,
            )
            start = time.perf_counter()
            compiled = compiler.compile(program, options, cache=False, calibration_data=recorded)
            seconds = time.perf_counter() - start
            path = Path(tmp) / f"{name.replace(' ', '-')}.kiln"
            package = compiler.save(compiled, path)
            run = subprocess.run(
                [sys.executable, "-c", LOAD.format(layers=args.layers), str(path)],
                cwd=ROOT,
                capture_output=True,
                text=True,
                check=True,
            )
            row = {
                "compile_s": round(seconds, 1),
                "engines": compiled.report.unique_fingerprints,
                "package_bytes": package.bytes,
                **json.loads(run.stdout.strip().splitlines()[-1]),
            }
            result["variants"][name] = row
            print(name, row, flush=True)
            # after each variant: a call cut off by its time limit still leaves what it measured
            cpu = "amx" if "amx" in json.dumps(result["cpu"]).lower() else "cpu"
            out = Path(__file__).parent / f"probe_int8_aot_cold_start.{cpu}.{args.layers}layers.json"
            out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
