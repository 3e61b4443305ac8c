"""The CLI's options: every CompileOptions field is a ``kiln compile`` flag or says why not, and
``--target`` names the engine target on every command (issue 35)."""

from __future__ import annotations

import dataclasses
import typing

from typer.testing import CliRunner

from compiler.options import CompileOptions
from flows.cli import GROUPS, app
from flows.cli.compile import compile_cmd

# A field whose flag is not spelled --<field> names its flags here.
FLAGS = {
    "torch_executed_ops": ("--torch-executed-op",),
    "split_modules": ("--split-module",),
    "backend_options": ("--backend-option",),
    "profiles": ("--profile",),
    "calibration": ("--calibration-data", "--calibration-samples", "--calibration-method"),
}
# A field with no flag says why.
NO_FLAG = {
    "partition_precision": "a map from partition name to precision: the zoo file's partition_precision, "
    "or what accuracy repair records; partition names exist only after a first compile",
    "float_layers": "the layers accuracy repair's layer search keeps in float, by partition and node name: "
    "recorded in the plan, names that exist only after a first compile",
    "repair_seconds": "the layer search's time budget: the zoo entry's repair_seconds",
}


def _flags(command) -> set[str]:
    flags: set[str] = set()
    for hint in typing.get_type_hints(command, include_extras=True).values():
        for option in getattr(hint, "__metadata__", ()):
            names = [getattr(option, "default", None), *(getattr(option, "param_decls", None) or ())]
            flags.update(n.split("/")[0] for n in names if isinstance(n, str) and n.startswith("-"))
    return flags


def test_every_compile_option_is_a_flag_of_kiln_compile_or_says_why_not():
    flags = _flags(compile_cmd)
    missing = []
    for field in dataclasses.fields(CompileOptions):
        if field.name in NO_FLAG:
            assert NO_FLAG[field.name]
            continue
        wanted = FLAGS.get(field.name, ("--" + field.name.replace("_", "-"),))
        missing += [f"{field.name}: {flag}" for flag in wanted if flag not in flags]
    assert not missing, (
        f"CompileOptions fields without a kiln compile flag (or a reason in NO_FLAG): {missing}"
    )
    assert not set(NO_FLAG) - {f.name for f in dataclasses.fields(CompileOptions)}  # no stale reasons


def test_one_module_lists_every_command_group():
    names = sorted(c.name for c in app.registered_commands) + sorted(g.name for g in app.registered_groups)
    assert {g.__name__.rsplit(".", 1)[-1] for g in GROUPS} == {
        "compile",
        "registry",
        "ops",
        "cache",
        "serve",
        "signing",
    }
    assert "zoo" in names and "lookup" in names and "cache" in names and "serve" in names


def test_target_is_the_engine_target_and_the_old_device_spelling_still_works(tmp_path):
    """--target on lookup/release/rollback/report is the engine target; on zoo and compile the device
    is --device, and the old --target/-t spelling there still reaches it with a deprecation message."""
    for command in ("lookup", "release", "rollback"):
        assert "--target" in _flags(next(c.callback for c in app.registered_commands if c.name == command))
    assert "--device" in _flags(compile_cmd) and "-d" in _flags(compile_cmd)
    missing = str(tmp_path / "missing.yaml")
    for args in (["zoo", missing, "--target", "cpu"], ["zoo", missing, "-t", "cpu"]):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output  # the zoo file is missing: the option itself parsed
        assert "is --device now" in result.output
    quiet = CliRunner().invoke(app, ["zoo", missing, "--device", "cpu"])
    assert quiet.exit_code == 2 and "is --device now" not in quiet.output
