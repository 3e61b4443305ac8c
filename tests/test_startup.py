"""What the CLI and ``import compiler`` pay for before they are used (issue 21). Times are the
benchmark's job (benchmarks/startup.py); these check which heavy libraries a fresh process imports."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _fresh(code: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_cli_and_compiler_import_no_heavy_library_until_used():
    out = _fresh(
        """
        import sys, types
        import compiler, flows.cli, registry.summary
        heavy = ("torch", "prefect", "mlflow", "onnx", "onnxruntime", "transformers", "sympy")
        print(sorted(m for m in heavy if m in sys.modules))
        import compiler.export, compiler.validate  # binding a submodule keeps the public function
        print(callable(compiler.export), isinstance(compiler.validate, types.FunctionType))
        print("torch._dynamo" in sys.modules, sorted(set(compiler.__all__) - set(dir(compiler))))
        """
    )
    assert out.splitlines() == ["[]", "True True", "False []"]


def test_registry_listings_need_no_torch_and_the_no_op_path_no_prefect():
    out = _fresh(
        """
        import sys
        import registry.lookup, registry.models
        print("torch" in sys.modules)
        import flows.results, tasks.reuse  # an unchanged zoo's summary, without any flow
        print("prefect" in sys.modules)
        """
    )
    assert out.split() == ["False", "False"]
