"""Probe on the GPU machine (not a test): do AOTInductor packages load there, and how does the JIT form
(exported program + Inductor's portable cache artifacts, compiled with torch.compile at load) behave.

Issue 15 saw ``aoti_load_package`` segfault on the H100 image (torch 2.11+cu130) for CPU and CUDA
packages alike. Each step runs in its own process (a segfault must not end the probe); a crashing
load is re-run under cuda-gdb (the image has no gdb) for a native backtrace. Writes JSON to the path
given (default inductor_probe.json).

    python3 benchmarks/probes/probe_inductor_aoti.py $OUT/inductor_probe.json
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORK = Path(tempfile.mkdtemp(prefix="kiln-aoti-probe-"))

CHILD = r"""
import os, sys, time, json, io
import torch
from torch.export import Dim

class Block(torch.nn.Module):
    def __init__(self, width=256):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)
        self.norm = torch.nn.LayerNorm(width)
    def forward(self, x):
        return self.norm(x + self.fc2(torch.nn.functional.gelu(self.fc1(x))))

step, device, path = sys.argv[1], sys.argv[2], sys.argv[3]
torch.manual_seed(0)
model = Block().to(device).eval()
x = torch.randn(8, 256, device=device)
out = {}
t = time.perf_counter()
if step == "aoti_compile":
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: Dim("b", min=1, max=64)},))
    kw = {}
    if len(sys.argv) > 4 and sys.argv[4] == "stripped":
        kw["inductor_configs"] = {"aot_inductor.package_constants_in_so": False}
    torch._inductor.aoti_compile_and_package(ep, package_path=path, **kw)
    out["seconds"] = time.perf_counter() - t
    out["bytes"] = os.path.getsize(path)
elif step == "aoti_load":
    runner = torch._inductor.aoti_load_package(path)
    out["load_seconds"] = time.perf_counter() - t
    if len(sys.argv) > 4 and sys.argv[4] == "stripped":
        runner.load_constants({k: v for k, v in model.state_dict().items()}, check_full_update=False)
    y = runner(x)
    y = y[0] if isinstance(y, (list, tuple)) else y
    out["max_abs"] = float((y - model(x)).abs().max())
elif step == "jit_build":
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: Dim("b", min=1, max=64)},))
    buf = io.BytesIO(); torch.export.save(ep, buf); open(path + ".pt2", "wb").write(buf.getvalue())
    torch.compiler._cache.CacheArtifactManager.clear()
    fn = torch.compile(ep.module())
    torch._dynamo.mark_dynamic(x, 0, min=1, max=64)
    fn(x); torch.cuda.synchronize() if device != "cpu" else None
    out["compile_seconds"] = time.perf_counter() - t
    art = torch.compiler.save_cache_artifacts()
    out["artifacts"] = {k: len(v) for k, v in art[1].artifacts.items()} if art else None
    open(path + ".bin", "wb").write(art[0] if art else b"")
    out["artifact_bytes"] = len(art[0]) if art else 0
elif step in ("jit_load", "jit_cold"):
    from torch._dynamo.utils import counters
    ep = torch.export.load(path + ".pt2")
    if step == "jit_load":
        torch.compiler.load_cache_artifacts(open(path + ".bin", "rb").read())
    t = time.perf_counter()
    fn = torch.compile(ep.module())
    torch._dynamo.mark_dynamic(x, 0, min=1, max=64)
    y = fn(x); torch.cuda.synchronize() if device != "cpu" else None
    out["compile_seconds"] = time.perf_counter() - t
    out["max_abs"] = float((y - model(x)).abs().max())
    out["counters"] = {k: dict(v) for k, v in counters.items() if k in ("inductor", "aot_autograd")}
    y2 = fn(torch.randn(3, 256, device=device))
    out["batch3_shape"] = list(y2.shape)
print("RESULT " + json.dumps(out))
"""


def child(
    step: str, device: str, path: str, *extra: str, timeout: int = 240, env: dict | None = None
) -> dict:
    script = WORK / "child.py"
    script.write_text(CHILD)
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, str(script), step, device, path, *extra],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired:
        return {"rc": "timeout", "wall": round(time.perf_counter() - start, 1)}
    result: dict = {"rc": proc.returncode, "wall": round(time.perf_counter() - start, 1)}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result.update(json.loads(line[7:]))
    if proc.returncode != 0:
        result["stderr_tail"] = proc.stderr[-3000:]
    return result


def backtrace(device: str, path: str, *extra: str) -> str:
    gdb = shutil.which("cuda-gdb") or "/usr/local/cuda/bin/cuda-gdb"
    if not os.path.exists(gdb):
        return "cuda-gdb not found"
    cmd = [gdb, "-batch", "-ex", "run", "-ex", "bt 30", "--args", sys.executable, str(WORK / "child.py")]
    try:
        proc = subprocess.run(
            [*cmd, "aoti_load", device, path, *extra], capture_output=True, text=True, timeout=240
        )
    except subprocess.TimeoutExpired:
        return "cuda-gdb timed out"
    text = proc.stdout + proc.stderr
    at = text.find("SIGSEGV")
    return text[max(0, at - 1500) : at + 5000] if at >= 0 else text[-5000:]


def environment() -> dict:
    import torch

    def run(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()[:300]
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"unavailable: {exc}"

    info = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "capability": list(torch.cuda.get_device_capability(0)) if torch.cuda.is_available() else None,
        "gcc": run(["gcc", "--version"]).splitlines()[0:1],
        "cxx_env": os.environ.get("CXX"),
        "nvcc": run(["nvcc", "--version"]).splitlines()[-1:],
        "cpu_count": os.cpu_count(),
    }
    for module in ("triton", "onnx", "onnxruntime", "onnxscript", "filelock", "platformdirs", "transformers",
                   "safetensors", "ml_dtypes"):  # fmt: skip
        try:
            info[module] = __import__(module).__version__
        except Exception as exc:  # missing or broken: the probe records which
            info[module] = f"missing: {type(exc).__name__}"
    return info


def main() -> None:
    out_path = Path(sys.argv[1] if len(sys.argv) > 1 else "inductor_probe.json")
    result: dict = {"environment": environment()}
    out_path.write_text(json.dumps(result, indent=2))
    # JIT form first: it is the fallback design and must be measured whatever AOTInductor does.
    for device in ("cuda", "cpu"):
        base = str(WORK / f"jit_{device}")
        result[f"jit_build_{device}"] = child("jit_build", device, base)
        result[f"jit_load_{device}"] = child(
            "jit_load", device, base, env={"TORCHINDUCTOR_CACHE_DIR": str(WORK / f"fresh_{device}")}
        )
        result[f"jit_cold_{device}"] = child(
            "jit_cold", device, base, env={"TORCHINDUCTOR_CACHE_DIR": str(WORK / f"cold_{device}")}
        )
        out_path.write_text(json.dumps(result, indent=2))
    # AOTInductor: compile CUDA (full and stripped) and CPU packages in parallel, then load each.
    jobs = {
        "cuda": ("cuda", str(WORK / "aoti_cuda.pt2")),
        "cuda_stripped": ("cuda", str(WORK / "aoti_cuda_stripped.pt2"), "stripped"),
        "cpu": ("cpu", str(WORK / "aoti_cpu.pt2")),
    }
    script = WORK / "child.py"
    procs = {
        name: (
            time.perf_counter(),
            subprocess.Popen(
                [sys.executable, str(script), "aoti_compile", *args],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
        for name, args in jobs.items()
    }
    for name, (start, proc) in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            result[f"aoti_compile_{name}"] = {"rc": "timeout"}
            continue
        entry: dict = {"rc": proc.returncode, "wall": round(time.perf_counter() - start, 1)}
        for line in stdout.splitlines():
            if line.startswith("RESULT "):
                entry.update(json.loads(line[7:]))
        if proc.returncode:
            entry["stderr_tail"] = stderr[-3000:]
        result[f"aoti_compile_{name}"] = entry
    out_path.write_text(json.dumps(result, indent=2))
    for name, args in jobs.items():
        if result[f"aoti_compile_{name}"].get("rc") != 0:
            continue
        loaded = child("aoti_load", *args)
        result[f"aoti_load_{name}"] = loaded
        if loaded.get("rc") not in (0, "timeout") and "backtrace" not in result:
            result["backtrace"] = backtrace(*args)
        out_path.write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2)[-6000:])


if __name__ == "__main__":
    main()
