"""Probe on the GPU machine (not a test): which call raises "unspecified launch failure" when BERT-base
fp16 (whole graph) is compiled with shape profiles batch 1 and 8 and called at batch 8
(benchmarks/gpu_runtime.py --profiles 1,8). Each call is synchronised; run with CUDA_LAUNCH_BLOCKING=1.

    CUDA_LAUNCH_BLOCKING=1 python3 benchmarks/probes/probe_profiles_fault.py [graphs-first] \
        [torch-compile | torch-compile-default | torch-compile-reduce-overhead]

``torch-compile``: first compile the fp16 model with torch.compile (default and reduce-overhead) and
call each at batch 1, 8 and 5, as the benchmark does before kiln compiles; then call those too.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import compiler
from benchmarks.gpu_runtime import at_batch, bert_base, first_leaf, without_graphs
from compiler.device import to_device


def main() -> None:
    case = bert_base()
    model, case.args, case.kwargs = to_device(case.model, case.args, case.kwargs, device="cuda")
    others = {}
    modes = {
        "torch-compile": ("default", "reduce-overhead"),
        "torch-compile-default": ("default",),
        "torch-compile-reduce-overhead": ("reduce-overhead",),
    }
    chosen = [modes[a] for a in sys.argv[1:] if a in modes]
    if chosen:
        import copy

        eager = copy.deepcopy(model).half()
        for mode in chosen[0]:
            others[mode] = torch.compile(copy.deepcopy(eager), mode=mode)
            with torch.no_grad():
                for batch in (1, 8, 5):
                    a, k = at_batch(case, batch, True)
                    others[mode](*a, **k)
                    torch.cuda.synchronize()
        print(f"torch.compile {chosen[0]} ran at 1, 8, 5", flush=True)
    program = compiler.export(model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    module = compiler.compile(
        program,
        backend="inductor",
        device="cuda",
        precision="fp16",
        cache=False,
        profiles=[{"batch": 1}, {"batch": 8}],
    )
    print("compiled; profiles:", [(p["profile"], p["dispatch"]) for p in module.report.profiles], flush=True)
    order = [("graphs", module), ("no graphs", without_graphs(module))]
    if "graphs-first" not in sys.argv:
        order.reverse()
    with torch.no_grad():
        for batch in (1, 8, 5):
            a, k = at_batch(case, batch, False)
            print(
                "batch", batch, {n: (tuple(t.shape), t.dtype, int(t.max())) for n, t in k.items()}, flush=True
            )
            reference = first_leaf(model(*a, **k)).float()
            torch.cuda.synchronize()
            for label, fn in order + list(others.items()):
                args, kwargs = at_batch(case, batch, True) if label in others else (a, k)
                got = first_leaf(fn(*args, **kwargs)).float()
                torch.cuda.synchronize()
                error = float((got - reference).norm() / reference.norm())
                dispatch = fn.last_dispatch() if label not in others else None
                print(f"  {label}: ok, rel L2 {error:.2e}, dispatch {dispatch}", flush=True)


if __name__ == "__main__":
    main()
