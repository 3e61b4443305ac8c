"""Cold start (issue 20 item 3): a saved package's load to first answer in a fresh process on the GPU.

Three fresh processes load one package: trusted (its compiled graphs run as stored), untrusted (every
engine compiled here from its program) and untrusted again on the same machine (the engines the first
untrusted load compiled are in the local engine cache). Each starts with empty Inductor and engine caches
except the last, which shares the first untrusted load's. Each reports its imports, ``compiler.load``,
first call (with CUDA graphs: warm-up and capture) and a second call; a fourth, trusted, process runs
under cProfile to show where the load's seconds go. Used by ``benchmarks/gpu_runtime.py --cold-start``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import compiler

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import json, os, sys, time, warnings
start = time.perf_counter()
import torch
torch_s = time.perf_counter() - start
import compiler, zoo.models  # zoo.models: the fallback model's custom op
import transformers.modeling_outputs  # the zoo's transformer output types (trusted code here)
imports_s = time.perf_counter() - start
package, inputs, trusted, profile, device = sys.argv[1], sys.argv[2], sys.argv[3] == "1", *sys.argv[4:]
data = torch.load(inputs)
args = [a.to(device) for a in data["args"]]
kwargs = {k: v.to(device) for k, v in data["kwargs"].items()}
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
if profile:
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    t = time.perf_counter()
    module = compiler.load(package, trust_engine_code=trusted)
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    with torch.no_grad():
        module(*args, **kwargs)
    sync()
    first_s = time.perf_counter() - t
if profile:
    profiler.disable()
    import io, pstats
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(45)
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(25)
    open(profile, "w").write(text.getvalue())
t = time.perf_counter()
with torch.no_grad():
    module(*args, **kwargs)
sync()
second_ms = (time.perf_counter() - t) * 1e3
compiles = sum("compiling it from its program" in str(w.message) for w in caught)
dispatch = sorted(set(map(str, module.last_dispatch().values())))
# An engine whose native package may not run here starts building this machine's own in the background
# (compiler.backends.inductor.native): wait for it, so that the next load finds it (not load time).
t = time.perf_counter()
native = [b.wait(900) for b in module.native_builds()]
native_wait_s = time.perf_counter() - t
print(json.dumps({
    "import_torch_s": round(torch_s, 3), "imports_s": round(imports_s, 3), "load_s": round(load_s, 3),
    "first_call_s": round(first_s, 3), "load_to_first_answer_s": round(load_s + first_s, 3),
    "second_call_ms": round(second_ms, 3), "engines_compiled_at_load": compiles, "dispatch": dispatch,
    "native_builds_exit": native, "native_build_wait_s": round(native_wait_s, 3),
    "inductor_compiler_imported": "torch._inductor.compile_fx" in sys.modules,
    "load_stages_s": module.load_seconds,
    "cuda_graphs": module.cuda_graphs.to_dict(),
}))
"""


def _child(package: Path, inputs: Path, trusted: bool, caches: Path, device: str, profile: str = "") -> dict:
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
        "KILN_CACHE_DIR": str(caches / "engines"),
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    for name in [n for n in env if n.startswith("KILN_SIGNING_")]:  # trust is the child's argument only
        del env[name]
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a deployed host has its modules' .pyc
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(package), str(inputs), "1" if trusted else "0", profile, device],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
    )
    if done.returncode != 0:
        return {"error": done.stderr[-3000:]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = round(time.perf_counter() - start, 3)
    return result


RUNS = ("trusted", "untrusted_first", "untrusted_second", "trusted_second", "trusted_profiled")


def load_to_first_answer(
    module: compiler.CompiledModule, case, out_dir: Path, device: str, runs: tuple[str, ...] = RUNS
) -> dict:
    """The loads' seconds from ``compiler.load`` to the first answer, with their breakdowns; ``runs``
    picks which (in RUNS' order; ``untrusted_second`` needs ``untrusted_first``)."""
    scratch = Path(tempfile.mkdtemp(prefix="kiln-cold-"))
    package, inputs = scratch / "model.kiln", scratch / "inputs.pt"
    compiler.save(module, package)
    torch.save(
        {
            "args": [a.cpu() for a in case.args],
            "kwargs": {k: v.cpu() for k, v in case.kwargs.items()},
        },
        inputs,
    )
    # Once, untimed: the modules a load imports get their .pyc written, as on a deployed host.
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import compiler.package.save_load, compiler.backends.inductor.backend, "
            "torch._inductor.compile_fx, "
            "zoo.models, transformers.modeling_outputs",
        ],
        env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
        cwd=ROOT,
        check=False,
        timeout=300,
    )
    profile = out_dir / "cold_start_profile.txt"
    plan = {
        "trusted": (True, "trusted", ""),
        "untrusted_first": (False, "untrusted", ""),
        "untrusted_second": (False, "untrusted", ""),
        # The trusted load once more on the caches the first left (Inductor's kernels, the engine cache).
        "trusted_second": (True, "trusted", ""),
        "trusted_profiled": (True, "profiled", str(profile)),
    }
    measured = {}
    for name in (r for r in RUNS if r in runs):
        trusted, caches, profile_to = plan[name]
        measured[name] = _child(package, inputs, trusted, scratch / caches, device, profile_to)
    return {
        **{
            name: measured[name].get("load_to_first_answer_s")
            for name in ("trusted", "untrusted_first", "untrusted_second", "trusted_second")
            if name in measured
        },
        "package": f"{module.report.backend} {module.report.precision}, {len(module.report.partitions)} "
        "partitions",
        "runs": measured,
        "profile": str(profile.name) if "trusted_profiled" in measured else None,
    }
