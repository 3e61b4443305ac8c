"""Probe on the GPU machine (not a test): can an Inductor engine's own program (activations, then its
weights as inputs) become an AOTInductor package that loads in a fresh process with no preload, and
how fast does it load and answer (issue 20 item 3, cold start)?

Builds BERT-base fp16 (whole graph) with kiln's Inductor backend, takes the engine's program and
weights, compiles the program with ``aoti_compile_and_package`` under each C++ compiler given, and
loads each package in a fresh process through ``torch._C._aoti.AOTIModelPackageLoader`` alone
(no ``torch._inductor`` import), comparing its answer with the standalone engine's. Each step runs in
its own process (a segfault must not end the probe); which libstdc++ each process and each compiler
uses is recorded. Writes JSON to the path given.

    python3 benchmarks/probes/probe_aoti_engine.py $OUT/probe_aoti_engine.json [CXX ...]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = Path(os.environ.get("PROBE_WORK") or tempfile.mkdtemp(prefix="kiln-aoti-engine-"))

BUILD = r"""
import io, json, sys, time, zipfile
import torch
sys.path.insert(0, sys.argv[2])
import compiler
from benchmarks.gpu_runtime import bert_base
from compiler.device import to_device
work = sys.argv[1]
import os
from zoo import models as zoo
device = os.environ.get("PROBE_DEVICE", "cuda")
case = bert_base() if device == "cuda" else zoo.tiny_bert(num_layers=1, hidden=32, seq_len=8)
model, args, kwargs = to_device(case.model, case.args, case.kwargs, device=device)
program = compiler.export(model, args, kwargs, dynamic_shapes=case.dynamic_shapes)
t = time.perf_counter()
precision = "fp16" if device == "cuda" else "fp32"
module = compiler.compile(
    program, backend="inductor", device=device, precision=precision, cache=False, cuda_graphs="off"
)
build_s = time.perf_counter() - t
(artifact,) = [a for a in module.engines.values() if a.engine]
files = zipfile.ZipFile(io.BytesIO(artifact.engine))
open(work + "/program.pt2", "wb").write(files.read("program.pt2"))
open(work + "/weights.safetensors", "wb").write(files.read("weights.safetensors"))
header = json.loads(files.read("kiln_inductor_engine.json"))
# The engine's activations at batch 2 and its reference answer (the standalone graph's).
from compiler.backends.inductor.graph import example_inputs
acts = example_inputs(artifact.io, torch.device(device))
acts = [a if a.is_floating_point() else torch.randint(0, 2, a.shape, device=device) for a in acts]
from compiler.backends import get_backend
backend = get_backend("inductor", device)
loaded = backend.load(artifact.engine, artifact.io, None)
with torch.no_grad():
    ref = loaded(*acts)
torch.save({"acts": [a.cpu() for a in acts], "ref": [r.cpu() for r in ref]}, work + "/ref.pt")
print(json.dumps({"kiln_build_s": round(build_s, 2), "constants": header["constants"],
                  "weights": len(header["weights"]), "io": [list(s.opt_shape) for s in artifact.io.inputs]}))
"""

AOTI = r"""
import json, sys, time, os
import torch
work, cxx, opt, tag = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
from safetensors.torch import load_file
ep = torch.export.load(work + "/program.pt2")
weights = load_file(work + "/weights.safetensors", device="cuda")
acts = [a.cuda() for a in torch.load(work + "/ref.pt")["acts"]]
ep.example_inputs = (tuple(acts + [weights[n] for n in sorted(weights, key=lambda n: int(n[1:]))]), {})
t = time.perf_counter()
configs = {"cpp.cxx": (None, cxx), "aot_inductor.compile_wrapper_opt_level": opt}
path = torch._inductor.aoti_compile_and_package(
    ep, package_path=f"{work}/{tag}.pt2", inductor_configs=configs
)
print(json.dumps({"compile_s": round(time.perf_counter() - t, 2), "bytes": os.path.getsize(path)}))
"""

LOAD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
import_s = time.perf_counter() - t0
from safetensors.torch import load_file
work, tag = sys.argv[1], sys.argv[2]
data = torch.load(work + "/ref.pt")
weights = load_file(work + "/weights.safetensors", device="cuda")
names = sorted(weights, key=lambda n: int(n[1:]))
acts = [a.cuda() for a in data["acts"]]
torch.cuda.synchronize()
t = time.perf_counter()
loader = torch._C._aoti.AOTIModelPackageLoader(f"{work}/{tag}.pt2", "model", True, 1, 0)
load_s = time.perf_counter() - t
flat = acts + [weights[n] for n in names]
t = time.perf_counter()
with torch.no_grad():
    out = loader.run(flat)
torch.cuda.synchronize()
first_s = time.perf_counter() - t
err = max(float((o.float().cpu() - r.float()).abs().max()) for o, r in zip(out, data["ref"]))
times = []
for _ in range(30):
    t = time.perf_counter(); loader.run(flat); torch.cuda.synchronize(); times.append(time.perf_counter() - t)
graph_ok = None
try:
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        loader.run(flat)
    torch.cuda.current_stream().wait_stream(stream)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        captured = loader.run(flat)
    g.replay(); torch.cuda.synchronize()
    graph_ok = max(float((o.float().cpu() - r.float()).abs().max()) for o, r in zip(captured, data["ref"]))
except Exception as exc:
    graph_ok = f"{type(exc).__name__}: {exc}"[:300]
maps = open("/proc/self/maps").read()
stdcpp = sorted({l.split()[-1] for l in maps.splitlines() if "libstdc++" in l})
print(json.dumps({"import_torch_s": round(import_s, 3), "loader_s": round(load_s, 3),
                  "first_call_s": round(first_s, 4), "median_call_ms": round(sorted(times)[15] * 1e3, 3),
                  "max_abs_vs_standalone": err, "cuda_graph": graph_ok, "libstdcxx_loaded": stdcpp,
                  "inductor_imported": "torch._inductor" in sys.modules,
                  "triton_imported": "triton" in sys.modules}))
"""


def step(name: str, code: str, *argv: str, env: dict | None = None, timeout: int = 400) -> dict:
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return {"step": name, "rc": "timeout", "wall": round(time.perf_counter() - start, 1)}
    result = {"step": name, "rc": done.returncode, "wall": round(time.perf_counter() - start, 1)}
    lines = done.stdout.strip().splitlines()
    if done.returncode == 0 and lines:
        result.update(json.loads(lines[-1]))
    else:
        result["stderr_tail"] = done.stderr[-1500:]
    print(json.dumps(result), flush=True)
    return result


def libstdcxx(cxx: str) -> str:
    try:
        found = subprocess.run([cxx, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True)
        return os.path.realpath(found.stdout.strip())
    except OSError as exc:
        return f"missing: {exc}"


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "probe_aoti_engine.json")
    compilers = sys.argv[2:] or ["/usr/bin/g++"]
    results: dict = {
        "env": {
            "CXX": os.environ.get("CXX"),
            "LD_LIBRARY_PATH": os.environ.get("LD_LIBRARY_PATH"),
            "compilers": {c: libstdcxx(c) for c in [*compilers, "/opt/gcc/bin/g++"]},
        },
        "steps": [],
    }
    env = {"TORCHINDUCTOR_CACHE_DIR": str(WORK / "inductor"), "PYTHONPATH": str(ROOT)}

    def write() -> None:
        out.write_text(json.dumps(results, indent=2))

    if not (WORK / "ref.pt").exists():
        results["steps"].append(step("build", BUILD, str(WORK), str(ROOT), env=env))
    write()
    opts = os.environ.get("PROBE_OPTS", "O1").split(",")
    for index, cxx in enumerate(compilers):
        for opt in opts:
            tag = f"aoti{index}_{opt}"
            results["steps"].append(step(f"compile {cxx} {opt}", AOTI, str(WORK), cxx, opt, tag, env=env))
            write()
            for run in ("load", "load again"):
                loaded = step(f"{run} {cxx} {opt}", LOAD, str(WORK), tag, env=env, timeout=120)
                results["steps"].append(loaded)
            write()


if __name__ == "__main__":
    main()
