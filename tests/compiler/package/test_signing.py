"""Signed packages in OpenSSF model-signing's format (compiler/package/signing.py, docs/security.md):
signed at save and at record with a private key or a certificate, offline; verified by compiler.load,
read_manifest, kiln lookup and model-signing's own verifier; a verified package is trusted to run its
engines' code, an unsigned, tampered or foreign-signed one is refused where a verification key is set."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import compiler
from compiler.errors import PackageCorruptError, PackageSignatureError, SigningConfigError
from compiler.package.digest import content_hash
from compiler.package.signing import SIGNATURE, Signer, Trust, sign_package, verify_package
from tests.fixtures.signing_keys import certificate, ec_key_pair

ROOT = Path(__file__).resolve().parents[3]
FORMAT1 = ROOT / "tests" / "fixtures" / "packages" / "mlp-format1-2026-11.kiln"
PRIVATE, PUBLIC = "KILN_SIGNING_PRIVATE_KEY", "KILN_SIGNING_PUBLIC_KEY"


@pytest.fixture(scope="module")
def module():
    """A small format-2 module without a compile: the format-1 fixture package, loaded."""
    return compiler.load(FORMAT1, allowed_modules=["zoo"])


@pytest.fixture(scope="module")
def signed(module, keys, tmp_path_factory) -> Path:
    """The module saved with the release key set (and, beside it, unsigned), never changed by tests."""
    root = tmp_path_factory.mktemp("signed")
    with pytest.MonkeyPatch.context() as env:
        env.setenv(PRIVATE, str(keys["release"].private))
        compiler.save(module, root / "m.kiln")
    compiler.save(module, root / "unsigned.kiln")
    return root / "m.kiln"


def _change_weights(path: Path) -> None:
    """Change a file of the package (its last weight bytes); reseal() then makes it look unedited."""
    (path / "weights.safetensors").write_bytes((path / "weights.safetensors").read_bytes()[:-4] + b"\0\0\0\0")


def test_a_signed_save_verifies_in_kiln_and_in_model_signing(signed, keys, monkeypatch):
    """The signature is model-signing's: its own API and CLI verify it, over every file of the package;
    it is not listed in the manifest, whose content hash equals the unsigned save's."""
    import model_signing

    unsigned = compiler.read_manifest(signed.parent / "unsigned.kiln")
    manifest = compiler.read_manifest(signed)  # no verification key: the hash is what is checked
    assert manifest.content_hash == unsigned.content_hash and SIGNATURE not in manifest.files
    assert not (signed.parent / "unsigned.kiln" / SIGNATURE).exists()

    public = keys["release"].public
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public).verify(
        signed, signed / SIGNATURE
    )
    cli = [sys.executable, "-m", "model_signing", "verify", "key", str(signed)]
    done = subprocess.run(
        [*cli, "--signature", str(signed / SIGNATURE), "--public_key", str(public)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0 and "Verification succeeded" in done.stdout, done.stdout + done.stderr

    verified = verify_package(signed, Trust(public_key=public))
    listed = {"manifest.json", *manifest.files}
    assert set(verified.files) == listed  # every file of the package is signed, and nothing else
    envelope = json.loads((signed / SIGNATURE).read_text())["dsseEnvelope"]
    statement = json.loads(base64.b64decode(envelope["payload"]))
    assert statement["subject"][0]["name"] == "m.kiln"  # signed as the package it became, not its staging

    monkeypatch.setenv(PUBLIC, str(public))
    assert compiler.read_manifest(signed).content_hash == manifest.content_hash  # torch-free readers
    assert compiler.load(signed).trust_engine_code is True  # verified: trusted to run engine code


def test_unsigned_tampered_and_foreign_signatures_are_refused_where_a_key_is_set(
    signed, keys, tmp_path, monkeypatch, copy_package, reseal
):
    monkeypatch.setenv(PUBLIC, str(keys["release"].public))
    with pytest.raises(PackageSignatureError, match=r"is not signed \(model.sig is missing\)"):
        compiler.load(signed.parent / "unsigned.kiln")

    resealed = copy_package(signed, tmp_path / "resealed.kiln")
    _change_weights(resealed)
    reseal(resealed)
    # A resealed manifest is not the one signed: refused from model.sig alone, before any file is read.
    with pytest.raises(PackageSignatureError, match=r"manifest\.json read is not the one its signature"):
        compiler.load(resealed)
    added = copy_package(signed, tmp_path / "added.kiln")
    (added / "engines" / "extra.engine").write_bytes(b"x")  # never read by kiln, but not what was signed
    with pytest.raises(PackageSignatureError, match="Extra files"):
        compiler.read_manifest(added)
    monkeypatch.delenv(PUBLIC)
    compiler.load(resealed)  # what refused it was the signature: the hashes agree again

    monkeypatch.setenv(PUBLIC, str(keys["other"].public))
    with pytest.raises(PackageSignatureError, match="does not verify against the public key"):
        compiler.load(signed)
    # A signature by another key, placed by whoever can write the package: refused under the release key.
    foreign = copy_package(signed, tmp_path / "foreign.kiln")
    sign_package(foreign, Signer(keys["other"].private))
    monkeypatch.setenv(PUBLIC, str(keys["release"].public))
    with pytest.raises(PackageSignatureError, match="does not verify"):
        compiler.load(foreign)
    # The release key's signature of another package does not sign this one.
    moved = copy_package(signed.parent / "unsigned.kiln", tmp_path / "moved.kiln")
    resealed_sig = copy_package(signed, tmp_path / "other-content.kiln")
    _change_weights(resealed_sig)
    reseal(resealed_sig)
    sign_package(resealed_sig, Signer(keys["release"].private))
    shutil.copy(resealed_sig / SIGNATURE, moved / SIGNATURE)
    with pytest.raises(PackageSignatureError, match="is not the one its signature covers"):
        compiler.load(moved)


def test_nothing_a_package_names_is_acted_on_before_its_signature_verified(
    signed, keys, tmp_path, monkeypatch, copy_package
):
    """The signature is verified beside the load's file reads (both hash every file), and the load waits
    for the verdict before it acts on anything the package holds: a resealed manifest that names a module
    to import (one the caller allows) is refused by its signature, and the module is never imported."""
    marker = tmp_path / "imported"
    (tmp_path / "kiln_sig_probe_mod.py").write_text(f"open({str(marker)!r}, 'w').close()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    named = copy_package(signed, tmp_path / "names-a-module.kiln")
    data = json.loads((named / "manifest.json").read_text())
    data["op_modules"] = ["kiln_sig_probe_mod"]
    data["content_hash"] = content_hash(data)
    (named / "manifest.json").write_text(json.dumps(data))
    monkeypatch.setenv(PUBLIC, str(keys["release"].public))
    with pytest.raises(PackageSignatureError, match=r"manifest\.json read is not the one its signature"):
        compiler.load(named, allowed_modules=["kiln_sig_probe_mod"])
    assert not marker.exists() and "kiln_sig_probe_mod" not in sys.modules
    loaded = compiler.load(signed)  # the signed original: its signature's wait is a stage of the load
    assert loaded.trust_engine_code is True and loaded.load_seconds["signature"] >= 0


def test_the_manifest_used_is_the_one_signed(signed, keys, tmp_path):
    """kiln checks the manifest bytes it parses against the signed digest, not only the file on disk
    that model-signing hashed (a manifest swapped between the two is refused)."""
    trust = Trust(public_key=keys["release"].public)
    raw = (signed / "manifest.json").read_bytes()
    verify_package(signed, trust, manifest_bytes=raw)
    with pytest.raises(PackageSignatureError, match="is not the one its signature covers"):
        verify_package(signed, trust, manifest_bytes=raw + b" ")


def test_only_a_verified_format2_signature_is_implicit_trust(
    signed, keys, tmp_path, monkeypatch, copy_package
):
    """A verified signature makes a format-2 package trusted for engine code; a signed format-1 package
    (whose hash leaves its program out) is not, explicit trust_engine_code=False wins, and a signature
    nothing verified (no key set) is no trust at all."""
    old = copy_package(FORMAT1, tmp_path / "old.kiln")
    sign_package(old, Signer(keys["release"].private))
    monkeypatch.setenv(PUBLIC, str(keys["release"].public))
    assert compiler.load(old, allowed_modules=["zoo"]).trust_engine_code is False
    assert compiler.load(signed, trust_engine_code=False).trust_engine_code is False
    monkeypatch.delenv(PUBLIC)
    assert compiler.load(signed).trust_engine_code is False


def test_certificate_signatures_verify_against_their_root_only(module, keys, tmp_path, monkeypatch):
    ca, leaf = ec_key_pair(tmp_path, "ca"), ec_key_pair(tmp_path, "leaf")
    ca_cert = certificate(tmp_path, "kiln-ca", ca)
    leaf_cert = certificate(tmp_path, "kiln-release", leaf, issuer=ca, issuer_name="kiln-ca")
    other_root = certificate(tmp_path, "other-ca", keys["other"])
    monkeypatch.setenv(PRIVATE, str(leaf.private))
    monkeypatch.setenv("KILN_SIGNING_CERTIFICATE", str(leaf_cert))
    with pytest.raises(SigningConfigError, match="CERTIFICATE and KILN_SIGNING_CERTIFICATE_CHAIN go"):
        compiler.save(module, tmp_path / "m.kiln")
    monkeypatch.setenv("KILN_SIGNING_CERTIFICATE_CHAIN", str(ca_cert))
    compiler.save(module, tmp_path / "m.kiln")
    for name in (PRIVATE, "KILN_SIGNING_CERTIFICATE", "KILN_SIGNING_CERTIFICATE_CHAIN"):
        monkeypatch.delenv(name)
    monkeypatch.setenv("KILN_SIGNING_TRUSTED_CERTIFICATES", str(ca_cert))
    assert compiler.load(tmp_path / "m.kiln").trust_engine_code is True
    monkeypatch.setenv("KILN_SIGNING_TRUSTED_CERTIFICATES", str(other_root))
    with pytest.raises(PackageSignatureError, match="does not verify against the certificates"):
        compiler.load(tmp_path / "m.kiln")


def test_signing_configuration_errors_are_typed_and_name_the_fix(module, signed, keys, tmp_path, monkeypatch):
    # The retired HMAC key is refused, not ignored: it used to make unsigned packages fail to load.
    monkeypatch.setenv("KILN_SIGNING_KEY", "release-key")
    with pytest.raises(SigningConfigError, match=r"KILN_SIGNING_KEY is set.*KILN_SIGNING_PRIVATE_KEY"):
        compiler.load(signed)
    with pytest.raises(SigningConfigError, match="KILN_SIGNING_KEY"):
        compiler.save(module, tmp_path / "x.kiln")
    assert not (tmp_path / "x.kiln").exists()
    monkeypatch.delenv("KILN_SIGNING_KEY")
    monkeypatch.setenv(PUBLIC, str(keys["release"].public))
    monkeypatch.setenv("KILN_SIGNING_TRUSTED_CERTIFICATES", str(keys["release"].public))
    with pytest.raises(SigningConfigError, match="both KILN_SIGNING_PUBLIC_KEY and"):
        compiler.read_manifest(signed)
    monkeypatch.delenv("KILN_SIGNING_TRUSTED_CERTIFICATES")
    monkeypatch.setenv(PUBLIC, str(tmp_path / "missing.pub"))
    with pytest.raises(SigningConfigError, match=r"cannot verify with the public key .*missing\.pub"):
        compiler.read_manifest(signed)
    monkeypatch.delenv(PUBLIC)
    monkeypatch.setenv(PRIVATE, str(keys["release"].public))  # a public key where the private one goes
    with pytest.raises(SigningConfigError, match=r"cannot sign with the key .*release\.pub"):
        compiler.save(module, tmp_path / "x.kiln")
    with pytest.raises(PackageCorruptError, match=r"lists model\.sig"):
        data = json.loads((signed / "manifest.json").read_text())
        data["files"][SIGNATURE] = {"sha256": "0" * 64, "bytes": 1}
        from compiler.package.manifest import Manifest, check_layout

        check_layout(Manifest.from_json(data), "m.kiln")


def test_verification_needs_no_torch(signed, keys):
    """The one function a Triton model.py (or any manifest-level reader) calls before loading."""
    code = f"""
        import sys
        from compiler.package.signing import Trust, verify_package
        from compiler.package.check import read_manifest
        verified = verify_package({str(signed)!r}, Trust(public_key={str(keys["release"].public)!r}))
        read_manifest({str(signed)!r})
        assert "torch" not in sys.modules, "torch imported"
        print(len(verified.files))
    """
    env = {**os.environ, "PYTHONPATH": str(ROOT), PUBLIC: str(keys["release"].public)}
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(len(compiler.read_manifest(signed).files) + 1)  # and the manifest


def test_record_signs_what_it_uploads_and_lookup_verifies_it(
    mlflow_server, signed, keys, tmp_path, monkeypatch
):
    """kiln's registration signs the package it uploads (never the caller's directory); a look-up
    verifies the download before loading it, and trusts it only then."""
    import model_signing

    from registry.errors import ArtifactVerificationError
    from registry.lookup import lookup
    from registry.tracking import record_package

    unsigned = signed.parent / "unsigned.kiln"
    monkeypatch.setenv(PRIVATE, str(keys["release"].private))
    monkeypatch.setenv(PUBLIC, str(keys["release"].public))  # an unsigned package may be recorded to sign it
    record_package(unsigned, "signed_mlp")
    monkeypatch.delenv(PRIVATE)
    assert not (unsigned / SIGNATURE).exists()

    found = lookup("signed_mlp", dst=tmp_path / "v", allowed_modules=["zoo"])
    assert found.module.trust_engine_code is True and not found.fell_back
    public = keys["release"].public
    model_signing.verifying.Config().use_elliptic_key_verifier(public_key=public).verify(
        found.package_dir, found.package_dir / SIGNATURE
    )
    monkeypatch.setenv(PUBLIC, str(keys["other"].public))
    with pytest.raises(ArtifactVerificationError, match="does not verify against the public key"):
        lookup("signed_mlp", dst=tmp_path / "w", allowed_modules=["zoo"])
    monkeypatch.delenv(PUBLIC)
    assert lookup("signed_mlp", dst=tmp_path / "x", allowed_modules=["zoo"]).module.trust_engine_code is False


def test_the_report_says_whether_a_package_is_signed(signed):
    from compiler.package.report_page import render_package_report

    manifest = compiler.read_manifest(signed)
    assert f"yes: {SIGNATURE} (model-signing" in render_package_report(signed, manifest, "signed")
    unsigned = signed.parent / "unsigned.kiln"
    page = render_package_report(unsigned, compiler.read_manifest(unsigned), "unsigned")
    assert ">no<" in page and "model-signing" not in page.split('id="lineage"')[1].split("</table>")[0]
