"""Preflight: everything about a compile request that can be checked before any engine is built.

The flows run it for every (model, device) before the first build, and ``kiln zoo --check`` runs
exactly the same checks: the source resolves (and is trusted), the device exists here, the backend is
installed and builds engines for that device, an int8 compile has calibration data, and the largest
inputs the ranges allow fit in memory.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

from compiler.errors import KilnError
from compiler.inputs.specs import InputSpec
from zoo.errors import ZooConfigError
from zoo.inputs import largest_input_bytes
from zoo.request import CompileRequest

# Validation holds the inputs, eager and compiled outputs and activations of both models at once; this
# many times the input bytes is a deliberately rough floor, meant to refuse the absurd (max: 1e12), not
# to budget memory precisely.
VALIDATION_MEMORY_FACTOR = 8


def check_device(device: str) -> None:
    """Raise ZooConfigError unless ``device`` is present on this machine."""
    if device == "cpu":
        return
    import torch

    if not torch.cuda.is_available():
        raise ZooConfigError(
            f"devices: {device!r} needs a CUDA device, but none is visible here; run this model on a GPU "
            "worker (see deploy/prefect.yaml) or set devices: [cpu]"
        )
    index = int(device.split(":")[1]) if ":" in device else 0
    count = torch.cuda.device_count()
    if index >= count:
        raise ZooConfigError(f"devices: {device!r} does not exist; this machine has cuda:0..cuda:{count - 1}")


def check_backend_available(backend: str, device: str = "cpu") -> None:
    """Raise ZooConfigError when the backend is not installed here or cannot build for ``device``."""
    from compiler.backends import get_backend

    try:
        instance = get_backend(backend, device)
    except KilnError as exc:
        raise ZooConfigError(f"backend: {backend!r} cannot be used here: {exc}") from None
    if device.startswith("cuda"):
        builds_for = instance.engine_target()
        if not builds_for.startswith("cuda"):
            raise ZooConfigError(
                f"devices: {device!r} needs GPU engines, but backend {backend!r} builds for {builds_for!r} "
                "here; use backend: tensorrt, inductor (or auto) for cuda devices, or devices: [cpu]"
            )


def check_out_dir(out_dir: str | os.PathLike) -> None:
    """Raise ZooConfigError unless packages and the summary can be written under ``out_dir``.

    A full disk fails per model with the summary written; a directory that cannot be created or written
    at all (read-only filesystem, a path under a regular file) fails every model, so it is unusable
    input, named before anything is built.
    """
    import tempfile

    try:
        os.makedirs(out_dir, exist_ok=True)
        with tempfile.TemporaryFile(dir=out_dir, prefix=".kiln-write-check-"):
            pass
    except OSError as exc:
        raise ZooConfigError(
            f"--out {str(out_dir)!r}: packages cannot be written there ({exc.strerror or exc}); "
            "choose a writable directory (settings.out_dir or --out)"
        ) from None


def check_workspace(workspace: str | os.PathLike) -> None:
    """Raise ZooConfigError unless stage outputs can be written under ``workspace``.

    Every stage of every model writes there (and an unchanged model's record is read from there), so a
    directory that cannot be created or written fails every model: unusable input, named before any
    model is looked at. It is created as ``tasks.workspace.Workspace`` creates it (private, 0700).
    """
    import tempfile

    path = Path(workspace).resolve()
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
        with tempfile.TemporaryFile(dir=path, prefix=".kiln-write-check-"):
            pass
    except OSError as exc:
        raise ZooConfigError(
            f"settings.workspace {str(path)!r}: stage outputs cannot be written there "
            f"({exc.strerror or exc}); choose a writable directory (settings.workspace in the zoo file, "
            "or --workspace)"
        ) from None
    from compiler.cache.paths import check_private

    # Staged engines in it run as the engine cache's do: one others can write is refused, found or made.
    check_private(
        path,
        what="settings.workspace",
        why="its staged engines and stage results are trusted (an Inductor engine runs as code)",
        other="choose a directory of your own (settings.workspace in the zoo file, or --workspace)",
        error=ZooConfigError,
    )


def check_validation_data(where: str, data: str) -> None:
    """Recorded validation data: a regular file whose headers say it fits the data bound."""
    from compiler.errors import SpecialFileError, ValidationDataError
    from compiler.inputs.files import check_data_bounds

    try:
        check_data_bounds(data)
    except FileNotFoundError:
        raise ZooConfigError(f"{where}.validation.data: {data!r} does not exist") from None
    except (ValidationDataError, SpecialFileError, OSError) as exc:
        raise ZooConfigError(f"{where}.validation.data: {exc}") from None


def check_calibration(request: CompileRequest) -> None:
    """An int8 (static) request names calibration data that exists, or allows random inputs."""
    options = request.options
    if not options.quantized or options.quantization == "dynamic":
        return
    where = f"models[{request.name}].calibration.data"
    data = options.calibration.data
    if data is None and not options.calibration.allow_random:
        raise ZooConfigError(
            f"{where}: precision int8 (static quantization) needs recorded inputs to calibrate on "
            "(.safetensors or .npz, one array per input with a sample axis); set it, or set quantization: "
            "dynamic, or calibration.allow_random: true (meaningless scales: tests only)"
        )
    if data is not None:
        from compiler.errors import SpecialFileError, ValidationDataError
        from compiler.inputs.files import check_data_bounds

        try:
            check_data_bounds(data)  # the same bound as validation data
        except FileNotFoundError:
            raise ZooConfigError(
                f"{where}: {data!r} does not exist; give the path of the recorded inputs"
            ) from None
        except (ValidationDataError, SpecialFileError, OSError) as exc:
            raise ZooConfigError(f"{where}: {exc}") from None


def memory_bytes() -> int:
    """Physical memory of this machine (what validation can use at most)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_memory(name: str, sizes: dict[str, int], available: int | None = None) -> None:
    """Refuse input ranges whose largest inputs cannot fit (``max: 1e12`` dies in the allocator later).

    ``sizes``: bytes of each input at the top of its ranges.
    """
    available = memory_bytes() if available is None else available
    needed = sum(sizes.values()) * VALIDATION_MEMORY_FACTOR
    if needed > available:
        input_name, biggest = max(sizes.items(), key=lambda kv: kv[1])
        raise ZooConfigError(
            f"models[{name}].inputs: at the top of its ranges input {input_name!r} alone takes "
            f"{_gib(biggest)} and validation needs about {_gib(needed)}, but this machine has "
            f"{_gib(available)}; lower the dims' max"
        )


def spec_sizes(specs: Iterable[InputSpec]) -> dict[str, int]:
    """Bytes of each input at its max shape."""
    return {s.name: math.prod(s.max_shape) * s.torch_dtype.itemsize for s in specs}


def _gib(n: int) -> str:
    return f"{n / 2**30:.3g} GiB"


def preflight(request: CompileRequest, *, load: bool = False) -> None:
    """Every check that needs no build (see the module docstring); raises ZooConfigError.

    ``load``: also build the model to size its largest inputs (``--check``); a compile checks the
    exported specs instead (``check_memory(name, spec_sizes(specs))``), which costs no extra load.
    """
    where = f"models[{request.name}]"
    try:
        request.identity()  # the source is trusted and resolves (no model is loaded)
    except ZooConfigError as exc:
        raise type(exc)(f"{where}.{exc}") from None
    check_device(request.device)
    check_backend_available(request.options.backend, request.device)
    if request.validation.data is not None:
        check_validation_data(where, request.validation.data)
    check_calibration(request)
    if load:
        check_memory(request.name, largest_input_bytes(request.load_case(), request.inputs))
