"""Typed errors of the Triton serving path. Each names what was wrong and what to do about it."""

from __future__ import annotations

from compiler.errors import KilnError


class TritonError(KilnError):
    """Base of the errors ``serving.triton`` raises on purpose."""


class TritonConfigError(TritonError, ValueError):
    """A package cannot be described to Triton: a dtype Triton has no type for (named input or output),
    an output that is not a tensor, a bad option (instances, queue delay)."""


class NoChampionError(TritonError, LookupError):
    """A model to serve has no ``champion`` alias; ``aliases`` are the ones it has."""

    def __init__(self, message: str, *, registered_model: str, aliases: dict[str, str]):
        super().__init__(message)
        self.registered_model = registered_model
        self.aliases = dict(aliases)


class RepositoryError(TritonError):
    """The model repository cannot be used: missing, not a directory, unreadable or unwritable, or a
    model folder kiln did not write."""


class RepositoryBusyError(RepositoryError):
    """Another release or rollback is updating this model in this repository right now."""


class TritonNotFoundError(TritonError):
    """No ``tritonserver`` binary (``$KILN_TRITONSERVER``, nvidia-pytriton's, or on PATH)."""


class ServerUnavailableError(TritonError):
    """The server did not answer (connection refused, or no answer within the named timeout)."""


class ServerRefusedError(TritonError):
    """The server answered with an error (a model it would not load, a request it refused)."""

    def __init__(self, message: str, *, status: int | None = None, server_message: str = ""):
        super().__init__(message)
        self.status = status
        self.server_message = server_message


class ServerStartError(TritonError):
    """``tritonserver`` exited or did not become ready; the message carries the end of its log."""
