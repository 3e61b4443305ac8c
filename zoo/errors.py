"""Errors of the zoo layer: a zoo file, one of its entries or a model source is unusable."""

from __future__ import annotations

from compiler.errors import KilnError


class ZooConfigError(KilnError, ValueError):
    """A zoo file or one of its entries is invalid; the message names the field and the fix."""


class UntrustedCodeError(ZooConfigError):
    """A zoo file names code outside what docs/security.md trusts (a stdlib callable, a foreign module)."""


class SourceUnavailableError(KilnError):
    """A model source's hub or registry cannot be reached now (network, server down); retrying later
    may succeed, unlike a :class:`ZooConfigError`."""
