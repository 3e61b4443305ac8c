"""ONNX Runtime's idle threads: spin or sleep, for a module with one session and for one with several.

A session's intra-op threads busy-wait for the next call by default. kiln lets them spin only where the
module runs one ONNX Runtime engine; where it runs several one after another (a model split per block)
each session's spinning threads take the cores from the next, so their threads sleep
(``OnnxRuntimeBackend.load(..., siblings=)``). This measures both choices for both shapes of module,
side by side: BERT-base width (768 hidden, 12 heads, sequence 128) with ``--layers`` layers, whole graph
and split per ``BertLayer``, at batch 1 and 8, each variant alone in a fresh process, alternating.

    python3 benchmarks/ort_threads.py [--layers 4] [--runs 20]   # -> results/ort_threads_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers
from torch.export import Dim

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import compiler
from benchmarks._common import print_table, write_json
from benchmarks.machine import cpu_model
from compiler.backends import get_backend
from compiler.engine_build.weights import engine_weights
from compiler.runtime.module import EngineCall


def with_spinning(module: compiler.CompiledModule, spin: bool) -> compiler.CompiledModule:
    """The module's ONNX Runtime engines loaded again as if alone (spin) or with siblings (sleep)."""
    for name, call in module.graph.named_children():
        if isinstance(call, EngineCall):
            artifact = module.engines[call.fingerprint]
            weights = engine_weights(module.plan, module.dedup.instance(name))
            backend = get_backend(artifact.backend)
            call.engine = backend.load(artifact.engine, artifact.io, weights, siblings=0 if spin else 1)
    return module


CHILD = """
import json, sys, torch
sys.path.insert(0, sys.argv[1])
import compiler
from benchmarks.ort_threads import with_spinning
from compiler.validation.validate import measure_latency
package, choice, runs = sys.argv[2], sys.argv[3], int(sys.argv[4])
module = compiler.load(package)
if choice != "kiln":
    with_spinning(module, spin=choice == "spin")
result = {}
for batch in (1, 8):
    x = torch.randint(0, 1000, (batch, 128))
    with torch.no_grad():
        result[batch] = measure_latency({"m": lambda: module(x)}, warmup=3, runs=runs)["m"].median_ms
print(json.dumps(result))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="fresh processes per variant, alternating")
    parser.add_argument("--out", default="ort_threads_cpu")
    args = parser.parse_args()
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig(num_hidden_layers=args.layers)).eval()
    ids = torch.randint(0, 1000, (2, 128))
    program = compiler.export(model, (ids,), dynamic_shapes={"input_ids": {0: Dim("batch", min=1, max=8)}})
    root = str(Path(__file__).resolve().parents[1])
    rows = []
    with tempfile.TemporaryDirectory(prefix="kiln-ort-threads-") as tmp:
        packages, partitions = {}, {}
        for shape, split in (("whole", None), ("split", ("BertLayer",))):
            compiled = compiler.compile(program, cache=False, split_modules=split)
            packages[shape] = compiler.save(compiled, Path(tmp) / shape).path
            partitions[shape] = len(compiled.report.partitions)
        # Each variant alone in a fresh process (a module's own threads are what is compared), the
        # variants alternating round after round; the median of the rounds' medians.
        other = {"whole": "sleep", "split": "spin"}
        times: dict[tuple[str, str], dict[int, list[float]]] = {}
        for _ in range(args.rounds):
            for shape in packages:
                for choice in ("kiln", other[shape]):
                    done = subprocess.run(
                        [sys.executable, "-c", CHILD, root, str(packages[shape]), choice, str(args.runs)],
                        capture_output=True,
                        text=True,
                        check=True,
                    )
                    measured = json.loads(done.stdout.strip().splitlines()[-1])
                    for batch, ms in measured.items():
                        times.setdefault((shape, choice), {}).setdefault(int(batch), []).append(ms)
    for batch in (1, 8):
        for shape in ("whole", "split"):
            kiln = statistics.median(times[(shape, "kiln")][batch])
            alt = statistics.median(times[(shape, other[shape])][batch])
            rows.append(
                {
                    "module": f"{shape} ({partitions[shape]} partitions)",
                    "batch": batch,
                    "kiln_choice": "spin" if shape == "whole" else "sleep",
                    "kiln_ms": round(kiln, 2),
                    "other_choice_ms": round(alt, 2),
                    "kiln_over_other": round(kiln / alt, 3),
                }
            )
    print_table(
        f"ONNX Runtime idle threads ({cpu_model()}, {torch.get_num_threads()} threads, "
        f"BERT {args.layers} layers, each variant alone in its process)",
        ["module", "batch", "kiln", "kiln ms", "other ms", "kiln / other"],
        [
            [
                r["module"],
                r["batch"],
                r["kiln_choice"],
                r["kiln_ms"],
                r["other_choice_ms"],
                r["kiln_over_other"],
            ]
            for r in rows
        ],
    )
    write_json(
        args.out,
        {
            "cpu": cpu_model(),
            "bert_layers": args.layers,
            "runs": args.runs,
            "rounds": args.rounds,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
