"""The compiler is safe to call from threads: it serialises its traces (torch.export, ONNX exporter)."""

from concurrent.futures import ThreadPoolExecutor

import compiler
from zoo.models import repeated_fallback, tiny_bert


def _compile_and_check(case, tmp_path):
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    compiled = compiler.compile(program, cache=tmp_path, split_modules="auto")
    return compiler.validate(case.model, compiled, samples=2, warmup=0, runs=1).max_rel_l2


def test_two_compiles_in_threads_both_succeed(tmp_path):
    cases = [
        tiny_bert(),
        repeated_fallback(depth=3),
        tiny_bert(hidden=32),
        repeated_fallback(depth=2, width=32),
    ]
    with ThreadPoolExecutor(2) as pool:
        errors = list(pool.map(lambda i: _compile_and_check(cases[i], tmp_path / str(i)), range(len(cases))))
    assert all(e < 1e-4 for e in errors), errors
