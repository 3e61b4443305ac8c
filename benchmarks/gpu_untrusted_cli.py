"""Issue 45's untrusted load through the user's commands on the GPU: ``kiln zoo`` compiles an unsigned
default-form CUDA package (each engine an AOTInductor package) of a 6-layer BERT classifier and of a
4-layer Llama-style generation entry, both read from ``save_pretrained`` folders (keyword inputs); then,
on a machine whose engine cache never saw them:

1. ``kiln debug compare`` of the BERT package: its native code is not trusted, so the engine is compiled
   here from its program, one repeated block at a time, and this machine's own native package is built
   in the background (``kiln cache ls --json`` shows the build; the run waits for it);
2. ``kiln debug compare`` again: the native package from the cache serves, nothing is compiled;
3. a fresh process per step, as the generation zoo file's comment shows a user: ``compiler.load`` of the
   generation package and ``generate``, first (prefill and decode compiled here, the decode program cut
   by block), then again once the background builds are done.

Each step's exit status, seconds, warnings and (for the API loads) ``last_dispatch`` go to ``--out``.
Run on the GPU machine with the pipeline's wheels installed (benchmarks/gpu_issue41.sh wheels1/wheels2):

    PYTHONPATH=$PWD:/tmp/site python3 benchmarks/gpu_untrusted_cli.py --out $OUT/untrusted_cli.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import yaml

from tests.fixtures.generation import cuda_generation_entry  # the GPU zoo-release test's entry

ROOT = Path(__file__).resolve().parents[1]
TEXT_DIMS = [
    {"axis": 0, "name": "batch", "min": 1, "max": 8},
    {"axis": 1, "name": "seq", "min": 4, "max": 64},
]
ZOO = {
    "settings": {
        "out_dir": "out",
        "workspace": "ws",
        "engine_cache": "compile-cache",  # the compile's cache: the loads below use another one
        "tracking": False,
        "validation": {"samples": 2, "warmup": 1, "runs": 3},
    },
    "models": [
        {
            "name": "bert6",
            "source": "hf:./bert6",
            "task": "sequence-classification",
            "inputs": {k: {"dims": TEXT_DIMS} for k in ("input_ids", "attention_mask", "token_type_ids")},
            "precision": "fp16",
            "backend": "inductor",
            "devices": ["cuda"],
        },
        cuda_generation_entry("llama-gen", "hf:./llama4"),
    ],
}

# A user's own process: load the package (untrusted: it is not signed), answer once, say what served.
LOAD = textwrap.dedent(
    """
    import json, sys, time, warnings
    import torch
    import compiler

    path = sys.argv[1]
    torch.manual_seed(0)  # the same input in every process: answers compare across loads
    t = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = compiler.load(path)
        if hasattr(module, "generate"):
            tokens = module.generate(torch.tensor([[5, 6, 7]], device=module.device), max_new_tokens=6)
            answer = tokens.tolist()
            dispatch = {k: getattr(getattr(module, k), "last_dispatch", dict)()
                        for k in ("prefill", "decode")}
        else:
            ids = torch.randint(0, 1000, (2, 16), device=module.device)
            out = module(input_ids=ids, attention_mask=torch.ones_like(ids),
                         token_type_ids=torch.zeros_like(ids))
            answer = out.logits.float().sum().item()
            dispatch = module.last_dispatch()
    said = sorted({str(w.message)[:300] for w in caught if "deprecated" not in str(w.message)})
    print(json.dumps({"seconds": round(time.perf_counter() - t, 2), "answer": answer, "dispatch": dispatch,
                      "warnings": said}))
    """
)


def write_models(root: Path) -> None:
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from zoo.models import tiny_llama_lm

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=1000, hidden_size=256, num_hidden_layers=6, num_attention_heads=4, intermediate_size=1024,
        max_position_embeddings=128, num_labels=3,
    )  # fmt: skip
    BertForSequenceClassification(config).eval().save_pretrained(root / "bert6")
    tiny_llama_lm(seed=7, hidden=64, num_layers=4).model.eval().save_pretrained(root / "llama4")


def run(command: list[str], root: Path, env: dict[str, str], timeout: float = 500) -> dict:
    t = time.perf_counter()
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    warned = [line.strip()[:400] for line in done.stderr.splitlines() if "Warning" in line]
    said = [line for line in done.stderr.splitlines() if not line.startswith(("W1", "Failed to load"))]
    return {
        "command": " ".join(command[2:] if command[1] == "-m" else [*command[:1], "-c LOAD", *command[3:]]),
        "exit": done.returncode,
        "seconds": round(time.perf_counter() - t, 2),
        "stdout": done.stdout[-1500:],
        "stderr_tail": "\n".join(said)[-1500:],
        "warnings": warned[:12],
        **({"stderr": done.stderr[-3000:]} if done.returncode else {}),
    }


def native_builds(env: dict[str, str]) -> list[dict]:
    """This machine's native builds as ``kiln cache ls --json`` lists them (their last events)."""
    command = [sys.executable, "-m", "flows.cli", "cache", "ls", "--json"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    if done.returncode:
        return [{"error": done.stderr[-1000:]}]
    return json.loads(done.stdout[done.stdout.index("{") :])["native_builds"]


def wait_for_builds(env: dict[str, str], deadline: float, expect: int) -> list[dict]:
    """The background builds' last events, once ``expect`` of them were logged (a build logs its start
    from its own process) and none is still running, or at the deadline."""
    while True:
        builds = native_builds(env)
        done = len(builds) >= expect and all(b.get("state") != "started" for b in builds)
        if done or time.monotonic() > deadline:
            return builds
        time.sleep(3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--work", default="")
    parser.add_argument("--device", default="cuda", help="cpu with --backend onnxruntime: a smoke run")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--models", default="bert6,llama-gen", help="of bert6, llama-gen")
    args = parser.parse_args()
    ZOO["models"] = [m for m in ZOO["models"] if m["name"] in args.models.split(",")]
    for entry in ZOO["models"]:
        entry.update(backend=args.backend, devices=[args.device])
        if args.device == "cpu":
            entry["precision"] = "fp32"
    root = Path(args.work or tempfile.mkdtemp(prefix="kiln-untrusted-cli-"))
    root.mkdir(parents=True, exist_ok=True)
    write_models(root)
    zoo = json.loads(json.dumps(ZOO))  # shared values written out: zoo files refuse YAML aliases
    (root / "zoo.yaml").write_text(yaml.safe_dump(zoo, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith("KILN_SIGNING_")}  # unsigned
    env.update({"HF_HUB_OFFLINE": "1", "PYTHONPATH": os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])})
    load_env = {**env, "KILN_CACHE_DIR": str(root / "load-cache")}  # a machine that never saw them
    kiln = [sys.executable, "-m", "flows.cli"]
    native = 1 if args.backend == "inductor" else 0  # builds expected per model program (bert: one engine)
    steps: dict[str, dict] = {}
    started = time.monotonic()

    def save() -> None:
        result = {"machine": machine(), "work": str(root), "steps": steps}
        Path(args.out).write_text(json.dumps(result, indent=2))

    def record(name: str, result: dict) -> dict:
        steps[name] = result
        print(f"{name}: exit {result['exit']} in {result['seconds']} s", flush=True)
        save()
        return result

    if record("zoo", run([*kiln, "zoo", "zoo.yaml", "--out", "out", "--json"], root, env))["exit"]:
        return 1
    if "bert6" in args.models:
        bert_steps(root, env, load_env, native, record, steps)
    if "llama-gen" in args.models:
        generation_steps(root, load_env, native, record, steps)
    steps["seconds"] = round(time.monotonic() - started, 1)
    save()
    return 0 if all(s.get("exit", 0) == 0 for s in steps.values() if isinstance(s, dict)) else 1


def bert_steps(root: Path, env: dict, load_env: dict, native: int, record: Any, steps: dict) -> None:
    kiln = [sys.executable, "-m", "flows.cli"]
    bert = str(root / "out" / "bert6.kiln")
    compare = [*kiln, "debug", "compare", bert, "--samples", "1", "--runs", "1"]
    record("bert debug compare, untrusted first", run(compare, root, load_env))
    record("bert load, untrusted first (API)", run([sys.executable, "-c", LOAD, bert], root, load_env))
    steps["native builds after bert"] = wait_for_builds(load_env, time.monotonic() + 240, native)
    record("bert debug compare, untrusted second", run(compare, root, load_env))
    record("bert load, untrusted second (API)", run([sys.executable, "-c", LOAD, bert], root, load_env))


def generation_steps(root: Path, load_env: dict, native: int, record: Any, steps: dict) -> None:
    gen = str(root / "out" / "llama-gen.kiln")
    record("generation load, untrusted first (API)", run([sys.executable, "-c", LOAD, gen], root, load_env))
    before = len(steps.get("native builds after bert", []))
    steps["native builds after generation"] = wait_for_builds(
        load_env, time.monotonic() + 240, before + 2 * native
    )
    record("generation load, untrusted second (API)", run([sys.executable, "-c", LOAD, gen], root, load_env))


def machine() -> dict:
    import torch

    from benchmarks.machine import cpu_model, gpu_machine

    return gpu_machine() if torch.cuda.is_available() else {"cpu": cpu_model(), "torch": torch.__version__}


if __name__ == "__main__":
    sys.exit(main())
