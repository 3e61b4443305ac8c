"""Signing across the pipeline (issue 41.3), through the ``kiln`` CLI as a team runs it: ``kiln signing
init`` makes the identity; ``kiln zoo`` on a worker holding the private key records signed versions in a
real ``mlflow server``; ``kiln lookup`` and ``kiln serve triton run`` with the public key verify the
download and trust its engine code, and refuse a version that is unsigned or signed by another key;
without the key an unsigned version still loads and serves, and both say why its engines were not
trusted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from compiler.package.signing import sign_package
from tests.fixtures import preloaded
from tests.fixtures.server_process import free_port
from tests.fixtures.signing_keys import ec_key_pair

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # a signed zoo through MLflow, then Triton verifying it
MODEL = {"factory": "zoo.models:mlp_with_fallback", "backend": "onnxruntime", "devices": ["cpu"]}


def _kiln(*args: str, env: dict[str, str] | None = None, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("KILN_SIGNING_")}
    full.update({"PYTHONPATH": str(ROOT), "COLUMNS": "250", **(env or {})})
    return preloaded.run(
        [sys.executable, "-m", "flows.cli", *args],
        cwd=cwd,
        env=full,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def pipeline(prefect_api, mlflow_server, tmp_path_factory) -> dict:
    """The identity from `kiln signing init`; `signed` recorded by a worker with the private key,
    `plain` by one without (same model: its stages come from the workspace)."""
    root = tmp_path_factory.mktemp("signed-pipeline")
    made = _kiln("signing", "init", "--dir", str(root / "keys"), "--json")
    assert made.returncode == 0, made.stderr
    keys = json.loads(made.stdout)
    settings = {
        "workspace": str(root / "ws"),
        "engine_cache": str(root / "cache"),
        "tracking": True,
        "validation": {"samples": 2, "warmup": 0, "runs": 2},
    }
    runs = {}
    for name, env in (("signed", {"KILN_SIGNING_PRIVATE_KEY": keys["private_key"]}), ("plain", {})):
        zoo = root / f"{name}.yaml"
        zoo.write_text(yaml.safe_dump({"settings": settings, "models": [{"name": name, **MODEL}]}))
        done = _kiln("zoo", str(zoo), "--out", str(root / "out"), "--json", env=env)
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
        runs[name] = json.loads((root / "out" / "summary.json").read_text())
    return {"root": root, "keys": keys, "runs": runs}


def _lookup(model: str, env: dict[str, str], dst: Path) -> subprocess.CompletedProcess:
    # The model's custom op lives in zoo.models: its module is allowed by name, as a user does.
    return _kiln(
        "lookup",
        model,
        "--shape",
        "2,64",
        "--dst",
        str(dst),
        "--allow-op-module",
        "zoo.models",
        "--json",
        env=env,
    )


def test_signing_init_writes_a_private_key_only_its_owner_reads_and_never_replaces_one(pipeline):
    keys = pipeline["keys"]
    private, public = Path(keys["private_key"]), Path(keys["public_key"])
    assert private.stat().st_mode & 0o777 == 0o600 and public.is_file()
    assert keys["env"] == {"KILN_SIGNING_PRIVATE_KEY": str(private), "KILN_SIGNING_PUBLIC_KEY": str(public)}
    before = private.read_bytes()
    again = _kiln("signing", "init", "--dir", str(private.parent))
    assert again.returncode == 2 and "exists" in again.stderr, again.stderr
    assert private.read_bytes() == before
    # The pair belongs together; another key's public half is named as not belonging.
    env = {"KILN_SIGNING_PRIVATE_KEY": str(private), "KILN_SIGNING_PUBLIC_KEY": str(public)}
    checked = _kiln("signing", "check", "--json", env=env)
    assert checked.returncode == 0 and json.loads(checked.stdout)["pair_verified"], checked.stdout
    other = ec_key_pair(pipeline["root"], "other")
    mixed = _kiln("signing", "check", env={**env, "KILN_SIGNING_PUBLIC_KEY": str(other.public)})
    assert mixed.returncode == 2 and "do not belong together" in mixed.stderr, mixed.stderr


def test_a_worker_with_the_key_records_a_signed_version_and_lookup_verifies_and_trusts_it(pipeline, tmp_path):
    root = pipeline["root"]
    assert (root / "out" / "signed.kiln" / "model.sig").is_file()  # compiler.save signed it
    assert not (root / "out" / "plain.kiln" / "model.sig").exists()
    found = _lookup("signed", {"KILN_SIGNING_PUBLIC_KEY": pipeline["keys"]["public_key"]}, tmp_path / "dl")
    assert found.returncode == 0, (found.stdout, found.stderr[-2000:])
    result = json.loads(found.stdout)
    assert (Path(result["package_dir"]) / "model.sig").is_file()  # the upload kept the signature
    assert result["engine_code"].startswith("engine code trusted: its signature verified"), result


def test_with_the_key_set_an_unsigned_or_re_signed_version_is_refused(pipeline, mlflow_server, tmp_path):
    env = {"KILN_SIGNING_PUBLIC_KEY": pipeline["keys"]["public_key"]}
    unsigned = _lookup("plain", env, tmp_path / "a")
    assert unsigned.returncode == 2 and "is not signed" in unsigned.stdout, unsigned.stdout[-2000:]
    # The registry's copy of the signed version, signed again by someone else's key: every file as
    # recorded, the signature not the team's.
    stored = [
        p for p in Path(mlflow_server.artifacts).rglob("model.sig") if (p.parent / "manifest.json").is_file()
    ]
    recorded = pipeline["runs"]["signed"]
    theirs = [p for p in stored if json.loads((p.parent / "manifest.json").read_text())["content_hash"]
              == _content_hash(recorded)]  # fmt: skip
    assert theirs, stored
    original = theirs[0].read_bytes()
    try:
        sign_package(theirs[0].parent, _signer(ec_key_pair(tmp_path, "intruder").private))
        resigned = _lookup("signed", env, tmp_path / "b")
        assert resigned.returncode == 2 and "does not verify" in resigned.stdout, resigned.stdout[-2000:]
    finally:
        theirs[0].write_bytes(original)


def test_without_the_key_an_unsigned_version_loads_and_says_why_its_engines_are_untrusted(pipeline, tmp_path):
    found = _lookup("plain", {}, tmp_path / "dl")
    assert found.returncode == 0, found.stdout[-2000:]
    note = json.loads(found.stdout)["engine_code"]
    assert "untrusted" in note and "no KILN_SIGNING_PUBLIC_KEY" in note and "unsigned" in note, note


def test_triton_verifies_with_the_public_key_and_serves_an_unsigned_version_only_without_it(
    pipeline, tmp_path
):
    repo = tmp_path / "repo"
    public = pipeline["keys"]["public_key"]
    for model, env in (("signed", {"KILN_SIGNING_PUBLIC_KEY": public}), ("plain", {})):
        released = _kiln(
            "release", model, "--zoo", str(pipeline["root"] / f"{model}.yaml"), "--runs", "2",
            "--max-latency-ratio", "100", env={**env, "KILN_ALLOWED_OP_MODULES": "zoo.models"},
        )  # fmt: skip
        assert released.returncode == 0, (released.stdout[-2000:], released.stderr[-2000:])
        exported = _kiln(
            "serve", "triton", "export", model, "--repository", str(repo), "--allow-op-module", "zoo.models"
        )
        assert exported.returncode == 0, exported.stdout[-2000:]
    # With the key: the signed version is trusted; the unsigned one is refused, and tritonserver (which
    # loads every model at start) names why.
    only_signed = tmp_path / "signed-repo"
    shutil.copytree(repo, only_signed, ignore=shutil.ignore_patterns("plain"))
    log = _serve(only_signed, {"KILN_SIGNING_PUBLIC_KEY": public}, tmp_path / "a.log")
    assert "packages are verified against the public key" in log, log[-3000:]
    assert "version 1 ready in" in log and "engine code trusted: its signature verified" in log, log[-3000:]
    refused = _serve(repo, {"KILN_SIGNING_PUBLIC_KEY": public}, tmp_path / "b.log", expect_ready=False)
    assert "is not signed" in refused, refused[-3000:]
    # Without it both serve, and the log says the engine code was not trusted and why.
    log = _serve(repo, {}, tmp_path / "c.log")
    assert "no KILN_SIGNING_PUBLIC_KEY set: packages load untrusted" in log, log[-3000:]
    assert "engine code untrusted (no KILN_SIGNING_PUBLIC_KEY" in log, log[-3000:]


def _serve(repo: Path, env: dict[str, str], log: Path, *, expect_ready: bool = True) -> str:
    """`kiln serve triton run` in the background until its models answer (or it exits); its output."""
    http = free_port()
    full = {k: v for k, v in os.environ.items() if not k.startswith("KILN_SIGNING_")}
    full.update({"PYTHONPATH": str(ROOT), "COLUMNS": "250", **env})
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flows.cli", "serve", "triton", "run", "--repository", str(repo),
             "--http-port", str(http), "--grpc-port", str(free_port()), "--allow-op-module", "zoo.models"],
            env=full, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and proc.poll() is None:
            if f"serving {repo}" in log.read_text(errors="replace"):  # printed once the server is ready
                break
            time.sleep(0.5)
        assert (proc.poll() is None) == expect_ready, log.read_text(errors="replace")[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    return log.read_text(errors="replace")


def _content_hash(summary: dict) -> str:
    from compiler import read_manifest

    path = next(r["package"] for r in summary["models"] if r.get("package"))
    return read_manifest(path).content_hash


def _signer(private: Path):
    from compiler.package.signing import Signer

    return Signer(private)
