"""Engine targets as a person types them: the one place that turns ``--target`` into a registered name.

A version is registered as ``kiln.<model>.<engine target>``, the target spelled for a name
(``cpu``, ``cuda_sm_90``; :func:`registry.models.registered_model_name`). Nobody types ``cuda_sm_90``:
every command that takes ``--target`` (``kiln lookup``, ``release``, ``rollback``, ``report``, ``serve
triton export``) resolves it here, against the targets registered for the model:

- a registered target, in either spelling (``cuda:sm_90`` or ``cuda_sm_90``, ``cpu``): itself;
- ``cuda`` (no architecture): on a host with a GPU, the target built for that GPU's compute capability
  (``cuda_sm_90`` on an H100; a target naming several architectures counts when it names this one); on
  a host without a GPU, where exports and releases usually run, the model's CUDA target if it has
  exactly one;
- no ``--target`` at all: the model's one registered target; with several, this host's (``cuda`` on a
  host with a GPU where a CUDA target is registered, else ``cpu``);
- anything else, or ``cuda`` with none or several to choose from: :class:`UnknownEngineTargetError`,
  which lists the targets registered for the model and what to type.

Where a model runs is its device (``cpu``, ``cuda``, ``cuda:1``: zoo entries, ``kiln compile
--device``); what its engines are built for is its engine target: this module maps the one a person
knows (the device family) to the other.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Sequence
from typing import Any

from registry.config import RetryPolicy, call_with_retry
from registry.errors import UnknownEngineTargetError
from registry.models import PREFIX, registered_model_name

CUDA = "cuda"
_ARCH = re.compile(r"sm_\d+")
_LOOKED_UP = object()  # resolve_target's gpu: ask torch (the default)


def target_part(target: str) -> str:
    """``cuda:sm_90`` -> ``cuda_sm_90``: a target as the registered name spells it."""
    return registered_model_name("m", target).rsplit(".", 1)[1]


def local_gpu() -> str | None:
    """This host's GPU compute capability (``sm_90``), or None without one (or without torch)."""
    if importlib.util.find_spec("torch") is None:
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def registered_targets(mlclient: Any, model: str, policy: RetryPolicy | None = None) -> list[str]:
    """The engine targets ``model`` has registered models for (``["cpu", "cuda_sm_90"]``), sorted."""
    prefix = registered_model_name(model, "x").removesuffix("x")

    def search() -> list[str]:
        # LIKE's "_" matches any character: the prefix test below is the exact one.
        found, token = [], None
        while True:
            page = mlclient.search_registered_models(
                filter_string=f"name LIKE '{prefix}%'", max_results=1000, page_token=token
            )
            found += [m.name for m in page]
            token = page.token
            if not token:
                return found

    names = call_with_retry(search, f"list the registered models of {model!r}", policy)
    return sorted({name[len(prefix) :] for name in names if name.startswith(prefix)})


def resolve_target(model: str, target: str | None, registered: Sequence[str], gpu: Any = _LOOKED_UP) -> str:
    """The registered target ``target`` names for ``model`` (see the module docstring), given the
    targets ``registered`` for it; ``gpu``: this host's compute capability (``sm_90``, None for no
    GPU), looked up with torch when not given and only when ``target`` is a bare ``cuda`` or None."""
    if target is None:  # no --target: the model's one target, else this host's device family
        if len(registered) == 1:
            return registered[0]
        if registered:
            gpu = local_gpu() if gpu is _LOOKED_UP else gpu
            has_cuda = any(t.startswith(CUDA + "_") for t in registered)
            target = CUDA if gpu is not None and has_cuda else "cpu"
        else:
            target = "cpu"  # nothing registered: the error below says so
    try:
        typed = target_part(target)
    except ValueError:
        typed = ""
    if typed and typed in registered:
        return typed
    listing = ", ".join(registered) if registered else "none"
    if not registered:
        raise UnknownEngineTargetError(
            f"nothing is registered for {model!r} (no {PREFIX}.{model_part(model)}.* registered model); "
            "compile and record it first (kiln zoo), or check the model name",
            registered=[],
        )
    if typed != CUDA:
        raise UnknownEngineTargetError(
            f"engine target {target!r} matches nothing registered for {model!r}; registered targets: "
            f"{listing}. Pass one of them with --target (cuda: this machine's GPU)",
            registered=list(registered),
        )
    cuda = [t for t in registered if t.startswith(CUDA + "_")]
    if gpu is _LOOKED_UP:
        gpu = local_gpu()
    if gpu is not None:
        fits = [t for t in cuda if gpu in _ARCH.findall(t)]
        exact = f"{CUDA}_{gpu}"
        if exact in fits or len(fits) == 1:
            return exact if exact in fits else fits[0]
        why = f"none is built for this machine's GPU ({gpu})" if not fits else f"several fit {gpu}"
    elif len(cuda) == 1:
        return cuda[0]
    else:
        why = "this host has no GPU to choose by, and " + (
            "no CUDA target is registered" if not cuda else f"{len(cuda)} CUDA targets are registered"
        )
    raise UnknownEngineTargetError(
        f"engine target 'cuda' for {model!r}: {why}; registered targets: {listing}. Pass one with --target "
        f"(e.g. --target {typed_target(cuda[0]) if cuda else 'cpu'})",
        registered=list(registered),
    )


def resolve_engine_target(
    mlclient: Any, model: str, target: str | None, policy: RetryPolicy | None = None, gpu: Any = _LOOKED_UP
) -> str:
    """:func:`resolve_target` against the registry: the target of ``model``'s registered name."""
    return resolve_target(model, target, registered_targets(mlclient, model, policy), gpu)


def resolved_model_name(
    mlclient: Any, model: str, target: str | None, policy: RetryPolicy | None = None
) -> str:
    """``kiln.<model>.<target>`` for the registered target ``target`` resolves to."""
    return registered_model_name(model, resolve_engine_target(mlclient, model, target, policy))


def model_part(model: str) -> str:
    """The model part of a registered name (``My Model`` -> ``my_model``)."""
    return registered_model_name(model, "x").split(".")[1]


def typed_target(part: str) -> str:
    """``cuda_sm_90`` -> ``cuda:sm_90``: how a person writes it (the engine target's own spelling)."""
    family, _, rest = part.partition("_")
    return f"{family}:{rest}" if rest else family
