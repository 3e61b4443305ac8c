"""The op-module import policy (compiler.program.module_policy, issue 21): HF packages load with no argument,
anything else is still refused, and a strict policy holds on every load path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import compiler

ROOT = Path(__file__).resolve().parents[3]


def _fresh(code: str, **env: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if k != "KILN_ALLOWED_OP_MODULES"}
    full.update(PYTHONPATH=str(ROOT), **env)
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=full, timeout=600
    )


@pytest.fixture(scope="module")
def packages(compiled_zoo, tmp_path_factory) -> dict[str, Path]:
    """A package whose outputs are transformers' ModelOutput, and one with a custom op (zoo.models)."""
    out = tmp_path_factory.mktemp("policy")
    return {
        name: compiler.save(compiled_zoo[name][1], out / f"{name}.kiln").path
        for name in ("tiny_bert", "mlp_with_fallback")
    }


def test_hf_package_loads_in_a_fresh_process_with_no_argument_and_others_are_still_refused(packages):
    manifest = compiler.read_manifest(packages["tiny_bert"])
    assert list(manifest.op_modules) == ["transformers.modeling_outputs"]
    done = _fresh(
        f"""
        import sys, torch, compiler
        from compiler.errors import OpModuleNotAllowedError
        assert "transformers.modeling_outputs" not in sys.modules
        bert = compiler.load({str(packages["tiny_bert"])!r})
        ids = torch.randint(0, 100, (2, 16))
        print(type(bert(input_ids=ids, attention_mask=torch.ones_like(ids))).__name__)
        try:
            compiler.load({str(packages["mlp_with_fallback"])!r})
        except OpModuleNotAllowedError as exc:
            print("REFUSED", exc.needed, "zoo.models" in sys.modules)
        """
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:2] == [
        "BaseModelOutputWithPoolingAndCrossAttentions",
        "REFUSED ['zoo.models'] False",
    ]


def test_strict_policy_refuses_the_defaults_in_a_fresh_process(packages):
    done = _fresh(
        f"""
        import sys, compiler
        from compiler.errors import OpModuleNotAllowedError
        try:
            compiler.load({str(packages["tiny_bert"])!r})
        except OpModuleNotAllowedError as exc:
            print(exc)
        print("imported" if "transformers.modeling_outputs" in sys.modules else "not imported")
        compiler.load({str(packages["tiny_bert"])!r}, allowed_modules=["transformers.modeling_outputs"])
        print("loaded when the caller allows it")
        """,
        KILN_ALLOWED_OP_MODULES="",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "KILN_ALLOWED_OP_MODULES=transformers.modeling_outputs" in done.stdout  # today's message
    assert done.stdout.splitlines()[-2:] == ["not imported", "loaded when the caller allows it"]


def test_strict_policy_holds_for_lookups_and_the_pyfunc_loader(packages):
    """Both load through compiler.load; the pyfunc model also drops the module list it was logged with."""
    done = _fresh(
        f"""
        import os, sys
        from mlflow.pyfunc import PythonModelContext
        from compiler.errors import OpModuleNotAllowedError
        from registry.lookup import load_package
        from registry.pyfunc import PACKAGE_ARTIFACT, KilnPackageModel

        path = {str(packages["mlp_with_fallback"])!r}
        model = KilnPackageModel(allowed_modules=["zoo.models"])  # as registry.tracking logs it
        context = PythonModelContext(artifacts={{PACKAGE_ARTIFACT: path}}, model_config=None)
        for load in (lambda: model.load_context(context), lambda: load_package(path)):
            try:
                load()
                print("loaded")
            except OpModuleNotAllowedError as exc:
                print("refused", exc.needed)
        assert "zoo.models" not in sys.modules
        del os.environ["KILN_ALLOWED_OP_MODULES"]  # the default policy: the logged list counts again
        model.load_context(context)
        print("pyfunc loaded", "zoo.models" in sys.modules)
        """,
        KILN_ALLOWED_OP_MODULES="",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == [
        "refused ['zoo.models']",
        "refused ['zoo.models']",
        "pyfunc loaded True",
    ]


class _Attends(torch.nn.Module):
    """A decode attention call as the decode program makes it on the GPU (here its ATen form)."""

    def forward(self, query, keys, values, mask, new_keys, new_values):
        return torch.ops.kiln.decode_attention(query, keys, values, mask, new_keys, new_values, 0.25)


def test_kilns_own_op_module_loads_even_in_the_strict_mode_and_no_other_kiln_module_does(tmp_path):
    from compiler.generation.attention import reference
    from compiler.program.module_policy import KILN_OP_MODULES, is_allowed_module

    g = torch.Generator().manual_seed(0)
    shapes = [(1, 4, 1, 16), (1, 2, 24, 16), (1, 2, 24, 16), (1, 1, 1, 24), (1, 2, 1, 16), (1, 2, 1, 16)]
    args = tuple(torch.randn(s, generator=g) for s in shapes)
    program = compiler.export(_Attends(), args)
    compiled = compiler.compile(program, backend="inductor")
    assert not compiled.plan.fallback_ops  # Inductor runs kiln's op inside its engine
    path = compiler.save(compiled, tmp_path / "attends.kiln").path
    assert list(compiler.read_manifest(path).op_modules) == list(KILN_OP_MODULES)
    torch.save({"args": args, "want": reference(*args, 0.25)}, tmp_path / "io.pt")
    done = _fresh(
        f"""
        import sys, torch, compiler
        io = torch.load({str(tmp_path / "io.pt")!r})
        assert "compiler.generation.attention" not in sys.modules
        out = compiler.load({str(path)!r})(*io["args"])
        torch.testing.assert_close(out, io["want"])
        print("ok")
        """,
        KILN_ALLOWED_OP_MODULES="",
    )
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
    assert not is_allowed_module("compiler.atomic", ())  # the exact modules, not the prefix "compiler"


def test_a_process_that_exits_at_once_waits_for_its_background_import(tmp_path):
    """A load's background import (an output type's module) finishes before the interpreter exits: a
    thread left inside an import while the interpreter finalizes aborted the process (CI: exit -6,
    "terminate called without an active exception", after a script's last line)."""
    (tmp_path / "slow_output_types.py").write_text(
        "import pathlib, time\ntime.sleep(1.0)\n"
        "pathlib.Path(__file__).with_suffix('.done').write_text('ok')\n"
    )
    done = _fresh(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from compiler.program.module_policy import import_in_background
        import_in_background(["slow_output_types"])
        print("exiting")
        """
    )
    assert done.returncode == 0 and done.stdout.strip() == "exiting", done.stderr[-3000:]
    assert (tmp_path / "slow_output_types.done").read_text() == "ok"  # the import ran to its end
