"""Typed errors of the MLflow side of kiln. Each names what was wrong and what to do about it."""

from __future__ import annotations

from compiler.errors import KilnError, PackageCorruptError


class RegistryError(KilnError):
    """The tracking server or model registry could not do what was asked."""


class RegistryUnavailableError(RegistryError):
    """The tracking server did not answer after every retry; the package on disk is untouched."""

    def __init__(self, message: str, *, run_id: str | None = None, package_dir: str | None = None):
        super().__init__(message)
        self.run_id = run_id
        self.package_dir = package_dir


class NoMatchingVersionError(RegistryError, LookupError):
    """No registered version fits a look-up; ``candidates`` says why each one did not."""

    def __init__(self, message: str, *, candidates: list[dict] | None = None):
        super().__init__(message)
        self.candidates = list(candidates or [])


class UnknownEngineTargetError(NoMatchingVersionError):
    """A ``--target`` that names no engine target registered for the model (``registry.targets``);
    ``registered`` lists the ones there are."""

    def __init__(self, message: str, *, registered: list[str] | None = None):
        super().__init__(message, candidates=[])
        self.registered = list(registered or [])


class ArtifactMissingError(RegistryError):
    """A registered version's artifact is gone from the artifact store."""


class ArtifactVerificationError(RegistryError, PackageCorruptError):
    """A downloaded artifact failed verification (checksums or content hash): it is refused."""


class ReleaseError(RegistryError):
    """A release or rollback cannot proceed (no such version, no ``previous`` alias, ...)."""
