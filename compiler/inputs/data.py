"""Validation data: the inputs accuracy is measured on, recorded by the user or drawn at random.

Recorded data is a ``.safetensors`` or ``.npz`` file (or an in-memory mapping) with one array per
model input, named as the input spec, with a leading sample axis: an input of shape ``[batch, seq]``
is stored as ``[samples, batch, seq]``. Every array must have the spec's dtype and rank + 1 and the
same number of samples; floating arrays hold no NaN. One array holds one shape, so samples of other
shapes (another sequence length) go in groups: fields named ``<group>/<input>`` (``seq128/input_ids``),
each group complete and checked on its own. What is wrong is a :class:`ValidationDataError` naming
the file and the field, before any model runs. A field that names no model input (``token_type_ids``
recorded from a tokenizer, for a model compiled without it) is such an error, never skipped silently:
the caller lists the fields to leave out in ``ignore_fields`` (a zoo entry's
``validation.ignore_fields`` / ``calibration.ignore_fields``), which must each be in the data and be
no model input.

A group whose shapes fall outside the compiled ranges is skipped and reported, never clipped: a
clipped sample is not the input the user recorded. The data's identity (path and sha256 of its bytes)
goes into the validation report, so two reports say whether they measured the same thing.

Without recorded data: ``min``, ``max`` and random points inside the spec ranges, as always.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from compiler.errors import InputSpecError, SpecialFileError, ValidationDataError
from compiler.inputs.files import check_data_bounds
from compiler.inputs.specs import InputSpec, check_inputs, dtype_name

RANDOM = "random"
SUFFIXES = (".safetensors", ".npz")


@dataclass(frozen=True)
class ValidationData:
    """Samples of flat model inputs (spec order), where they came from, and what was left out.

    ``source``: ``"random"``, ``"<path> sha256:<hex>"`` or ``"<mapping> sha256:<hex>"``.
    ``skipped``: one line per recorded sample outside the compiled ranges, with the reason.
    """

    source: str
    samples: tuple[tuple[torch.Tensor, ...], ...]
    skipped: tuple[str, ...] = ()

    def __len__(self) -> int:
        return len(self.samples)

    @property
    def digest(self) -> str | None:
        """The sha256 of recorded data (None for random inputs)."""
        return self.source.rsplit("sha256:", 1)[1] if "sha256:" in self.source else None


def sample_inputs(specs: Sequence[InputSpec], point: str, generator: torch.Generator) -> list[torch.Tensor]:
    """Inputs at ``min``, ``max``, ``opt`` or a ``random`` point inside the spec ranges."""
    sizes: dict[str, int] = {}
    tensors = []
    for spec in specs:
        shape = []
        for axis in range(spec.rank):
            lo, hi = spec.dim_range(axis)
            name = spec.dynamic_dims.get(axis)
            if name is None:
                shape.append(lo)
                continue
            if name not in sizes:
                pick = {"min": lo, "max": hi, "opt": spec.opt_shape[axis]}.get(point)
                sizes[name] = (
                    pick if pick is not None else int(torch.randint(lo, hi + 1, (1,), generator=generator))
                )
            shape.append(sizes[name])
        tensors.append(random_tensor(spec, shape, generator))
    return tensors


def random_tensor(spec: InputSpec, shape: list[int], generator: torch.Generator) -> torch.Tensor:
    dtype = spec.torch_dtype
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    lo, hi = spec.value_range or (0, 1)
    return torch.randint(int(lo), int(hi) + 1, shape, generator=generator, dtype=dtype)


def random_data(specs: Sequence[InputSpec], samples: int = 3, seed: int = 0) -> ValidationData:
    """``samples`` input sets: the minimum shapes, the maximum shapes, then random points between."""
    generator = torch.Generator().manual_seed(seed)
    points = (["min", "max"] + ["random"] * max(0, samples - 2))[: max(1, samples)]
    return ValidationData(RANDOM, tuple(tuple(sample_inputs(specs, p, generator)) for p in points))


def validation_data(
    specs: Sequence[InputSpec],
    data: str | os.PathLike | Mapping[str, object] | ValidationData | None = None,
    *,
    samples: int = 3,
    seed: int = 0,
    ignore_fields: Sequence[str] = (),
    ignore_option: str = "ignore_fields",
) -> ValidationData:
    """The inputs to validate on: ``data`` (a file, a mapping of arrays, or ready ValidationData) when
    given, else ``samples`` random sets. Recorded samples outside the ranges are skipped; when none
    is left, that is an error (nothing would be validated).

    ``ignore_fields``: recorded fields (input names, in every group) to leave out; ``ignore_option``:
    how the caller's users spell that list, for the error that names a field no input takes."""
    if data is None:
        return random_data(specs, samples, seed)
    if isinstance(data, ValidationData):
        return data
    if isinstance(data, Mapping):
        label = "<mapping>"
        arrays = {str(k): _as_tensor(v, label, str(k)) for k, v in data.items()}
        digest = _mapping_digest(arrays)
    else:
        path = Path(data)
        label = str(path)
        arrays = read_arrays(path)
        digest = _file_digest(path)
    arrays = _without(arrays, specs, label, tuple(ignore_fields), ignore_option)
    result = _samples(arrays, specs, label, f"{label} sha256:{digest}", ignore_option)
    if not result.samples:
        raise ValidationDataError(
            f"{label}: none of its samples lies inside the compiled input ranges, nothing to validate on: "
            + "; ".join(result.skipped[:3])
        )
    return result


def read_arrays(path: Path, max_bytes: int | None = None) -> dict[str, torch.Tensor]:
    """Name -> tensor from a ``.safetensors`` or ``.npz`` file; typed errors name the file.

    Only a regular file is read, and only when its headers say its arrays fit in ``max_bytes``
    (default ``$KILN_DATA_MAX_BYTES``, 1 GiB): see :mod:`compiler.inputs.files`. Every reader of
    validation or calibration data comes through here.
    """
    if not path.exists():
        raise ValidationDataError(f"{path}: validation data file not found")
    if path.suffix not in SUFFIXES:
        raise ValidationDataError(
            f"{path}: validation data must be one of {list(SUFFIXES)} (one array per model input)"
        )
    try:
        source = check_data_bounds(path, max_bytes)
    except SpecialFileError as exc:
        raise ValidationDataError(str(exc)) from None
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            arrays = dict(load_file(str(source)))
        else:
            # allow_pickle=False: an npz holding objects would run code when read.
            with np.load(source, allow_pickle=False) as archive:
                arrays = {name: _as_tensor(archive[name], str(path), name) for name in archive.files}
    except ValidationDataError:
        raise
    except Exception as exc:  # every library says "unreadable" its own way: one typed error
        raise ValidationDataError(f"{path}: cannot read validation data: {exc}") from exc
    if not arrays:
        raise ValidationDataError(f"{path}: the file holds no arrays; expected one per model input")
    return arrays


def _as_tensor(value: object, label: str, name: str) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            raise ValidationDataError(
                f"{label}: field {name!r} holds Python objects; expected a numeric array"
            )
        return torch.from_numpy(np.ascontiguousarray(value))
    raise ValidationDataError(f"{label}: field {name!r} is a {type(value).__name__}; expected an array")


def _without(
    arrays: Mapping[str, torch.Tensor], specs: Sequence[InputSpec], label: str, ignore: tuple, option: str
) -> dict[str, torch.Tensor]:
    """``arrays`` less the fields ``ignore`` names (by input name, in every group); a list naming a
    field the data lacks or a model input is refused, so it cannot hide a typo or drop an input."""
    if not ignore:
        return dict(arrays)
    held = {key.rpartition("/")[2] for key in arrays}
    absent = [name for name in dict.fromkeys(ignore) if name not in held]
    if absent:
        raise ValidationDataError(
            f"{label}: {option} lists {absent}, which the data does not hold (its fields are "
            f"{sorted(held)}); remove them from {option}"
        )
    needed = [name for name in dict.fromkeys(ignore) if name in {s.name for s in specs}]
    if needed:
        raise ValidationDataError(
            f"{label}: {option} lists model input(s) {needed}; the model takes them, so the data must give "
            f"them: remove them from {option}"
        )
    return {key: array for key, array in arrays.items() if key.rpartition("/")[2] not in ignore}


def _samples(
    arrays: Mapping[str, torch.Tensor],
    specs: Sequence[InputSpec],
    label: str,
    source: str,
    ignore_option: str = "ignore_fields",
) -> ValidationData:
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, array in arrays.items():
        group, _, name = key.rpartition("/")
        groups.setdefault(group, {})[name] = array
    kept: list[tuple[torch.Tensor, ...]] = []
    skipped: list[str] = []
    for group, fields in sorted(groups.items()):
        count = _check_group(fields, specs, label, group, ignore_option)
        samples = [tuple(fields[s.name][i] for s in specs) for i in range(count)]
        # One array per input: every sample of a group has one shape, so the first speaks for all.
        try:
            check_inputs(specs, list(samples[0]))
        except InputSpecError as exc:
            where = f"group {group!r}" if group else "the file's samples"
            skipped.append(f"{where} ({count} samples): {exc}")
            continue
        kept.extend(samples)
    return ValidationData(source, tuple(kept), tuple(skipped))


def _check_group(
    fields: Mapping[str, torch.Tensor],
    specs: Sequence[InputSpec],
    label: str,
    group: str,
    ignore_option: str = "ignore_fields",
) -> int:
    """The group's sample count, after checking its fields against the specs."""
    names = [s.name for s in specs]
    prefix = f"{group}/" if group else ""
    extra = sorted(set(fields) - set(names))
    if extra:
        raise ValidationDataError(
            f"{label}: field(s) {[f'{prefix}{n}' for n in extra]} name no model input; the inputs are "
            f"{names}. Leave them out of the data, or list them in {ignore_option}: {extra}"
        )
    missing = [f"{prefix}{n}" for n in names if n not in fields]
    if missing:
        raise ValidationDataError(f"{label}: no field for model input(s) {missing}; the inputs are {names}")
    counts = {}
    for spec in specs:
        array, field = fields[spec.name], f"{prefix}{spec.name}"
        if array.dtype != spec.torch_dtype:
            raise ValidationDataError(
                f"{label}: field {field!r} has dtype {_dtype_text(array.dtype)}; the model input is "
                f"{spec.dtype}"
            )
        if array.dim() != spec.rank + 1:
            raise ValidationDataError(
                f"{label}: field {field!r} has rank {array.dim()} (shape {tuple(array.shape)}); expected "
                f"{spec.rank + 1}: a leading sample axis, then the input's {spec.rank} axes"
            )
        if array.is_floating_point() and bool(array.isnan().any()):
            first = int(array.isnan().flatten(1).any(1).nonzero()[0])
            raise ValidationDataError(f"{label}: field {field!r} holds NaN (sample {first} is the first)")
        counts[field] = int(array.shape[0])
    if len(set(counts.values())) != 1:
        raise ValidationDataError(f"{label}: fields disagree on the number of samples: {counts}")
    count = next(iter(counts.values()))
    if count == 0:
        raise ValidationDataError(f"{label}: {f'group {group!r}' if group else 'the file'} holds no samples")
    return count


def _dtype_text(dtype: torch.dtype) -> str:
    try:
        return dtype_name(dtype)
    except InputSpecError:
        return str(dtype).removeprefix("torch.")


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _mapping_digest(arrays: Mapping[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(arrays):
        tensor = arrays[name].contiguous()
        digest.update(f"{name}:{tensor.dtype}:{list(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def sample_digest(sample: Sequence[torch.Tensor]) -> str:
    """The sha256 of one sample (every input's dtype, shape and bytes): equal samples, equal digests."""
    digest = hashlib.sha256()
    for tensor in sample:
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{tensor.dtype}:{list(tensor.shape)};".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()


def held_out(data: ValidationData, used: Sequence[str], why: str = "used for calibration") -> ValidationData:
    """``data`` without the samples whose :func:`sample_digest` is in ``used`` (each named in
    ``skipped``): a sample a quantized model was calibrated on must not also validate it. An error
    when nothing is left."""
    if not used or not data.samples:
        return data
    used = set(used)
    kept, skipped = [], list(data.skipped)
    for index, sample in enumerate(data.samples):
        if sample_digest(sample) in used:
            skipped.append(f"sample {index}: {why}, held out of validation")
        else:
            kept.append(sample)
    if not kept:
        raise ValidationDataError(
            f"{data.source}: every one of its {len(data.samples)} samples was {why}; validate on other "
            "samples (more recorded samples than calibration.samples, or a separate file)"
        )
    return ValidationData(data.source, tuple(kept), tuple(skipped))
