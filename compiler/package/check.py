"""Reading and checking a package on disk: its manifest and the files it lists, without torch.

:func:`read_manifest` is what a caller that only needs to know what a package holds and that it is
intact uses (the no-op check of an unchanged zoo, ``kiln report``, registration): the format version,
the content hash, the signature (where a verification key is configured:
:mod:`compiler.package.signing`), the layout, no symlinks and every listed file's checksum, exactly as
:func:`compiler.load` checks them before it uses a byte.
:mod:`compiler.package.save_load` loads and saves with these same functions.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from compiler import json_reader
from compiler.errors import PackageCorruptError, PackageJsonError, PackageVersionError
from compiler.package import chunks
from compiler.package.digest import content_hash
from compiler.package.manifest import FORMAT_VERSION, MANIFEST_FILE, PROGRAM, Manifest, check_layout
from compiler.package.signing import Trust, VerifiedSignature, verify_package, verify_signer
from compiler.version import kiln_version


def read_manifest(path: str | os.PathLike, *, verify: bool = True, signature: bool = True) -> Manifest:
    """The package's manifest, after checking its format version and (by default) its content hash,
    signature (where ``$KILN_SIGNING_PUBLIC_KEY`` or trusted certificates are set), layout and every
    file's checksum. ``signature=False`` leaves the signature out, for a caller about to sign the
    package itself (registration with a signing key)."""
    path = Path(path)
    manifest = checked_manifest(path, verify=verify, signature=signature)
    if verify:
        for rel in manifest.files:
            read_verified(path, rel, manifest)
    return manifest


def checked_manifest(
    path: Path, *, verify: bool, signature: bool = True, trust: Trust | None = None
) -> Manifest:
    """The typed manifest: version checked; with ``verify``, hash, signature (unless ``signature`` is
    False; against ``trust``, by default the environment's, where there is one), layout and no symlinks.

    File checksums are checked where each file is read (:func:`read_verified`).
    """
    manifest, signature_check = manifest_and_signature(path, verify=verify, signature=signature, trust=trust)
    if signature_check is not None:
        signature_check()
    return manifest


def manifest_and_signature(
    path: Path, *, verify: bool, signature: bool = True, trust: Trust | None = None
) -> tuple[Manifest, Callable[[], VerifiedSignature] | None]:
    """:func:`checked_manifest` with its signature check handed back, not yet run (None where there is
    none to make): a load runs it beside its file reads and waits for it before it acts on anything
    the package holds (model-signing hashes every file, as the load's own checks do: 1.1 s for 1 GB on
    the 2-core CPU here). The check verifies the very manifest bytes parsed here."""
    manifest_path, signature_check = path / MANIFEST_FILE, None
    if manifest_path.is_symlink():
        raise PackageCorruptError(f"{manifest_path} is a symlink; a package holds plain files only")
    if not manifest_path.is_file():
        raise PackageCorruptError(f"{path} is not a kiln package: {MANIFEST_FILE} is missing")
    raw = _read_manifest_bytes(manifest_path)  # read once: these bytes are hashed, verified and parsed
    trust = (trust or Trust.from_env()) if verify and signature else None
    if trust is not None:
        # The signer first, from model.sig alone: an unsigned package, or another key's, is refused
        # before its manifest is parsed or any other file is read (nor is a hostile manifest's parse
        # error what a deployment with a key sees).
        verify_signer(path, trust, manifest_bytes=raw)
    data = json_reader.loads(raw, str(manifest_path), error=PackageJsonError)
    version = data.get("format_version") if isinstance(data, dict) else None
    if not isinstance(version, int) or isinstance(version, bool):
        raise PackageCorruptError(f"{manifest_path} has no integer format_version")
    if version > FORMAT_VERSION:
        raise PackageVersionError(
            f"{path} was written by package format {version} (kiln {data.get('kiln_version')}); this kiln "
            f"({kiln_version()}) reads formats <= {FORMAT_VERSION}: upgrade kiln to load it"
        )
    if verify:
        try:
            expected = content_hash(data)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise PackageCorruptError(f"{manifest_path} lacks a field every package has: {exc}") from exc
        if data.get("content_hash") != expected:
            raise PackageCorruptError(
                f"{manifest_path} does not match its content_hash: the manifest was edited after saving"
            )
        if trust is not None:  # none configured: the package is untrusted data
            signature_check = functools.partial(verify_package, path, trust, manifest_bytes=raw)
    manifest = Manifest.from_json(data)
    if version < 2 and (path / PROGRAM).is_file() and not (path / PROGRAM).is_symlink():
        # Format 1 recorded the op modules inside the program archive (data, never imported here).
        from compiler.program.export import recorded_modules  # torch: format-1 packages only

        manifest = dataclasses.replace(
            manifest, op_modules=tuple(recorded_modules((path / PROGRAM).read_bytes()))
        )
    if verify:
        check_layout(manifest, str(path))
        check_no_symlinks(path)
    return manifest, signature_check


def _read_manifest_bytes(manifest_path: Path) -> bytes:
    try:
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        with os.fdopen(os.open(manifest_path, flags), "rb") as file:
            size = os.fstat(file.fileno()).st_size
            if size > json_reader.MAX_BYTES:  # checked before a byte is read or allocated
                raise PackageJsonError(
                    f"{manifest_path} is {size} bytes, more than the {json_reader.MAX_BYTES} a manifest may "
                    "have; refused"
                )
            return file.read(json_reader.MAX_BYTES + 1)
    except OSError as exc:
        raise PackageCorruptError(f"{manifest_path} cannot be read: {exc}") from exc


def read_verified(path: Path, rel: str, manifest: Manifest) -> bytes:
    """The bytes of a listed file, read once and checked against the manifest's checksum."""
    record = manifest.files.get(rel)
    with open_listed(path, rel, manifest) as file:
        data = file.read(record.bytes + 1)  # one byte more than listed: a longer file is refused
    if len(data) != record.bytes:
        raise checksum_error(path, rel, manifest)
    if record.chunks:  # its pieces' digests, checked on several threads (compiler.package.chunks)
        if not chunks.matches(data, record.chunk_bytes, record.chunks):
            raise checksum_error(path, rel, manifest)
    elif hashlib.sha256(data).hexdigest() != record.sha256:
        raise checksum_error(path, rel, manifest)
    return data


def open_listed(path: Path, rel: str, manifest: Manifest) -> BinaryIO:
    """A listed file of the package, opened for reading: a plain file (no symlink, not even as its last
    component) of the listed length, else PackageCorruptError. Its bytes are the caller's to check
    (:func:`checksum_error`)."""
    if manifest.files.get(rel) is None:
        raise PackageCorruptError(f"{path}: {rel} is not listed in the manifest; refused")
    try:
        # O_NONBLOCK: a FIFO in its place must not hang the open (regular files ignore the flag)
        flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
        fd = os.open(path / rel, flags)
    except FileNotFoundError:
        raise PackageCorruptError(f"{path}: file {rel} listed in the manifest is missing") from None
    except OSError as exc:  # ELOOP: the name is a symlink
        raise PackageCorruptError(f"{path}: {rel} is not a plain file (a symlink?); refused") from exc
    file = os.fdopen(fd, "rb")
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        file.close()
        raise PackageCorruptError(f"{path}: {rel} is not a plain file (a symlink?); refused")
    if info.st_size != manifest.files[rel].bytes:  # nothing is read, or allocated, for bytes not there
        file.close()
        raise checksum_error(path, rel, manifest)
    return file


def checksum_error(path: Path, rel: str, manifest: Manifest) -> PackageCorruptError:
    record = manifest.files[rel]
    return PackageCorruptError(
        f"{path}: file {rel} does not match its checksum (expected sha256 {record.sha256[:16]}..., "
        f"{record.bytes} bytes); the package is corrupt or was modified"
    )


def check_no_symlinks(path: Path) -> None:
    for root, dirs, names in os.walk(path, followlinks=False):
        for name in dirs + names:
            if os.path.islink(os.path.join(root, name)):
                rel = os.path.relpath(os.path.join(root, name), path)
                raise PackageCorruptError(f"{path}: {rel} is a symlink; a package holds plain files only")
