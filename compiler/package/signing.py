"""Signed packages in OpenSSF model-signing's format: made with a private key (or a certificate and its
key), offline, and verified by kiln's loads, registry look-ups and any tool that verifies model-signing
signatures (``model_signing verify key PKG --signature PKG/model.sig --public_key KEY.pub``).

A package's signature is the file ``model.sig`` in the package directory: a Sigstore bundle whose DSSE
envelope carries an in-toto statement naming every file of the directory (``manifest.json`` and every
file the manifest lists) with its sha256. It is never listed in the manifest: it signs the manifest,
so the manifest's content hash cannot cover it. Signing twice gives different bytes (ECDSA) and the
same content hash, so registry idempotency is untouched.

:func:`verify_package` is the one verification every reader calls (``compiler.read_manifest``,
``compiler.load``, ``kiln lookup``, a Triton ``model.py``): it needs no torch, and imports
model-signing only when a signature is to be made or checked (``pip install 'kiln[signing]'``).

Configuration is read from the environment at each call (docs/security.md):

* signing: ``KILN_SIGNING_PRIVATE_KEY`` (an unencrypted PEM EC private key, P-256/384/521); with
  ``KILN_SIGNING_CERTIFICATE`` (its PEM certificate) and ``KILN_SIGNING_CERTIFICATE_CHAIN`` (the PEM
  certificates from its issuer up, ``os.pathsep``-separated) the bundle carries the certificate chain;
* verifying: ``KILN_SIGNING_PUBLIC_KEY`` (PEM public key) or ``KILN_SIGNING_TRUSTED_CERTIFICATES``
  (the PEM roots a signing certificate must chain to, ``os.pathsep``-separated); never both.

kiln's former HMAC signing (``KILN_SIGNING_KEY``) is gone: set, it is refused rather than ignored, so a
deployment that relied on it to refuse unsigned packages keeps refusing them until it is migrated.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import stat
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from compiler import json_reader
from compiler.errors import (
    PackageCorruptError,
    PackageSignatureError,
    SigningConfigError,
    UntrustedJsonError,
)

# SIGNATURE: model-signing's own default name for the signature file
from compiler.package.manifest import MANIFEST_FILE, SIGNATURE

PRIVATE_KEY_ENV = "KILN_SIGNING_PRIVATE_KEY"
CERTIFICATE_ENV = "KILN_SIGNING_CERTIFICATE"
CERTIFICATE_CHAIN_ENV = "KILN_SIGNING_CERTIFICATE_CHAIN"
PUBLIC_KEY_ENV = "KILN_SIGNING_PUBLIC_KEY"
TRUSTED_CERTIFICATES_ENV = "KILN_SIGNING_TRUSTED_CERTIFICATES"
LEGACY_HMAC_ENV = "KILN_SIGNING_KEY"

# A bundle names one digest per file: tens of KiB for thousands of files. The bound keeps a hostile
# file from being read into memory whole.
MAX_SIGNATURE_BYTES = 16 * 2**20
_PREDICATE_TYPE = "https://model_signing/signature/v1.0"
_INSTALL = "install it with `pip install 'kiln[signing]'` (model-signing)"


def _model_signing(why: str) -> ModuleType:
    try:
        import model_signing
    except ImportError as exc:
        raise SigningConfigError(f"{why} needs the model-signing library, not installed: {_INSTALL}") from exc
    return model_signing


def _refuse_legacy_hmac(environ: Mapping[str, str] | None = None) -> None:
    if (os.environ if environ is None else environ).get(LEGACY_HMAC_ENV):
        raise SigningConfigError(
            f"{LEGACY_HMAC_ENV} is set, but kiln's HMAC signing was replaced by model-signing signatures: "
            f"unset it, sign with {PRIVATE_KEY_ENV} (a PEM EC private key) and verify with "
            f"{PUBLIC_KEY_ENV} (its public key) or {TRUSTED_CERTIFICATES_ENV}; until then kiln refuses to "
            "load or save rather than treat every package as unsigned (docs/security.md, Signing)"
        )


def _paths(value: str) -> tuple[Path, ...]:
    return tuple(Path(p) for p in value.split(os.pathsep) if p)


@dataclass(frozen=True)
class Signer:
    """What signs: an EC private key, optionally with its certificate and the chain above it."""

    private_key: Path
    certificate: Path | None = None
    chain: tuple[Path, ...] = ()

    @classmethod
    def from_env(cls) -> Signer | None:
        """The signer ``$KILN_SIGNING_PRIVATE_KEY`` (and the certificate variables) configure, or None."""
        _refuse_legacy_hmac()
        key = os.environ.get(PRIVATE_KEY_ENV, "")
        certificate = os.environ.get(CERTIFICATE_ENV, "")
        chain = _paths(os.environ.get(CERTIFICATE_CHAIN_ENV, ""))
        if not key:
            if certificate or chain:
                raise SigningConfigError(
                    f"{CERTIFICATE_ENV}/{CERTIFICATE_CHAIN_ENV} are set but {PRIVATE_KEY_ENV} is not: a "
                    "certificate signs with its private key; set it too, or unset the certificate"
                )
            return None
        if bool(chain) != bool(certificate):
            raise SigningConfigError(
                f"{CERTIFICATE_ENV} and {CERTIFICATE_CHAIN_ENV} go together: the signing certificate, and "
                "the certificates from its issuer up to the root (model-signing's certificate signer "
                "needs at least the issuer's)"
            )
        return cls(Path(key), Path(certificate) if certificate else None, chain)

    def describe(self) -> str:
        return f"the certificate {self.certificate}" if self.certificate else f"the key {self.private_key}"

    def config(self) -> Any:
        """model-signing's signing configuration: every file of the directory but the signature."""
        if self.certificate is not None and not self.chain:
            raise SigningConfigError(f"{self.describe()} signs with its chain: set {CERTIFICATE_CHAIN_ENV}")
        ms = _model_signing("signing a package")
        try:
            if self.certificate is None:
                config = ms.signing.Config().use_elliptic_key_signer(private_key=self.private_key)
            else:
                config = ms.signing.Config().use_certificate_signer(
                    private_key=self.private_key,
                    signing_certificate=self.certificate,
                    certificate_chain=self.chain,
                )
        except Exception as exc:  # unreadable file, not PEM, not an EC key, key and certificate differ
            raise SigningConfigError(
                f"cannot sign with {self.describe()}: {type(exc).__name__}: {exc}. {PRIVATE_KEY_ENV} must "
                "name an unencrypted PEM EC private key (P-256, P-384 or P-521), and a certificate must be "
                "that key's"
            ) from exc
        return config.set_hashing_config(ms.hashing.Config().set_ignored_paths(paths=[SIGNATURE]))


@dataclass(frozen=True)
class Trust:
    """What a signature must verify against: one public key, or certificate roots."""

    public_key: Path | None = None
    certificates: tuple[Path, ...] = ()

    def __post_init__(self) -> None:
        if (self.public_key is None) == (not self.certificates):
            raise SigningConfigError("trust is a public key or certificate roots, exactly one of them")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Trust | None:
        """The trust ``$KILN_SIGNING_PUBLIC_KEY`` or ``$KILN_SIGNING_TRUSTED_CERTIFICATES`` configures,
        or None (nothing to verify against: packages are untrusted data). ``environ``: another process's
        environment (a server's), by default this one's."""
        environ = os.environ if environ is None else environ
        _refuse_legacy_hmac(environ)
        key = environ.get(PUBLIC_KEY_ENV, "")
        roots = _paths(environ.get(TRUSTED_CERTIFICATES_ENV, ""))
        if key and roots:
            raise SigningConfigError(
                f"both {PUBLIC_KEY_ENV} and {TRUSTED_CERTIFICATES_ENV} are set: a package is verified "
                "against one of them; unset the other"
            )
        if key:
            return cls(public_key=Path(key))
        return cls(certificates=roots) if roots else None

    def describe(self) -> str:
        if self.public_key is not None:
            return f"the public key {self.public_key}"
        return f"the certificates {', '.join(map(str, self.certificates))}"

    def config(self) -> Any:
        ms = _model_signing("verifying a package's signature")
        try:
            if self.public_key is not None:
                return ms.verifying.Config().use_elliptic_key_verifier(public_key=self.public_key)
            # Never empty: model-signing would fall back to the system's web roots, which any public
            # CA's customer chains to.
            return ms.verifying.Config().use_certificate_verifier(certificate_chain=self.certificates)
        except Exception as exc:
            raise SigningConfigError(
                f"cannot verify with {self.describe()}: {type(exc).__name__}: {exc}. {PUBLIC_KEY_ENV} must "
                f"name a PEM EC public key, {TRUSTED_CERTIFICATES_ENV} PEM certificates"
            ) from exc


@dataclass(frozen=True)
class VerifiedSignature:
    """A package whose ``model.sig`` verified: who vouched for it and the sha256 of each signed file."""

    path: Path
    trust: Trust
    files: dict[str, str]


def sign_package(path: str | os.PathLike, signer: Signer | None = None) -> Path:
    """Sign the package directory at ``path`` (every file in it but the signature): writes
    ``path/model.sig`` atomically and returns its path. ``signer``: by default the environment's.

    This vouches for the directory as it is: callers check the package first (``compiler.save`` wrote
    it, ``registry.tracking`` verified it)."""
    signer = signer or Signer.from_env()
    if signer is None:
        raise SigningConfigError(f"nothing to sign with: set {PRIVATE_KEY_ENV} to a PEM EC private key")
    config = signer.config()
    path = Path(path)
    # Written beside the package, never inside it (it would be hashed), then moved in whole.
    tmp = path.parent / f".{path.name}.sig-{uuid.uuid4().hex[:8]}"
    try:
        try:
            config.sign(path, tmp)
        except Exception as exc:  # a symlink or unreadable file in the package
            raise PackageCorruptError(f"cannot sign {path}: {type(exc).__name__}: {exc}") from exc
        os.replace(tmp, path / SIGNATURE)
    finally:
        tmp.unlink(missing_ok=True)
    return path / SIGNATURE


def verify_package(
    path: str | os.PathLike, trust: Trust | None = None, *, manifest_bytes: bytes | None = None
) -> VerifiedSignature:
    """Verify the package at ``path`` against ``trust`` (by default the environment's): its
    ``model.sig`` is a model-signing signature by that key (or a certificate chaining to those roots)
    over exactly the files in the directory, as ``model_signing verify`` checks it, and it covers
    ``manifest.json``. ``manifest_bytes``: the manifest as the caller read it (and will use), which must
    be the signed one; otherwise it is read here.

    Refusals are :class:`PackageSignatureError` (unsigned, another signer, a file changed, added or
    removed after signing); a configuration that cannot verify is a :class:`SigningConfigError`.
    Needs no torch. The manifest's own checks (content hash, file checksums) are the caller's
    (``compiler.read_manifest`` makes them all). :func:`verify_signer` is its first half alone."""
    path = Path(path)
    trust = trust or Trust.from_env()
    if trust is None:
        raise SigningConfigError(
            f"nothing to verify against: set {PUBLIC_KEY_ENV} or {TRUSTED_CERTIFICATES_ENV}, or pass trust"
        )
    config = trust.config()
    raw = _read_signature(path, trust)
    if manifest_bytes is None:
        manifest_bytes = _read_plain(path / MANIFEST_FILE, path)
    # model-signing reads the signature from a path: hand it a private copy of the bytes parsed below,
    # so the signature it verifies is the one whose statement kiln then reads.
    with _private_copy(raw, path) as copy:
        try:
            config.verify(path, copy)
        except Exception as exc:  # any failure to verify is a refusal: the library raises several types
            raise _refusal(path, trust, exc) from exc
    files = _signed_files(raw, path)
    _check_manifest_signed(files, manifest_bytes, path)
    return VerifiedSignature(path, trust, files)


def verify_signer(path: str | os.PathLike, trust: Trust, *, manifest_bytes: bytes) -> dict[str, str]:
    """The half of :func:`verify_package` that reads ``model.sig`` and nothing else of the package: the
    signature verifies against ``trust`` and its statement covers ``manifest_bytes`` (file -> sha256 of
    the statement). A load makes this check before it reads any other file, so an unsigned package,
    or one signed by another key, is refused having read only its manifest and ``model.sig``; the
    manifest then binds every file the load reads by size and sha256, and :func:`verify_package` (the
    directory against the statement: no file more or fewer) runs beside those reads."""
    path = Path(path)
    config = trust.config()
    raw = _read_signature(path, trust)
    with _private_copy(raw, path) as copy:
        try:
            # model-signing's own first step of Config.verify (the envelope's signature by the key or
            # certificate, then its payload), without the hashing of the directory that follows it.
            from model_signing._signing import sign_sigstore_pb

            verifier = config._verifier
        except (ImportError, AttributeError) as exc:  # model-signing's layout moved: fail closed, loudly
            raise SigningConfigError(
                f"this model-signing has no signature verifier kiln can call on its own ({exc}); "
                "install the version constraints.txt names"
            ) from exc
        try:
            verifier.verify(sign_sigstore_pb.Signature.read(copy))
        except Exception as exc:
            raise _refusal(path, trust, exc) from exc
    files = _signed_files(raw, path)
    _check_manifest_signed(files, manifest_bytes, path)
    return files


class _private_copy:
    """The signature's bytes in a private temporary file, for model-signing (which reads a path)."""

    def __init__(self, raw: bytes, path: Path) -> None:
        self._raw, self._tmp = raw, tempfile.TemporaryDirectory(prefix="kiln-signature-")
        # Bounded before model-signing's own json.loads parses it (depth, integers).
        try:
            json_reader.loads(raw, f"{path / SIGNATURE}", max_bytes=MAX_SIGNATURE_BYTES)
        except UntrustedJsonError as exc:
            self._tmp.cleanup()
            raise PackageSignatureError(f"{path}: {SIGNATURE} is not a signature kiln reads: {exc}") from exc

    def __enter__(self) -> Path:
        copy = Path(self._tmp.name) / SIGNATURE
        copy.write_bytes(self._raw)
        return copy

    def __exit__(self, *exc: object) -> None:
        self._tmp.cleanup()


def _refusal(path: Path, trust: Trust, exc: Exception) -> PackageSignatureError:
    return PackageSignatureError(
        f"{path}: its signature ({SIGNATURE}) does not verify against {trust.describe()} "
        f"({type(exc).__name__}: {exc}): it was signed by another key, or a file of the package "
        "was changed, added or removed after signing; refused"
    )


def _check_manifest_signed(files: dict[str, str], manifest_bytes: bytes, path: Path) -> None:
    # The manifest kiln uses must be the signed one: its checksums then bind every other file kiln
    # reads, even should the directory change after model-signing hashed it.
    if files.get(MANIFEST_FILE) != hashlib.sha256(manifest_bytes).hexdigest():
        raise PackageSignatureError(
            f"{path}: the {MANIFEST_FILE} read is not the one its signature covers (edited after signing, "
            "changed during the load, or left out of the signature); refused"
        )


def _read_signature(path: Path, trust: Trust) -> bytes:
    file = path / SIGNATURE
    try:
        info = file.lstat()
    except FileNotFoundError:
        raise PackageSignatureError(
            f"{path} is not signed ({SIGNATURE} is missing), and kiln verifies against {trust.describe()}: "
            f"only signed packages load. Sign it where it is recorded or saved ({PRIVATE_KEY_ENV})"
        ) from None
    if not stat.S_ISREG(info.st_mode):
        raise PackageSignatureError(f"{path}: {SIGNATURE} is not a plain file (a symlink?); refused")
    if info.st_size > MAX_SIGNATURE_BYTES:
        raise PackageSignatureError(
            f"{path}: {SIGNATURE} is {info.st_size} bytes, more than any signature ({MAX_SIGNATURE_BYTES})"
        )
    with open(file, "rb") as f:
        return f.read(MAX_SIGNATURE_BYTES + 1)


def _read_plain(file: Path, path: Path) -> bytes:
    if file.is_symlink() or not file.is_file():
        raise PackageCorruptError(f"{path}: {file.name} is missing or not a plain file")
    return file.read_bytes()


def _signed_files(raw: bytes, path: Path) -> dict[str, str]:
    """File -> sha256 from the statement of a signature model-signing has just verified."""
    try:
        bundle = json_reader.loads(raw, str(path / SIGNATURE), max_bytes=MAX_SIGNATURE_BYTES)
        payload = base64.b64decode(bundle["dsseEnvelope"]["payload"], validate=True)
        statement = json_reader.loads(payload, f"{path / SIGNATURE}: its statement", max_bytes=len(payload))
        if statement["predicateType"] != _PREDICATE_TYPE:
            raise ValueError(f"predicate type {statement['predicateType']!r}")
        files = {}
        for resource in statement["predicate"]["resources"]:
            if resource["algorithm"] != "sha256":
                raise ValueError(f"{resource['name']!r} is hashed with {resource['algorithm']!r}")
            files[str(resource["name"])] = str(resource["digest"])
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise PackageSignatureError(
            f"{path}: {SIGNATURE} verified but its statement is not model-signing's v1.0 by sha256 "
            f"({type(exc).__name__}: {exc}); kiln reads sha256 file signatures only"
        ) from exc
    return files


def new_key_pair(directory: str | os.PathLike, name: str = "kiln-signing") -> tuple[Path, Path]:
    """A fresh signing identity: an EC P-256 key pair written as ``directory/<name>.pem`` (the unencrypted
    PKCS#8 private key, mode 0600: for ``$KILN_SIGNING_PRIVATE_KEY`` on the workers that record) and
    ``directory/<name>.pub`` (its public key, for ``$KILN_SIGNING_PUBLIC_KEY`` where packages are read).
    (private, public), absolute.

    An existing file of either name is never replaced (a lost private key would orphan every package
    it signed): SigningConfigError naming it. Both files appear whole or not at all."""
    try:
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ec
    except ImportError as exc:
        raise SigningConfigError(f"making a signing key needs the cryptography library: {_INSTALL}") from exc
    folder = Path(directory).resolve()
    if not name or Path(name).name != name or name.startswith("."):
        raise SigningConfigError(f"key name {name!r}: a plain file name (no folder), e.g. kiln-signing")
    private, public = folder / f"{name}.pem", folder / f"{name}.pub"
    for path in (private, public):
        if os.path.lexists(path):
            raise SigningConfigError(
                f"{path} exists: kiln never replaces a signing key (packages it signed would no longer "
                "verify); use it, move it away, or choose another --dir or --name"
            )
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # a new folder: the pipeline account's alone
    key = ec.generate_private_key(ec.SECP256R1())
    contents = {
        private: key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        ),
        public: key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        ),
    }
    made: list[Path] = []
    try:
        for path, data in contents.items():
            tmp = folder / f".{path.name}.{uuid.uuid4().hex[:8]}"
            # Created with its final mode: the private key is never readable by others, even briefly.
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600 if path == private else 0o644)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.link(tmp, path)  # fails if the name appeared meanwhile: nothing is replaced
                made.append(path)
            finally:
                tmp.unlink(missing_ok=True)
    except OSError as exc:
        for path in made:
            path.unlink(missing_ok=True)
        raise SigningConfigError(f"cannot write the signing key pair in {folder}: {exc}") from exc
    return private, public


def trust_note(package_dir: str | os.PathLike, trusted: bool | None) -> str:
    """One line saying whether a load trusted the package's engine code and why: a verified signature,
    or what is missing (no verification key in this process's environment, an unsigned package, an
    explicit ``trust_engine_code``). Untrusted Inductor engines are compiled at load (docs/security.md)."""
    if trusted is None:
        return "engine code: not a kiln package load"
    signed = (Path(package_dir) / SIGNATURE).is_file()
    try:
        trust = Trust.from_env()
    except SigningConfigError as exc:
        trust, problem = None, str(exc)
    else:
        problem = ""
    if trusted and trust is not None:
        return f"engine code trusted: its signature verified against {trust.describe()}, so it runs as built"
    if trusted:
        return "engine code trusted by the caller (trust_engine_code=True); no signature checked"
    if trust is not None:
        why = "a format-1 package, whose hash leaves its program out (re-save it), or trust_engine_code=False"
    elif problem:
        why = problem
    else:
        why = f"no {PUBLIC_KEY_ENV} (or {TRUSTED_CERTIFICATES_ENV}) in this process's environment, so " + (
            "its signature was not checked" if signed else "nothing vouches for it (it is unsigned, too)"
        )
    return f"engine code untrusted ({why}): Inductor engines are compiled here from their programs"
