"""What validating on recorded data costs next to a compile, on the example zoo's models (issue 13).

For each model of deploy/zoo.yaml (built by its factory, compiled as there: fp32, ONNX Runtime, cold
engine cache): the compile's seconds; a recorded-data file of ``--samples`` input sets at the opt
shapes, written as safetensors; and validation's accuracy pass on random inputs (3 sets, today's
default) vs on the recorded file (read, checked, hashed, run), interleaved, median of 5. Latency timing is the
same in both and left out. Target: the recorded-data accuracy pass adds at most 20% to compile time.
The pass is linear in the samples: most of it is running the eager and the compiled model.
Run: python benchmarks/validation_data_cost.py [--samples 8]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import compiler
from benchmarks._common import print_table, write_json
from compiler.inputs.data import sample_inputs, validation_data
from compiler.validation.validate import measure_accuracy
from zoo.models import FACTORIES

MODELS = ("tiny_bert", "tiny_vit", "tiny_resnet", "tiny_gpt2", "mlp_with_fallback")


def recorded_file(specs, samples: int, path: Path) -> Path:
    """``samples`` input sets at the opt shapes, one array per input with a leading sample axis."""
    generator = torch.Generator().manual_seed(1)
    sets = [sample_inputs(specs, "opt", generator) for _ in range(samples)]
    save_file({s.name: torch.stack([inputs[i] for inputs in sets]) for i, s in enumerate(specs)}, str(path))
    return path


def run(name: str, samples: int, work: Path, runs: int = 5) -> dict:
    case = FACTORIES[name]()
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    start = time.perf_counter()
    compiled = compiler.compile(program, cache=compiler.EngineCache(work / f"{name}-cache"))
    compile_s = time.perf_counter() - start
    path = recorded_file(compiled.input_specs, samples, work / f"{name}.safetensors")

    def random_pass() -> None:
        measure_accuracy(case.model, compiled, validation_data(compiled.input_specs, samples=3).samples)

    def recorded_pass() -> None:
        measure_accuracy(case.model, compiled, validation_data(compiled.input_specs, path).samples)

    recorded = validation_data(compiled.input_specs, path)
    # Interleaved (the one latency measurement), so the neighbours' load hits all three alike.
    timed = compiler.measure_latency(
        {
            "load": lambda: validation_data(compiled.input_specs, path),
            "random": random_pass,
            "recorded": recorded_pass,
        },
        warmup=1,
        runs=runs,
    )
    load_s, random_s, recorded_s = (timed[k].median_ms / 1e3 for k in ("load", "random", "recorded"))
    return {
        "model": name,
        "compile_s": round(compile_s, 3),
        "recorded_load_s": round(load_s, 4),
        "random_accuracy_s": round(random_s, 4),
        "recorded_accuracy_s": round(recorded_s, 4),
        "recorded_samples": len(recorded),
        "recorded_bytes": path.stat().st_size,
        "recorded_share_of_compile": round(recorded_s / compile_s, 4),
        "added_vs_random_share_of_compile": round((recorded_s - random_s) / compile_s, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(min(2, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as work:
        rows = [run(name, args.samples, Path(work)) for name in MODELS]
    print_table(
        f"recorded-data validation ({args.samples} samples at opt shapes) vs compile time",
        [
            "model",
            "compile s",
            "load s",
            "random acc s",
            "recorded acc s",
            "recorded / compile",
            "added / compile",
        ],
        [
            [
                r["model"],
                r["compile_s"],
                r["recorded_load_s"],
                r["random_accuracy_s"],
                r["recorded_accuracy_s"],
                f"{r['recorded_share_of_compile']:.1%}",
                f"{r['added_vs_random_share_of_compile']:.1%}",
            ]
            for r in rows
        ],
    )
    worst = max(r["recorded_share_of_compile"] for r in rows)
    print(f"\nworst: the recorded-data accuracy pass is {worst:.1%} of compile time (target <= 20%)")
    write_json("validation_data_cost", {"samples": args.samples, "models": rows, "worst_share": worst})


if __name__ == "__main__":
    main()
