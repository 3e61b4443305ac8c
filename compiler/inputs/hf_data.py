"""Validation data from a Hugging Face ``datasets`` folder, run through the model's own processor.

A folder written by ``Dataset.save_to_disk`` (or ``DatasetDict.save_to_disk``: name the split), one
column (text, or images), and the model's tokenizer or image processor (any callable taking a list
of values and ``return_tensors="pt"`` and returning a mapping of tensors, as Hugging Face processors
do). Each batch of rows becomes one sample; the processor's outputs are matched to the model inputs
by name (outputs the model does not take, such as ``token_type_ids`` for a model without them, are
left out). Text is padded within a batch and never truncated: a row longer than the compiled range
is skipped and reported, like any sample outside the ranges.

The source names the folder, the column and the sha256 of the folder's files, so a report says what
it was measured on. ``datasets`` is imported only here (``pip install kiln[data]``).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from compiler.errors import InputSpecError, ValidationDataError
from compiler.inputs.data import ValidationData
from compiler.inputs.specs import InputSpec, check_inputs


def dataset_data(
    path: str | os.PathLike,
    column: str,
    processor: Callable[..., Mapping[str, Any]],
    specs: Sequence[InputSpec],
    *,
    split: str | None = None,
    limit: int | None = 64,
    batch_size: int = 1,
) -> ValidationData:
    """Samples from the first ``limit`` rows of ``column`` (``None``: all), ``batch_size`` rows each."""
    folder = Path(path)
    rows = _load(folder, split)
    if column not in rows.column_names:
        raise ValidationDataError(
            f"{folder}: the dataset has no column {column!r}; its columns are {rows.column_names}"
        )
    count = len(rows) if limit is None else min(limit, len(rows))
    if count == 0:
        raise ValidationDataError(f"{folder}: the dataset holds no rows")
    names = [s.name for s in specs]
    kept: list[tuple[torch.Tensor, ...]] = []
    skipped: list[str] = []
    for start in range(0, count, batch_size):
        values = rows[start : min(start + batch_size, count)][column]
        where = f"rows {start}-{start + len(values) - 1}" if len(values) > 1 else f"row {start}"
        outputs = _process(processor, values, folder, column, where)
        missing = [n for n in names if n not in outputs]
        if missing:
            raise ValidationDataError(
                f"{folder}: the processor gives {sorted(outputs)} for column {column!r}; the model also "
                f"takes {missing}"
            )
        sample = []
        for spec in specs:
            tensor = torch.as_tensor(outputs[spec.name])
            if tensor.dtype != spec.torch_dtype:
                dtype = str(tensor.dtype).removeprefix("torch.")
                raise ValidationDataError(
                    f"{folder}: the processor's {spec.name!r} has dtype {dtype}; the model input is "
                    f"{spec.dtype}"
                )
            if tensor.is_floating_point() and bool(tensor.isnan().any()):
                raise ValidationDataError(f"{folder}: the processor's {spec.name!r} holds NaN at {where}")
            sample.append(tensor)
        try:
            check_inputs(specs, sample)
        except InputSpecError as exc:
            skipped.append(f"{where}: {exc}")
            continue
        kept.append(tuple(sample))
    source = f"{folder}[{column}] sha256:{_folder_digest(folder)}"
    if not kept:
        raise ValidationDataError(
            f"{folder}: no row of column {column!r} fits the compiled input ranges: " + "; ".join(skipped[:3])
        )
    return ValidationData(source, tuple(kept), tuple(skipped))


def _load(folder: Path, split: str | None) -> Any:
    try:
        import datasets
    except ImportError:
        raise ValidationDataError(
            f"{folder}: reading a datasets folder needs the 'datasets' package (pip install kiln[data])"
        ) from None
    if not folder.is_dir():
        raise ValidationDataError(f"{folder}: datasets folder not found")
    try:
        loaded = datasets.load_from_disk(str(folder))
    except Exception as exc:  # not a save_to_disk folder, or damaged: one typed error
        raise ValidationDataError(f"{folder}: not a readable datasets folder (save_to_disk): {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        splits = sorted(loaded)
        if split is None and len(splits) == 1:
            split = splits[0]
        if split not in loaded:
            raise ValidationDataError(f"{folder}: name one split of {splits} (split={split!r} is not one)")
        return loaded[split]
    if split is not None:
        raise ValidationDataError(f"{folder}: a single dataset has no splits; split={split!r} names one")
    return loaded


def _process(processor: Callable, values: list, folder: Path, column: str, where: str) -> Mapping[str, Any]:
    kwargs: dict[str, Any] = {"return_tensors": "pt"}
    if values and isinstance(values[0], str):
        kwargs["padding"] = True  # a batch of texts shares one length; never truncated
    try:
        outputs = processor(values, **kwargs)
    except Exception as exc:
        raise ValidationDataError(
            f"{folder}: the processor failed on column {column!r} at {where}: {exc}"
        ) from exc
    if not isinstance(outputs, Mapping):
        raise ValidationDataError(
            f"{folder}: the processor returned a {type(outputs).__name__}; expected a mapping of model inputs"
        )
    return outputs


def _folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(str(file.relative_to(folder)).encode() + b"\0")
        with file.open("rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()
