"""The compiler is safe to call from threads: it serialises its traces (torch.export, ONNX exporter)."""

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

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


def test_a_model_with_a_custom_op_runs_while_another_thread_compiles(tmp_path):
    # torch runs custom ops through torch._dynamo.disable, which edits a process-wide fx annotation
    # dict while any thread exports; unguarded, this failed with KeyError 'custom' within ~10 s.
    case = repeated_fallback(depth=2)
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    compiled = compiler.compile(program, cache=tmp_path / "a")
    expected = compiled(*case.args, **case.kwargs)
    done, calls, errors = threading.Event(), [0], []

    def run() -> None:
        while not done.is_set():
            try:
                torch.testing.assert_close(compiled(*case.args, **case.kwargs), expected)
                calls[0] += 1
            except Exception as exc:  # reported below, with the main thread's result
                errors.append(repr(exc))
                return

    runner = threading.Thread(target=run)
    runner.start()
    try:
        other = tiny_bert()
        for i in range(2):
            shapes = other.dynamic_shapes
            exported = compiler.export(other.model, other.args, other.kwargs, dynamic_shapes=shapes)
            compiler.compile(exported, cache=tmp_path / f"b{i}")
    finally:
        done.set()
        runner.join()
    assert errors == [] and calls[0] > 10, (errors, calls)
