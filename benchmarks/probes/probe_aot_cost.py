"""Probe (issue 34): where a GPU package's compile and cold start go, per phase, on a GPT-2-class model.

Each phase runs in a fresh process with its own Inductor/Triton cache directories (empty unless the
phase says it reuses an earlier one), and reports its seconds by step: the standalone compile
(``ProgramGraph.compile``), AOTInductor's lowering and C++ build (``aoti_compile_and_package``), the
fresh-process check of the package, and every external command (compiler, linker) Inductor ran, with its
seconds. Load phases report ``compiler.load`` and the first call, and a cProfile of the load.

    python3 benchmarks/probes/probe_aot_cost.py OUT_DIR [--layers 12] [--hidden 768]

Writes OUT_DIR/aot_cost.json (and OUT_DIR/*.prof.txt).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PHASE = r"""
import json, os, sys, time, subprocess, functools
t0 = time.perf_counter()
import torch
import_torch_s = time.perf_counter() - t0
phase, out, layers, hidden = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
steps, commands = {}, []

def timed(owner, name, label):
    original = getattr(owner, name)
    @functools.wraps(original)
    def wrapper(*a, **k):
        start = time.perf_counter()
        try:
            return original(*a, **k)
        finally:
            steps[label] = round(steps.get(label, 0.0) + time.perf_counter() - start, 3)
    setattr(owner, name, wrapper)

for fn in ("run", "check_output", "check_call"):
    original = getattr(subprocess, fn)
    def make(original, fn):
        def wrapper(cmd, *a, **k):
            start = time.perf_counter()
            try:
                return original(cmd, *a, **k)
            finally:
                shown = cmd if isinstance(cmd, str) else " ".join(map(str, cmd))
                commands.append({"via": fn, "s": round(time.perf_counter() - start, 3), "cmd": shown[:300]})
        return wrapper
    setattr(subprocess, fn, make(original, fn))

import compiler
from compiler.backends.inductor import aot as inductor_aot, graph as inductor_graph
timed(inductor_graph.ProgramGraph, "compile", "standalone_compile_s")
timed(inductor_graph.ProgramGraph, "compile_static", "static_compile_s")
timed(torch._inductor, "aoti_compile_and_package", "aoti_compile_and_package_s")
timed(inductor_aot, "_check_in_fresh_process", "aot_fresh_process_check_s")
result = {"phase": phase, "import_torch_s": round(import_torch_s, 3)}

def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    config = GPT2Config(n_layer=layers, n_embd=hidden, n_head=hidden // 64, attn_implementation="sdpa")
    model = GPT2LMHeadModel(config).eval().cuda()
    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__(); self.m = m
        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits
    return Logits(model).eval()

ids = torch.randint(0, 50257, (4, 128), device="cuda")
if phase.startswith("compile"):
    from torch.export import Dim
    model = gpt2()
    start = time.perf_counter()
    program = compiler.export(model, (ids,), dynamic_shapes=({0: Dim("batch", min=1, max=8)},))
    result["export_s"] = round(time.perf_counter() - start, 3)
    aot = phase != "compile_default"
    start = time.perf_counter()
    module = compiler.compile(program, backend="inductor", device="cuda", precision="fp16", cache=False,
                              backend_options={"aot": True} if aot else {})
    result["compile_s"] = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    compiler.save(module, os.path.join(out, phase.removeprefix("compile_") + ".kiln"))
    result["save_s"] = round(time.perf_counter() - start, 3)
    result["partitions"] = len(module.report.partitions)
else:  # load_<package>_<trusted|untrusted>
    import cProfile, io, pstats
    _, package, trust = phase.split("_", 2)
    profiler = cProfile.Profile()
    profiler.enable()
    start = time.perf_counter()
    loaded = compiler.load(os.path.join(out, package + ".kiln"), trust_engine_code=trust == "trusted")
    result["load_s"] = round(time.perf_counter() - start, 3)
    start = time.perf_counter()
    with torch.no_grad():
        loaded(ids)
    torch.cuda.synchronize()
    result["first_call_s"] = round(time.perf_counter() - start, 3)
    profiler.disable()
    result["load_seconds"] = {k: round(v, 3) for k, v in dict(loaded.load_seconds).items()}
    result["dispatch"] = sorted(set(map(str, loaded.last_dispatch().values())))
    result["inductor_compiler_imported"] = "torch._inductor.compile_fx" in sys.modules
    result["triton_imported"] = "triton" in sys.modules
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(40)
    open(os.path.join(out, phase + ".prof.txt"), "w").write(text.getvalue())
result["steps"] = steps
result["commands"] = sorted(commands, key=lambda c: -c["s"])[:15]
result["commands_total_s"] = round(sum(c["s"] for c in commands), 3)
result["process_s"] = round(time.perf_counter() - t0, 3)
print("RESULT " + json.dumps(result), flush=True)
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument(
        "--phases",
        default="compile_default,compile_aot,compile_aotwarm,load_default_trusted,load_aot_trusted,"
        "load_default_untrusted",
    )
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"gpu": None, "phases": []}
    for phase in args.phases.split(","):
        # compile_aotwarm reuses compile_aot's caches: what a second compile on this machine pays
        cache = out / "caches" / ("compile_aot" if phase == "compile_aotwarm" else phase)
        env = {
            **os.environ,
            "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}",
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "TRITON_CACHE_DIR": str(cache / "triton"),
            "KILN_CACHE_DIR": str(cache / "kiln"),
        }
        start = time.perf_counter()
        done = subprocess.run(
            [sys.executable, "-c", PHASE, phase, str(out), str(args.layers), str(args.hidden)],
            capture_output=True,
            text=True,
            env=env,
            timeout=560,
        )
        wall = round(time.perf_counter() - start, 2)
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        row = json.loads(lines[-1][7:]) if lines else {"phase": phase, "error": done.stderr[-2500:]}
        row["wall_s"] = wall
        report["phases"].append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "commands"}), flush=True)
        (out / "aot_cost.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
