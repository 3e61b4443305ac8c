"""The ``kiln`` command line without a server: help a new user can follow, exit codes scripts can trust.

The runs that compile (exit 0 and 1) are in tests/flows/test_flows.py, against a real Prefect server.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures import preloaded

ROOT = Path(__file__).resolve().parents[2]


def _kiln(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    # No server here: these runs must fail (or finish) before Prefect is needed. Forked from the suite's
    # preload server (torch and the like imported once), each still a process of its own.
    full_env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    full_env.update({"PYTHONPATH": str(ROOT), "COLUMNS": "200", **(env or {})})
    return preloaded.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_help_names_every_command_and_the_first_step() -> None:
    proc = _kiln("--help")
    assert proc.returncode == 0
    for command in ("zoo", "compile", "deploy", "lookup", "release", "rollback"):
        assert command in proc.stdout
    assert "kiln zoo deploy/zoo.yaml --out out/" in proc.stdout
    assert "Exit codes: 0" in proc.stdout
    zoo_help = _kiln("zoo", "--help").stdout
    assert "--task-runner" in zoo_help and "--dask-address" in zoo_help and "--check" in zoo_help


def test_example_zoo_checks_clean() -> None:
    proc = _kiln("zoo", "deploy/zoo.yaml", "--check")
    assert proc.returncode == 0, proc.stderr
    assert "5 models ready, 0 with problems" in proc.stderr


def test_check_names_each_problem_and_exits_1(tmp_path: Path) -> None:
    zoo = tmp_path / "zoo.yaml"
    zoo.write_text(
        "models:\n"
        "  - {name: a, factory: 'zoo.models:mlp_with_fallback', backend: onnxrt}\n"
        "  - {name: b, factory: 'nowhere.models:f'}\n"
        "  - {name: c, factory: 'zoo.models:tiny_vit'}\n"
    )
    proc = _kiln("zoo", str(zoo), "--check")
    assert proc.returncode == 1
    assert "models[0] (a).backend: unknown backend 'onnxrt'" in proc.stderr
    assert "models[b].factory: cannot import module 'nowhere.models'" in proc.stderr
    assert "1 models ready, 2 with problems" in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("zoo", "{broken}"), "not valid YAML"),
        (("zoo", "{missing}"), "cannot read zoo file"),
        (("zoo", "{deep}"), "nested deeper than 64 levels"),
        # A path under a regular file cannot be created, as on a read-only filesystem (even for root).
        (("zoo", "deploy/zoo.yaml", "--out", "{file}/out"), "packages cannot be written there"),
        (("compile", "zoo.models:mlp_with_fallback", "--out", "{file}/out"), "packages cannot be written"),
        (
            ("compile", "zoo.models:mlp_with_fallback", "--workspace", "{file}/ws"),
            "settings.workspace '{file}/ws': stage outputs cannot be written there",
        ),
        (("zoo", "deploy/zoo.yaml", "--model", "nope"), "--model ['nope']: not in deploy/zoo.yaml"),
        (("zoo", "deploy/zoo.yaml", "--task-runner", "spark"), "use 'thread' or 'dask'"),
        (("compile", "nope"), "'nope' is not a model of deploy/zoo.yaml"),
        (("compile", "zoo.models:mlp_with_fallback", "--precision", "fp64"), "options.precision"),
        (("deploy",), "PREFECT_API_URL is not set"),
    ],
)
def test_unusable_input_exits_2_with_the_reason(tmp_path: Path, args: tuple[str, ...], message: str) -> None:
    broken = tmp_path / "broken.yaml"
    broken.write_text("models: [\n")
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 20000)  # a RecursionError traceback (exit 1) before the depth bound
    paths = {"broken": str(broken), "missing": str(tmp_path / "missing.yaml"), "deep": str(deep)}
    paths["file"] = str(broken)
    proc = _kiln(*(a.format(**paths) for a in args))
    assert proc.returncode == 2, proc.stderr
    assert message.format(**paths) in " ".join(proc.stderr.split()), proc.stderr


def _read_only_mount_works(where: Path) -> bool:
    probe = 'mount -t tmpfs -o ro none "$0" && ! touch "$0/x" 2>/dev/null'
    try:
        return subprocess.run(["unshare", "-rm", "sh", "-c", probe, str(where)], timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_an_out_dir_on_a_read_only_filesystem_is_exit_2_naming_it(tmp_path: Path) -> None:
    """A real read-only filesystem (a tmpfs mounted ro in a user and mount namespace) as --out, the
    directory already there: exit 2 naming it and the errno, before anything is built (was an OSError
    traceback, exit 1)."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if not _read_only_mount_works(mount):
        pytest.skip("no user namespaces here to mount a read-only filesystem (unshare -rm)")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    script = 'mount -t tmpfs -o ro none "$0" && exec "$1" -m flows.cli zoo deploy/zoo.yaml --out "$0"'
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, str(mount), sys.executable],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    text = " ".join(proc.stderr.split())
    assert f"--out '{mount}': packages cannot be written there (Read-only file system)" in text, text
    assert "Traceback" not in proc.stderr


def test_a_workspace_on_a_read_only_filesystem_is_exit_2_naming_it(tmp_path: Path) -> None:
    """settings.workspace on a real read-only filesystem: exit 2 naming the directory and the fix,
    before any model is looked at (was an OSError traceback, exit 1)."""
    mount = tmp_path / "ro"
    mount.mkdir()
    if not _read_only_mount_works(mount):
        pytest.skip("no user namespaces here to mount a read-only filesystem (unshare -rm)")
    zoo = tmp_path / "zoo.yaml"
    zoo.write_text(
        f"settings: {{workspace: '{mount}/ws', tracking: false}}\n"
        "models: [{name: mlp, factory: 'zoo.models:mlp_with_fallback'}]\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update({"PYTHONPATH": str(ROOT), "COLUMNS": "200"})
    script = 'mount -t tmpfs -o ro none "$0" && exec "$1" -m flows.cli zoo "$2" --out "$3"'
    proc = subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, str(mount), sys.executable, str(zoo), str(tmp_path / "out")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    text = " ".join(proc.stderr.split())
    assert f"settings.workspace '{mount}/ws': stage outputs cannot be written there" in text, text
    assert "(Read-only file system)" in text and "--workspace" in text, text
    assert "Traceback" not in proc.stderr


def test_unusable_environment_or_file_encoding_is_exit_code_2(tmp_path: Path) -> None:
    bad_size = _kiln("zoo", "deploy/zoo.yaml", "--check", env={"KILN_CACHE_MAX_BYTES": "ten gigs"})
    assert bad_size.returncode == 2, bad_size.stderr
    assert "KILN_CACHE_MAX_BYTES='ten gigs' is not a positive size" in bad_size.stderr
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("models:\n  - {name: caf\xe9, factory: 'zoo.models:tiny_vit'}\n".encode("latin-1"))
    proc = _kiln("zoo", str(latin), "--check")
    assert proc.returncode == 2 and "not UTF-8" in proc.stderr, proc.stderr


def test_check_refuses_untrusted_factories_and_absurd_ranges(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    zoo = tmp_path / "zoo.yaml"
    zoo.write_text(
        "models:\n"
        f"  - {{name: evil, factory: 'os:system', factory_kwargs: {{command: 'touch {marker}'}}}}\n"
        "  - name: huge\n"
        "    factory: zoo.models:mlp_with_fallback\n"
        "    inputs: {x: {dims: [{axis: 0, name: batch, min: 1, max: 1000000000000}]}}\n"
    )
    proc = _kiln("zoo", str(zoo), "--check")
    assert proc.returncode == 1, proc.stderr
    assert "'os:system' is in the standard library" in proc.stderr
    assert "lower the dims' max" in proc.stderr
    assert "0 models ready, 2 with problems" in proc.stderr
    assert not marker.exists()


def test_debug_compare_prints_each_partitions_error_against_pytorch() -> None:
    import json

    package = ROOT / "tests" / "fixtures" / "packages" / "mlp-format1-2026-11.kiln"
    refused = _kiln("debug", "compare", str(package))  # its custom-op module was not allowed
    assert refused.returncode == 2 and "zoo.models" in refused.stderr, refused.stderr
    proc = _kiln("debug", "compare", str(package), "--allow-op-module", "zoo.models", "--json", "--runs", "1")
    assert proc.returncode == 0, proc.stderr
    table = json.loads(proc.stdout)
    rows = table["rows"]
    assert len(rows) == 2 and all(r["precision"] == "fp32" and r["rel_l2"] < 1e-5 for r in rows)
    assert {len(r["fingerprint"]) for r in rows} == {64}
