"""``kiln signing init|check``: the pipeline's signing identity, made in one step and checked.

``init`` writes an EC P-256 key pair (``compiler.package.signing.new_key_pair``: the private key mode
0600, nothing existing replaced) and prints the variables to set: the private key on the workers that
compile and record (``compiler.save`` and ``registry.tracking`` sign), the public key wherever packages
are read (``kiln lookup``, ``kiln release``, ``kiln serve triton run`` and the Triton backend verify, and
run a verified package's engines as built: no compile at load). ``check`` says what this environment
signs and verifies with, and that the two keys belong together. deploy/README.md, "Signing".

Exit codes as everywhere: 0 ok, 2 unusable input (an existing key, an unreadable or mismatched one).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import typer
from rich.markup import escape

from flows.cli.options import JsonOut, SigningDir, SigningName, bad_input
from flows.render import console

signing_app = typer.Typer(help="The signing identity packages are signed and verified with.")


@signing_app.command("init")
def init_cmd(
    directory: SigningDir = ".kiln/signing", name: SigningName = "kiln-signing", as_json: JsonOut = False
) -> None:
    """Write a new signing key pair and print the environment variables that use it."""
    from compiler.errors import KilnError
    from compiler.package.signing import PRIVATE_KEY_ENV, PUBLIC_KEY_ENV, new_key_pair

    try:
        private, public = new_key_pair(directory, name)
    except KilnError as exc:
        raise bad_input(f"{type(exc).__name__}: {exc}") from None
    env = {PRIVATE_KEY_ENV: str(private), PUBLIC_KEY_ENV: str(public)}
    if as_json:
        print(json.dumps({"private_key": str(private), "public_key": str(public), "env": env}, indent=2))
        return
    console.print(
        f"[green]signing identity[/green]: {escape(str(private))} (private, mode 0600) and "
        f"{escape(str(public))} (public)\n"
        "workers that compile and record (kiln zoo, Prefect workers) sign with the private key:\n"
        f"  export {PRIVATE_KEY_ENV}={escape(str(private))}\n"
        "servers and look-ups (kiln lookup, kiln release, kiln serve triton run, KServe) verify with the "
        "public key, and run signed engines as built:\n"
        f"  export {PUBLIC_KEY_ENV}={escape(str(public))}\n"
        "Keep the private key on the workers only (a secret); the public key may go anywhere.",
        soft_wrap=True,
        highlight=False,
    )


@signing_app.command("check")
def check_cmd(as_json: JsonOut = False) -> None:
    """What this environment signs and verifies with; where both are set, that a signature made with the
    private key verifies with the public key (a throw-away package of one file)."""
    from compiler.errors import KilnError, PackageSignatureError, SigningConfigError
    from compiler.package.signing import (
        PRIVATE_KEY_ENV,
        PUBLIC_KEY_ENV,
        Signer,
        Trust,
        sign_package,
        verify_package,
    )

    try:
        signer, trust = Signer.from_env(), Trust.from_env()
        if signer is not None:
            signer.config()  # the key reads as an EC private key
        if trust is not None:
            trust.config()
        paired = None
        if signer is not None and trust is not None:
            with tempfile.TemporaryDirectory(prefix="kiln-signing-check-") as tmp:
                probe = Path(tmp) / "probe.kiln"
                probe.mkdir()
                (probe / "manifest.json").write_text("{}")
                sign_package(probe, signer)
                try:
                    verify_package(probe, trust)
                except PackageSignatureError as exc:
                    raise SigningConfigError(
                        f"{signer.describe()} and {trust.describe()} do not belong together: a signature "
                        f"made with {PRIVATE_KEY_ENV} does not verify with {PUBLIC_KEY_ENV} ({exc})"
                    ) from None
            paired = True
    except KilnError as exc:
        raise bad_input(f"{type(exc).__name__}: {exc}") from None
    summary = {
        "signs_with": signer.describe() if signer else None,
        "verifies_with": trust.describe() if trust else None,
        "pair_verified": paired,
    }
    if as_json:
        print(json.dumps(summary, indent=2))
        return
    signs = summary["signs_with"] or "nothing (saves and records are unsigned)"
    verifies = summary["verifies_with"] or "nothing (packages load untrusted: Inductor engines compile)"
    paired_line = "\n[green]a signature made with the private key verifies with the public key[/green]"
    console.print(
        f"signs with: {escape(signs)}\nverifies with: {escape(verifies)}" + (paired_line if paired else ""),
        soft_wrap=True,
        highlight=False,
    )


def register_commands(app: typer.Typer) -> None:
    app.add_typer(signing_app, name="signing")
