"""Cold start and compile time of the default package on transformers the other benchmarks never saw
(issue 45).

Models (transformers configs, random weights, seed 0, passed to ``compiler.export`` as they are: keyword
inputs, their own output types): BERT-base (110M, encoder, input_ids + attention_mask), ViT-base (86M,
vision, pixel_values), OPT-350m (331M, decoder LM, input_ids + attention_mask), and on request
Pythia-160m (GPT-NeoX). Batch 1..8 (dynamic), sequence 128, fp16 on the GPU.

Per model, each step a fresh process with fresh Inductor / Triton / engine caches: the default compile
(an AOTInductor package per engine on CUDA) and the standalone form (``backend_options: {aot: false}``),
for the compile ratio; then loads to first answer: trusted; untrusted on a machine that never loaded it
(the graph compiled here, one repeated block at a time, serves; the child then waits, untimed, for this
machine's own native package to build in the background); untrusted again (the native package from the
engine cache). Each load process imports torch (timed apart), then times ``compiler.load`` (kiln's
modules and the model's output types, ``transformers``, are imported inside it, as in a fresh serving
process) to the first answer, with ``load_seconds`` (the stage split) and the first answer's sums
(``answer_sums``: the loads of one package agree). ``trusted_library_imported`` repeats the trusted load
in a process that imported the model's library first (a serving app that already has it). The floor: a
fresh process reads every file a load reads, hashes it and copies the weights to the device, each file
on its own thread with its read, hash and copy pipelined (a file's sha256 is one sequential stream), or
one after the other, or in 4 MiB chunks on 4 and 8 threads (what a manifest's chunk digests let a load
do) where that is faster (``floor_s``, the lowest; each is in the JSON). ``--unchunked`` repeats the
trusted loads on a copy of the package whose manifest lists no chunk digests (loads then check each
file's single sha256 stream, as before chunk digests), side by side in one run.

    PYTHONPATH=. python benchmarks/cold_start_zoo.py --models bert-base,vit-base --out $OUT/zoo_a.json
    PYTHONPATH=. python benchmarks/cold_start_zoo.py --models opt-350m --out $OUT/zoo_b.json --profile $OUT
    PYTHONPATH=. python benchmarks/cold_start_zoo.py --merge $OUT/zoo_a.json $OUT/zoo_b.json \\
        --out benchmarks/results/cold_start_zoo_h100.json
    PYTHONPATH=. python benchmarks/cold_start_zoo.py --device cpu --tiny --models bert-base --out /tmp/z.json

``--compile-repeats N``: N default/standalone compile pairs, alternating, each in fresh processes with
fresh caches; the ratio is that of the medians (``compile_pairs`` in the JSON: one pair swung 1.04-2.01
between runs on one H200). Before the models, one untimed tiny compile warms the machine
(``warm_compile_s``; ``--no-warm-compile`` leaves it out).

``--profile DIR``: a trusted load once more under cProfile (``DIR/<model>.load.pstats`` and ``.txt``) and
the compiles' Inductor phase times (``compile_times`` in the JSON). The JSON names the GPU and host CPU;
each missed target is printed (and listed under ``missed``). ``--split-modules auto`` (or class names)
compiles one engine per repeated block (``split_modules``) in every compile of the run, the JSON says so
(``split_modules``), and ``--merge`` names files of another partitioning (``split_modules_mismatch``).
Packages are saved as ``kiln zoo`` publishes them, the weights only fp16 engines read stored at fp16
(``engine_precision_weights``); ``--fp32-weights`` saves every weight at fp32, as kiln did before
(``weights`` in the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TARGETS = {"trusted_s": 1.0, "untrusted_first_s": 15.0, "untrusted_second_s": 1.0, "compile_ratio": 1.5}
DEFAULT_MODELS = ("bert-base", "vit-base", "opt-350m")
MODELS = {
    "bert-base": "BERT-base (12x768, vocab 30522), BertModel, input_ids + attention_mask",
    "vit-base": "ViT-base/16 (12x768, 224x224), ViTModel, pixel_values",
    "opt-350m": "OPT-350m (24x1024, vocab 50272), OPTForCausalLM, input_ids + attention_mask",
    "pythia-160m": "Pythia-160m (GPT-NeoX 12x768, vocab 50304), GPTNeoXForCausalLM, input_ids + mask",
}

# The child that compiles one model (also run by --tiny on the CPU): prints one JSON line.
COMPILE = r"""
import json, os, sys, time
import torch
from torch.export import Dim
import transformers as T
import compiler

name, out, aot, device = sys.argv[1], sys.argv[2], sys.argv[3] == "1", sys.argv[4]
tiny, profile = sys.argv[5] == "1", sys.argv[6] == "1"
torch.manual_seed(0)
seq = 16 if tiny else 128
small = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128)
text = True
if name == "bert-base":
    config = T.BertConfig(**(dict(small, vocab_size=1000) if tiny else {}))
    model, vocab = T.BertModel(config, add_pooling_layer=False), config.vocab_size
elif name == "vit-base":
    config = T.ViTConfig(**(dict(small, image_size=32, patch_size=8) if tiny else {}))
    model, text = T.ViTModel(config, add_pooling_layer=False), False
elif name == "opt-350m":
    opt = dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, ffn_dim=4096,
               word_embed_proj_dim=512, vocab_size=50272, max_position_embeddings=2048)
    tiny_opt = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, ffn_dim=128,
                    word_embed_proj_dim=32, vocab_size=1000)
    config = T.OPTConfig(**(tiny_opt if tiny else opt), use_cache=False)
    model, vocab = T.OPTForCausalLM(config), config.vocab_size
elif name == "pythia-160m":
    neox = dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                vocab_size=50304, rotary_pct=0.25)
    config = T.GPTNeoXConfig(**(dict(small, vocab_size=1000) if tiny else neox), use_cache=False)
    model, vocab = T.GPTNeoXForCausalLM(config), config.vocab_size
else:
    sys.exit(f"unknown model {name}")
model.config._attn_implementation = "sdpa"
model = model.eval().to(device)
batch = Dim("batch", min=1, max=8)
if text:
    ids = torch.randint(0, vocab, (4, seq), device=device)
    kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    shapes = {"input_ids": {0: batch}, "attention_mask": {0: batch}}
else:
    kwargs = {"pixel_values": torch.randn(4, 3, config.image_size, config.image_size, device=device)}
    shapes = {"pixel_values": {0: batch}}
params = sum(p.numel() for p in model.parameters())
program = compiler.export(model, (), kwargs, dynamic_shapes=shapes)
if len(sys.argv) > 7 and sys.argv[7]:  # cProfile of the compile itself (--profile-compile)
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
start = time.perf_counter()
split = os.environ.get("KILN_BENCH_SPLIT_MODULES") or None  # --split-modules
# As `kiln zoo` publishes: the weights only fp16 engines read stored at fp16 (--fp32-weights: as before)
weights_at_engine_precision = os.environ.get("KILN_BENCH_FP32_WEIGHTS") != "1"
module = compiler.compile(
    program, backend="inductor", device=device, precision="fp32" if device == "cpu" else "fp16",
    cache=False, split_modules=split if split in (None, "auto") else tuple(split.split(",")),
    **({} if aot else {"backend_options": {"aot": False}}),
)
compile_s = time.perf_counter() - start
if len(sys.argv) > 7 and sys.argv[7]:
    import io, pstats
    profiler.disable()
    profiler.dump_stats(sys.argv[7] + ".pstats")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(100)
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    open(sys.argv[7] + ".txt", "w").write(text.getvalue())
phases = None
if profile:  # Inductor's own phase timer (what the compile's seconds went to)
    try:
        from torch._dynamo.utils import compile_times
        phases = compile_times(repr="str", aggregate=True)
    except Exception as exc:
        phases = f"unavailable: {exc!r}"
compiler.save(module, out, engine_precision_weights=weights_at_engine_precision)
torch.save({"args": [], "kwargs": {k: v.cpu() for k, v in kwargs.items()}}, out + ".inputs.pt")
print(json.dumps({
    "compile_s": round(compile_s, 2), "params": params, "partitions": len(module.report.partitions),
    "build_failures": [f["error"][:500] for f in module.report.build_failures],
    "stage_seconds": module.report.stage_seconds, "compile_times": phases,
}))
"""

# A load to first answer in a fresh process: prints one JSON line.
LOAD = r"""
import json, os, sys, time, warnings
start = time.perf_counter()
import torch
torch_s = time.perf_counter() - start
package, trusted, device, profile, preimport = sys.argv[1], sys.argv[2] == "1", *sys.argv[3:6]
flat = len(sys.argv) > 6 and sys.argv[6] == "1"  # a serving backend's call: run_flat, no output type
library_s = 0.0
if preimport:  # the model's own library, imported by the app before it loads (a serving process)
    t = time.perf_counter()
    for name in preimport.split(","):
        __import__(name)
    library_s = time.perf_counter() - t
data = torch.load(package + ".inputs.pt")
args = [a.to(device) for a in data["args"]]
kwargs = {k: v.to(device) for k, v in data["kwargs"].items()}
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
before = set(sys.modules)
if profile:
    import cProfile
    profiler = cProfile.Profile()
    profiler.enable()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    t = time.perf_counter()
    import compiler  # inside the timed region: compiler.load's own imports are the load's
    module = compiler.load(
        package, trust_engine_code=trusted, allowed_modules=["transformers"], defer_output_types=flat
    )
    load_s = time.perf_counter() - t
    t = time.perf_counter()
    with torch.no_grad():
        if flat:
            answer = module.run_flat([*args, *kwargs.values()])  # the export's order: keyword inputs in order
        else:
            answer = module(*args, **kwargs)
    sync()
    first_s = time.perf_counter() - t
# The first answer's sums (per output tensor: sum, sum of |x|): loads of one package compare by them.
leaves = [x for x in torch.utils._pytree.tree_leaves(answer) if isinstance(x, torch.Tensor)]
answer_sums = [[round(float(x.float().sum()), 3), round(float(x.float().abs().sum()), 3)] for x in leaves]
# What the loaded module holds on the device once it answered (weights, engines, workspace).
memory_mb = round(torch.cuda.memory_allocated() / 2**20, 1) if device.startswith("cuda") else None
if profile:
    profiler.disable()
    import io, pstats
    profiler.dump_stats(profile + ".pstats")
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("cumulative").print_stats(80)
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(40)
    open(profile + ".txt", "w").write(text.getvalue())
t = time.perf_counter()
with torch.no_grad():  # the same call again (through forward, a flat load would import its output types)
    module.run_flat([*args, *kwargs.values()]) if flat else module(*args, **kwargs)
sync()
second_ms = (time.perf_counter() - t) * 1e3
compiles = sum("compiling" in str(w.message) for w in caught)
imported = set(sys.modules) - before
# Where a load compiled (untrusted): Inductor's own phase timer, seconds summed per phase, largest first.
timed = getattr(sys.modules.get("torch._dynamo.utils"), "compilation_time_metrics", {})
phases = sorted(((k, round(sum(v), 3)) for k, v in timed.items()), key=lambda kv: -kv[1])[:25]
t = time.perf_counter()
native = [b.wait(float(os.environ.get("KILN_BENCH_NATIVE_WAIT", "600"))) for b in module.native_builds()]
native_wait_s = time.perf_counter() - t
print(json.dumps({
    "import_torch_s": round(torch_s, 3), "import_library_before_s": round(library_s, 3),
    "load_s": round(load_s, 3), "first_call_s": round(first_s, 3),
    "load_to_first_answer_s": round(load_s + first_s, 3), "second_call_ms": round(second_ms, 3),
    "engines_compiled_at_load": compiles, "dispatch": sorted(set(map(str, module.last_dispatch().values()))),
    "native_builds_exit": native, "native_build_wait_s": round(native_wait_s, 3),
    "imported_during_load": {
        "inductor_compiler": "torch._inductor.compile_fx" in imported, "dynamo": "torch._dynamo" in imported,
        "sympy": "sympy" in imported, "transformers": "transformers" in imported,
        "triton": "triton" in imported,
    },
    "load_stages_s": module.load_seconds, "profiled": bool(profile), "device_memory_mb": memory_mb,
    "inductor_phases_s": dict(phases), "answer_sums": answer_sums,
    "warnings": sorted({str(w.message)[:300] for w in caught})[:10],
}))
"""

# The floor: what reading every file a load reads, hashing it and copying the weights to the device
# costs at best (prints one JSON line). A file's sha256 is one sequential stream, but files are
# independent and a chunk's read and copy can run while the one before it is hashed (hashlib, reads and
# the copy release the GIL): ``floor_s`` is that pipeline's wall time, each file on a thread of its own,
# the bound a load that checks every byte can reach (``pipelined_s``). ``serial_s`` is read, then hash,
# then copy, one after the other: the floor of the first runs, which a pipelined load beat (OPT-350m
# 4.3 s vs 2.9 s on the H100). ``chunked_s``: the files in 4 MiB chunks, each read, hashed and copied by
# one of 4 or 8 threads (no single stream: what chunk digests allow). ``floor_s`` is the lowest (on 2
# shared cores the pipeline's threads can cost more than they hide).
FLOOR = r"""
import hashlib, json, os, queue, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
start = time.perf_counter()
import torch
torch_s = time.perf_counter() - start
package, device = Path(sys.argv[1]), sys.argv[2]
cuda = device.startswith("cuda")
t = time.perf_counter()
if cuda:
    torch.empty(1, device=device)
    torch.cuda.synchronize()
context_s = time.perf_counter() - t
manifest = json.loads((package / "manifest.json").read_text())
files = [rel for rel in manifest["files"] if (package / rel).exists()]
CHUNK = 16 << 20

def pipelined(rel):
    # Reader (this thread) -> hasher -> copier (weights only), each stage a thread, chunks in order.
    size = (package / rel).stat().st_size
    copy = rel == "weights.safetensors"
    target = torch.empty(size, dtype=torch.uint8, device=device) if copy else None
    chunks, hashed, digest = queue.Queue(maxsize=3), queue.Queue(maxsize=3), hashlib.sha256()

    def hasher():
        while (item := chunks.get()) is not None:
            digest.update(item[1])
            if copy:
                hashed.put(item)
        hashed.put(None)

    def copier():
        while (item := hashed.get()) is not None:
            offset, buf = item
            target[offset : offset + len(buf)].copy_(torch.frombuffer(buf, dtype=torch.uint8))
        if cuda:
            torch.cuda.synchronize()

    stages = [threading.Thread(target=hasher), *([threading.Thread(target=copier)] if copy else [])]
    for stage in stages:
        stage.start()
    with open(package / rel, "rb", buffering=0) as f:
        offset = 0
        while True:
            buf = bytearray(min(CHUNK, max(size - offset, 1)))
            got = f.readinto(buf)
            if not got:
                break
            chunks.put((offset, memoryview(buf)[:got]))
            offset += got
    chunks.put(None)
    for stage in stages:
        stage.join()
    return digest.hexdigest()

t = time.perf_counter()
with ThreadPoolExecutor(max(1, len(files))) as pool:
    digests = dict(zip(files, pool.map(pipelined, files)))
floor_s = time.perf_counter() - t

def in_chunks(step, workers):
    # Every file in chunks of ``step`` on ``workers`` threads, each reading, hashing and copying its own
    # chunks (what a manifest's chunk digests let a load do: no file's sha256 is one stream then).
    jobs = []
    for rel in files:
        size = (package / rel).stat().st_size
        copy = rel == "weights.safetensors"
        target = torch.empty(size, dtype=torch.uint8, device=device) if copy else None
        jobs += [(rel, offset, min(step, size - offset), target) for offset in range(0, size, step)]
    fds = {rel: os.open(package / rel, os.O_RDONLY) for rel in files}

    def work(first):
        buf = bytearray(step)
        host = torch.frombuffer(buf, dtype=torch.uint8)
        for rel, offset, count, target in jobs[first::workers]:
            view = memoryview(buf)[:count]
            os.preadv(fds[rel], [view], offset)
            hashlib.sha256(view).hexdigest()
            if target is not None:
                target[offset : offset + count].copy_(host[:count])
        if cuda:
            torch.cuda.synchronize()

    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(work, range(workers)))
    for fd in fds.values():
        os.close(fd)

cores = len(os.sched_getaffinity(0))
chunked = {}
for workers in sorted({min(cores, 8), min(cores, 4)}):
    t = time.perf_counter()
    in_chunks(4 << 20, workers)
    chunked[workers] = round(time.perf_counter() - t, 3)
ok = all(digests[rel] == manifest["files"][rel]["sha256"] for rel in files)
t = time.perf_counter()
data = {rel: (package / rel).read_bytes() for rel in files}
read_s = time.perf_counter() - t
t = time.perf_counter()
for blob in data.values():
    hashlib.sha256(blob).hexdigest()
hash_s = time.perf_counter() - t
weights = data.get("weights.safetensors", b"")
t = time.perf_counter()
if weights:
    host = torch.frombuffer(bytearray(weights), dtype=torch.uint8)
    on_device = host.to(device)
    if cuda:
        torch.cuda.synchronize()
copy_s = time.perf_counter() - t
print(json.dumps({
    "import_torch_s": round(torch_s, 3), "device_context_s": round(context_s, 3),
    "floor_s": round(min(floor_s, read_s + hash_s + copy_s, *chunked.values()), 3), "checksums_match": ok,
    "pipelined_s": round(floor_s, 3), "serial_s": round(read_s + hash_s + copy_s, 3),
    "chunked_s": chunked,
    "read_s": round(read_s, 3), "hash_s": round(hash_s, 3), "copy_s": round(copy_s, 3),
    "bytes": sum(len(b) for b in data.values()), "weights_bytes": len(weights),
    "files": {rel: len(b) for rel, b in data.items()},
}))
"""


def _env(caches: Path | None) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if caches is not None:
        env |= {
            "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
            "TRITON_CACHE_DIR": str(caches / "triton"),
            "KILN_CACHE_DIR": str(caches / "engines"),
        }
    for name in [n for n in env if n.startswith("KILN_SIGNING_")]:  # trust is the child's argument only
        del env[name]
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # a deployed host has its modules' .pyc
    return env


def _run(script: str, argv: list[str], caches: Path | None, timeout: float, extra_env=None) -> dict:
    start = time.perf_counter()
    try:
        done = subprocess.run(
            [sys.executable, "-c", script, *argv],
            capture_output=True,
            text=True,
            env={**_env(caches), **(extra_env or {})},
            cwd=ROOT,
            timeout=max(timeout, 1),
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0:
        return {"error": done.stderr[-3000:]}
    try:
        result = json.loads(done.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        return {"error": f"no JSON line: {done.stdout[-1000:]} {done.stderr[-2000:]}"}
    result["process_s"] = round(time.perf_counter() - start, 2)
    return result


def machine(device: str) -> dict:
    from benchmarks.machine import cpu_model, gpu_machine

    if device.startswith("cuda"):
        return gpu_machine()
    import torch

    return {"gpu": None, "host_cpu": cpu_model(), "cpu_count": os.cpu_count(), "torch": torch.__version__}


def run_model(name: str, args: argparse.Namespace, scratch: Path, deadline: float) -> dict:
    """Every measurement of one model (a step past the deadline is skipped and says so)."""
    left = lambda: deadline - time.perf_counter()  # noqa: E731
    result: dict = {"model": MODELS[name] + (" (tiny config)" if args.tiny else "")}
    package = scratch / f"{name}.kiln"
    flags = [args.device, "1" if args.tiny else "0", "1" if args.profile else "0"]
    profile_dir = Path(args.profile or ".")
    compile_profile = str(profile_dir / f"{name}.compile") if args.profile_compile else ""
    result["compile_default"] = _run(
        COMPILE,
        [name, str(package), "1", *flags, compile_profile],
        scratch / f"{name}-compile-default",
        left(),
    )
    result["compile_default"]["profiled"] = bool(compile_profile)
    if "error" in result["compile_default"]:
        return result
    if not args.skip_standalone:
        result["compile_standalone"] = _run(
            COMPILE,
            [name, str(scratch / f"{name}-standalone.kiln"), "0", *flags],
            scratch / f"{name}-compile-standalone",
            left(),
        )
        # More pairs, default and standalone alternating, each in fresh processes with fresh caches: the
        # ratio of their medians (one pair swung 1.04-2.01 between runs on one machine).
        pairs = [(result["compile_default"], result["compile_standalone"])]
        for repeat in range(1, args.compile_repeats):
            pair = []
            for aot, form in (("1", "default"), ("0", "standalone")):
                if left() < 60:
                    break
                where = scratch / f"{name}-{form}-r{repeat}"
                pair.append(_run(COMPILE, [name, f"{where}.kiln", aot, *flags[:2], "0"], where, left()))
                shutil.rmtree(f"{where}.kiln", ignore_errors=True)
            if len(pair) == 2:
                pairs.append(tuple(pair))
        result["compile_pairs"] = [
            {"default_s": d.get("compile_s"), "standalone_s": a.get("compile_s")} for d, a in pairs
        ]
    result["floor"] = _run(FLOOR, [str(package), args.device], None, min(left(), 120))
    runs = {
        "trusted": ("1", "trusted", "", ""),
        # --profile-untrusted: this run itself under cProfile (its seconds then include the profiler's)
        "untrusted_first": (
            "0",
            "untrusted",
            str(profile_dir / f"{name}.untrusted") if args.profile_untrusted else "",
            "",
        ),
        "untrusted_second": ("0", "untrusted", "", ""),
        # the same, in a process that imported the model's library first (as trusted_library_imported)
        "untrusted_second_library_imported": ("0", "untrusted", "", "transformers.modeling_outputs"),
        "trusted_library_imported": ("1", "trusted-library", "", "transformers.modeling_outputs"),
    }
    flat_run = ("1", "trusted-flat", "", "")  # run_flat to first answer: the Triton backend's path
    if args.profile:
        profile = Path(args.profile) / f"{name}.load"
        runs["trusted_profiled"] = ("1", "profiled", str(profile), "")
    flat_runs = {"trusted_run_flat": (package, "flat")}
    if args.unchunked:  # the same package, its manifest without chunk digests (the sha256 stream path)
        unchunked = _unchunked_copy(package, scratch / f"{name}-unchunked.kiln")
        runs = {  # each right after its counterpart: side by side on one machine state
            key: value
            for run, spec in runs.items()
            for key, value in [(run, spec)]
            + (
                [(f"{run}_unchunked", (*spec, unchunked))]
                if run in ("trusted", "trusted_library_imported")
                else []
            )
        }
        flat_runs["trusted_run_flat_unchunked"] = (unchunked, "flat-unchunked")
    if args.loads:
        wanted = set(args.loads.split(","))
        runs = {k: v for k, v in runs.items() if k.removesuffix("_unchunked") in wanted}
        flat_runs = {k: v for k, v in flat_runs.items() if k.removesuffix("_unchunked") in wanted}
    loads = result["loads"] = {}
    for run, (trusted, caches, profile_to, preimport, *source) in runs.items():
        if left() < 20:
            loads[run] = {"error": "skipped: past the command's time budget (--budget-s)"}
            continue
        wait = {"KILN_BENCH_NATIVE_WAIT": str(max(10, int(left() - 30)))}
        loads[run] = _run(
            LOAD,
            [str(source[0] if source else package), trusted, args.device, profile_to, preimport],
            scratch / f"{name}-{caches}{'-unchunked' if source else ''}",
            left(),
            wait,
        )
    for run, (source, caches) in flat_runs.items():
        if left() >= 20:
            loads[run] = _run(
                LOAD,
                [str(source), *flat_run[:1], args.device, "", "", "1"],
                scratch / f"{name}-{caches}",
                left(),
            )
    result["summary"] = summary(result)
    return result


def _unchunked_copy(package: Path, copy: Path) -> Path:
    """A copy of ``package`` whose manifest lists no chunk digests (its content hash made to agree): a
    load of it checks each file's sha256, one stream per file."""
    from compiler.package.digest import content_hash

    shutil.copytree(package, copy)
    shutil.copy(f"{package}.inputs.pt", f"{copy}.inputs.pt")
    manifest = json.loads((copy / "manifest.json").read_text())
    for record in manifest["files"].values():
        record.pop("chunk_bytes", None)
        record.pop("chunks", None)
    manifest["content_hash"] = content_hash(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return copy


def summary(result: dict) -> dict:
    loads = result.get("loads", {})
    compile_s = result.get("compile_default", {}).get("compile_s")
    standalone = result.get("compile_standalone", {}).get("compile_s")
    pairs = [p for p in result.get("compile_pairs", []) if p["default_s"] and p["standalone_s"]]
    if len(pairs) > 1:  # --compile-repeats: the medians
        compile_s = statistics.median(p["default_s"] for p in pairs)
        standalone = statistics.median(p["standalone_s"] for p in pairs)
    return {
        "params": result.get("compile_default", {}).get("params"),
        "trusted_s": loads.get("trusted", {}).get("load_to_first_answer_s"),
        "trusted_library_imported_s": loads.get("trusted_library_imported", {}).get("load_to_first_answer_s"),
        "trusted_run_flat_s": loads.get("trusted_run_flat", {}).get("load_to_first_answer_s"),
        **{
            f"{run}_unchunked_s": loads[f"{run}_unchunked"].get("load_to_first_answer_s")
            for run in ("trusted", "trusted_library_imported", "trusted_run_flat")
            if f"{run}_unchunked" in loads
        },
        "engine_bytes": sum(
            v for k, v in result.get("floor", {}).get("files", {}).items() if k.startswith("engines/")
        ),
        "untrusted_first_s": loads.get("untrusted_first", {}).get("load_to_first_answer_s"),
        "untrusted_second_s": loads.get("untrusted_second", {}).get("load_to_first_answer_s"),
        "untrusted_second_library_imported_s": loads.get("untrusted_second_library_imported", {}).get(
            "load_to_first_answer_s"
        ),
        "background_native_build_s": loads.get("untrusted_first", {}).get("native_build_wait_s"),
        "trusted_stages_s": loads.get("trusted", {}).get("load_stages_s"),
        "import_torch_s": loads.get("trusted", {}).get("import_torch_s"),
        "floor_s": result.get("floor", {}).get("floor_s"),
        "compile_s": compile_s,
        "compile_standalone_s": standalone,
        "compile_ratio": round(compile_s / standalone, 2) if compile_s and standalone else None,
    }


def missed(models: dict) -> list[str]:
    """Each target a model misses (or could not be measured for), as a line."""
    lines = []
    for name, result in models.items():
        row = result.get("summary") or summary(result)
        for key, limit in TARGETS.items():
            value = row.get(key)
            if value is None:
                lines.append(f"{name}: {key} not measured")
            elif value > limit:
                lines.append(f"{name}: {key} {value} > {limit}")
    return lines


def report(results: dict) -> None:
    from benchmarks._common import print_table

    rows = []
    for name, result in results["models"].items():
        row = result.get("summary") or summary(result)
        rows.append(
            [
                name,
                row.get("params"),
                row.get("trusted_s"),
                row.get("trusted_library_imported_s"),
                row.get("untrusted_first_s"),
                row.get("untrusted_second_s"),
                row.get("floor_s"),
                row.get("compile_s"),
                row.get("compile_standalone_s"),
                row.get("compile_ratio"),
            ]
        )
    columns = ["model", "params", "trusted", "trusted(lib)", "untr.1st", "untr.2nd", "floor", "compile"]
    print_table("cold start, seconds", [*columns, "standalone", "ratio"], rows)
    for name, result in results["models"].items():
        stages = (result.get("summary") or {}).get("trusted_stages_s")
        print(f"{name} trusted load_seconds: {stages}")
    for line in results["missed"]:
        print(f"MISSED {line}")


def merge(paths: list[str], out: Path) -> dict:
    merged: dict = {"models": {}, "runs": []}
    for path in paths:
        part = json.loads(Path(path).read_text())
        merged.setdefault("machine", part.get("machine"))
        merged.setdefault("method", part.get("method"))
        merged.setdefault("split_modules", part.get("split_modules"))
        merged.setdefault("weights", part.get("weights", "fp32"))  # files before the flag: fp32
        if part.get("weights", "fp32") != merged["weights"]:
            merged.setdefault("weights_mismatch", []).append({path: part.get("weights", "fp32")})
        if part.get("split_modules") != merged["split_modules"]:  # one partitioning per merged file
            merged.setdefault("split_modules_mismatch", []).append({path: part.get("split_modules")})
        if part.get("machine", {}).get("gpu") != merged["machine"].get("gpu"):
            merged.setdefault("machine_mismatch", []).append({path: part.get("machine")})
        merged["models"].update(part.get("models", {}))
        merged["runs"].append({"file": Path(path).name, "models": sorted(part.get("models", {}))})
    merged["targets"] = {k: f"<= {v}" for k, v in TARGETS.items()}
    merged["missed"] = missed(merged["models"])
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"of {sorted(MODELS)}")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny configs (a CPU smoke run)")
    parser.add_argument("--profile", default="", help="folder for a profiled trusted load per model")
    parser.add_argument(
        "--profile-untrusted", action="store_true", help="run the untrusted first load under cProfile"
    )
    parser.add_argument(
        "--profile-compile", action="store_true", help="run the default compile under cProfile"
    )
    parser.add_argument(
        "--split-modules",
        default="",
        help="compile with split_modules ('auto' or class names, comma-separated): one engine per block",
    )
    parser.add_argument(
        "--fp32-weights",
        action="store_true",
        help="save every weight at fp32 (as before engine_precision_weights)",
    )
    parser.add_argument("--skip-standalone", action="store_true", help="leave out the aot: false compile")
    parser.add_argument(
        "--compile-repeats", type=int, default=1, help="default/standalone compile pairs (ratio of medians)"
    )
    parser.add_argument(
        "--no-warm-compile", action="store_true", help="skip the untimed tiny compile before the models"
    )
    parser.add_argument(
        "--loads",
        default="",
        help="only these loads (comma-separated: trusted, untrusted_first, untrusted_second, "
        "untrusted_second_library_imported, trusted_library_imported, trusted_run_flat); default all",
    )
    parser.add_argument(
        "--unchunked",
        action="store_true",
        help="repeat the trusted loads on a copy whose manifest lists no chunk digests",
    )
    parser.add_argument("--budget-s", type=float, default=500, help="steps past it are skipped")
    parser.add_argument("--merge", nargs="+", help="JSON files of earlier runs to merge into --out")
    parser.add_argument("--keep", action="store_true", help="keep the packages (scratch folder)")
    args = parser.parse_args()
    if args.split_modules:  # the compile processes read it (they inherit this environment)
        os.environ["KILN_BENCH_SPLIT_MODULES"] = args.split_modules
    if args.fp32_weights:
        os.environ["KILN_BENCH_FP32_WEIGHTS"] = "1"
    out = Path(args.out)
    if args.merge:
        results = merge(args.merge, out)
    else:
        names = [n.strip() for n in args.models.split(",") if n.strip()]
        unknown = sorted(set(names) - set(MODELS))
        if unknown:
            parser.error(f"--models: unknown {unknown}; known: {sorted(MODELS)}")
        if (args.profile_untrusted or args.profile_compile) and not args.profile:
            parser.error("--profile-untrusted and --profile-compile write into the --profile folder")
        if args.profile:
            Path(args.profile).mkdir(parents=True, exist_ok=True)
        deadline = time.perf_counter() + args.budget_s
        scratch = Path(tempfile.mkdtemp(prefix="kiln-cold-zoo-"))
        # Once, untimed: the modules a load imports get their .pyc written, as on a deployed host.
        _run("import compiler.generation.package, compiler.backends.inductor.backend", [], None, 300)
        warm = None
        if not args.no_warm_compile:
            # Once, untimed: a tiny compile, so that the machine's first (its libraries and compilers read
            # from disk, the CUDA toolchain's probes) is not the first model's default compile (BERT's
            # took 37 s as a machine's first and 26 s after).
            where = scratch / "warm"
            warm = _run(COMPILE, [names[0], f"{where}.kiln", "1", args.device, "1", "0"], where, 300)
            shutil.rmtree(f"{where}.kiln", ignore_errors=True)
        results = {
            "machine": machine(args.device),
            "method": __doc__.split("\n\n")[1].replace("\n", " ") + " " + __doc__.split("\n\n")[2],
            "device": args.device,
            "tiny": args.tiny,
            "split_modules": args.split_modules or None,
            "weights": "fp32" if args.fp32_weights else "engine precision",
            "warm_compile_s": None if warm is None else warm.get("process_s", warm.get("error", "")[-300:]),
            "compile_repeats": args.compile_repeats,
            "models": {},
        }
        for name in names:
            results["models"][name] = run_model(name, args, scratch, deadline)
            results["targets"] = {k: f"<= {v}" for k, v in TARGETS.items()}
            results["missed"] = missed(results["models"])
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(results, indent=2, sort_keys=True))
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, sort_keys=True))
    report(results)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
