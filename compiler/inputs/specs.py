"""InputSpec: what one model input may look like, captured once at export.

A spec names the input, its dtype and its min/opt/max shape; dynamic dimensions carry a name
(``batch``, ``seq``) so that engine profiles, fingerprints and registry look-ups speak the same
language. Specs round-trip through JSON, the format stored in programs, packages and the registry.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from compiler import json_reader
from compiler.errors import InputSpecError

if TYPE_CHECKING:
    import torch

SPEC_FORMAT_VERSION = 1

# Names of torch dtypes (``getattr(torch, name)``): specs read and match without importing torch, so a
# registry listing or look-up that loads nothing does not pay for it.
# float8_e4m3fn: fp8 partitions' quantized weights (compiler.quantize); not a model input dtype.
_DTYPES = (
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int64",
    "int32",
    "int8",
    "uint8",
    "bool",
    "float8_e4m3fn",
)
DTYPES = frozenset(_DTYPES)  # the dtype names kiln reads and writes


def dtype_name(dtype: torch.dtype) -> str:
    """The stable string for a torch dtype (``torch.float32`` -> ``"float32"``)."""
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise InputSpecError(f"dtype {dtype} is not supported; expected one of {sorted(_DTYPES)}")
    return name


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a stable dtype string."""
    import torch

    return getattr(torch, _checked_dtype(name))


def _checked_dtype(name: str) -> str:
    if name not in _DTYPES:
        raise InputSpecError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}")
    return name


@dataclass(frozen=True)
class InputSpec:
    """One input: name, dtype, and the shape range an engine must accept.

    ``dynamic_dims`` maps an axis to its dimension name; every other axis is static
    (min == opt == max).
    """

    name: str
    dtype: str
    min_shape: tuple[int, ...]
    opt_shape: tuple[int, ...]
    max_shape: tuple[int, ...]
    dynamic_dims: dict[int, str] = field(default_factory=dict)
    # For integer inputs (token ids, masks): the value range seen at export, so validation can draw
    # fresh inputs that index embeddings correctly.
    value_range: tuple[float, float] | None = None
    # For an integer input that indexes a table (an embedding's rows, found in the program at export):
    # the table's size. Values outside [0, index_bound) are refused by name where requests arrive (a
    # server), instead of failing inside an engine's Gather.
    index_bound: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InputSpecError(f"an input spec's name must be a non-empty string, got {self.name!r:.80}")
        object.__setattr__(self, "min_shape", tuple(int(d) for d in self.min_shape))
        object.__setattr__(self, "opt_shape", tuple(int(d) for d in self.opt_shape))
        object.__setattr__(self, "max_shape", tuple(int(d) for d in self.max_shape))
        object.__setattr__(self, "dynamic_dims", {int(k): str(v) for k, v in self.dynamic_dims.items()})
        if self.value_range is not None:
            object.__setattr__(self, "value_range", tuple(self.value_range))
        bound = self.index_bound
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 1):
            raise InputSpecError(
                f"input {self.name!r}: index_bound must be a positive integer, got {bound!r:.40}"
            )
        _checked_dtype(self.dtype)
        ranks = {len(self.min_shape), len(self.opt_shape), len(self.max_shape)}
        if len(ranks) != 1:
            raise InputSpecError(
                f"input {self.name!r}: min/opt/max shapes must have one rank, got "
                f"{self.min_shape}, {self.opt_shape}, {self.max_shape}"
            )
        for axis, (lo, opt, hi) in enumerate(
            zip(self.min_shape, self.opt_shape, self.max_shape, strict=True)
        ):
            if lo < 0 or not lo <= opt <= hi:
                raise InputSpecError(
                    f"input {self.name!r} axis {axis}: expected 0 <= min <= opt <= max, "
                    f"got min={lo} opt={opt} max={hi}"
                )
            if axis not in self.dynamic_dims and lo != hi:
                raise InputSpecError(
                    f"input {self.name!r} axis {axis}: min {lo} != max {hi} but the axis is not named "
                    "as dynamic; add it to dynamic_dims"
                )
        for axis in self.dynamic_dims:
            if not 0 <= axis < len(self.min_shape):
                raise InputSpecError(f"input {self.name!r}: dynamic axis {axis} is outside rank {self.rank}")

    @property
    def rank(self) -> int:
        return len(self.min_shape)

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch_dtype(self.dtype)

    def dim_range(self, axis: int) -> tuple[int, int]:
        return self.min_shape[axis], self.max_shape[axis]

    def covers(self, shape: Sequence[int]) -> bool:
        """Whether a concrete shape lies inside this spec's ranges."""
        return len(shape) == self.rank and all(
            lo <= int(d) <= hi for d, lo, hi in zip(shape, self.min_shape, self.max_shape, strict=True)
        )

    def check(self, value: torch.Tensor) -> None:
        """Raise InputSpecError unless ``value`` has this spec's dtype and a shape inside its ranges."""
        import torch

        if not isinstance(value, torch.Tensor):
            raise InputSpecError(f"input {self.name!r}: expected a torch.Tensor, got {type(value).__name__}")
        if value.dtype != self.torch_dtype:
            raise InputSpecError(
                f"input {self.name!r}: expected dtype {self.dtype}, got {dtype_name(value.dtype)}"
            )
        if not self.covers(value.shape):
            raise InputSpecError(
                f"input {self.name!r}: shape {tuple(value.shape)} is outside the spec "
                f"(min {self.min_shape}, max {self.max_shape}{self._dims_text()})"
            )

    def check_values(self, value: torch.Tensor) -> None:
        """Raise InputSpecError when an index input holds a value outside ``[0, index_bound)``, naming
        the input, the range and the first offending value (a whole-tensor min/max: for servers)."""
        if self.index_bound is None or value.numel() == 0:
            return
        lo, hi = int(value.min()), int(value.max())
        if lo < 0 or hi >= self.index_bound:
            bad = lo if lo < 0 else hi
            raise InputSpecError(
                f"input {self.name!r}: value {bad} is outside the range it indexes, "
                f"0..{self.index_bound - 1} (a table of {self.index_bound} rows)"
            )

    def _dims_text(self) -> str:
        if not self.dynamic_dims:
            return ""
        named = ", ".join(f"{name}=axis {axis}" for axis, name in sorted(self.dynamic_dims.items()))
        return f"; dynamic: {named}"

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "min_shape": list(self.min_shape),
            "opt_shape": list(self.opt_shape),
            "max_shape": list(self.max_shape),
            "dynamic_dims": {str(k): v for k, v in sorted(self.dynamic_dims.items())},
            **({"value_range": list(self.value_range)} if self.value_range is not None else {}),
            **({"index_bound": self.index_bound} if self.index_bound is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> InputSpec:
        try:
            return cls(
                name=data["name"],
                dtype=data["dtype"],
                min_shape=tuple(data["min_shape"]),
                opt_shape=tuple(data["opt_shape"]),
                max_shape=tuple(data["max_shape"]),
                dynamic_dims={int(k): v for k, v in data.get("dynamic_dims", {}).items()},
                value_range=data.get("value_range"),
                index_bound=data.get("index_bound"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InputSpecError):
                raise
            raise InputSpecError(f"malformed input spec {data!r:.200}: {exc}") from exc

    @classmethod
    def static(cls, name: str, value: torch.Tensor) -> InputSpec:
        shape = tuple(value.shape)
        return cls(name, dtype_name(value.dtype), shape, shape, shape)


def specs_to_json(specs: Iterable[InputSpec]) -> str:
    return json.dumps(
        {"format_version": SPEC_FORMAT_VERSION, "inputs": [s.to_dict() for s in specs]}, sort_keys=True
    )


def specs_from_json(text: str) -> tuple[InputSpec, ...]:
    try:
        data = json_reader.loads(text, "input specs")
    except ValueError as exc:
        raise InputSpecError(f"input specs are not valid JSON: {exc}") from exc
    version = data.get("format_version")
    if not isinstance(version, int) or version > SPEC_FORMAT_VERSION:
        raise InputSpecError(
            f"input specs have format version {version!r}; this kiln reads versions <= {SPEC_FORMAT_VERSION}"
        )
    return tuple(InputSpec.from_dict(d) for d in data["inputs"])


def check_inputs(specs: Sequence[InputSpec], values: Sequence[torch.Tensor]) -> None:
    """Check a call's inputs against specs, including that shared dimension names agree."""
    if len(values) != len(specs):
        names = [s.name for s in specs]
        raise InputSpecError(f"expected {len(specs)} inputs {names}, got {len(values)}")
    seen: dict[str, tuple[str, int]] = {}
    for spec, value in zip(specs, values, strict=True):
        spec.check(value)
        for axis, dim in spec.dynamic_dims.items():
            size = int(value.shape[axis])
            if dim in seen and seen[dim][1] != size:
                raise InputSpecError(
                    f"dimension {dim!r} is {seen[dim][1]} in input {seen[dim][0]!r} but {size} in "
                    f"input {spec.name!r}; inputs sharing a dimension name must agree"
                )
            seen[dim] = (spec.name, size)


@dataclass(frozen=True)
class OutputSpec:
    """One output of a compiled model, as recorded at compile time (from the exported program, nothing
    run): its name (a key of the model's output mapping, else ``output_<i>`` over the flat outputs),
    dtype, and shape range. ``dynamic_dims`` maps an axis to its dimension name when it follows an
    input's named dimension (``batch``), or to its expression over them (``2*seq``); ``max_shape`` is
    -1 on an axis with no bound (a data-dependent size). Servers read a version's signature from these.
    """

    name: str
    dtype: str
    min_shape: tuple[int, ...]
    max_shape: tuple[int, ...]
    dynamic_dims: dict[int, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InputSpecError(f"an output spec's name must be a non-empty string, got {self.name!r:.80}")
        if not isinstance(self.dtype, str):
            raise InputSpecError(f"output {self.name!r}: dtype must be a string, got {self.dtype!r:.40}")
        object.__setattr__(self, "min_shape", tuple(int(d) for d in self.min_shape))
        object.__setattr__(self, "max_shape", tuple(int(d) for d in self.max_shape))
        object.__setattr__(self, "dynamic_dims", {int(k): str(v) for k, v in self.dynamic_dims.items()})
        if len(self.min_shape) != len(self.max_shape):
            raise InputSpecError(
                f"output {self.name!r}: min and max shapes must have one rank, got {self.min_shape}, "
                f"{self.max_shape}"
            )
        for axis in self.dynamic_dims:
            if not 0 <= axis < len(self.min_shape):
                raise InputSpecError(f"output {self.name!r}: dynamic axis {axis} is outside rank {self.rank}")

    @property
    def rank(self) -> int:
        return len(self.min_shape)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "min_shape": list(self.min_shape),
            "max_shape": list(self.max_shape),
            "dynamic_dims": {str(k): v for k, v in sorted(self.dynamic_dims.items())},
        }

    @classmethod
    def from_dict(cls, data: dict) -> OutputSpec:
        try:
            return cls(
                name=data["name"],
                dtype=data["dtype"],
                min_shape=tuple(data["min_shape"]),
                max_shape=tuple(data["max_shape"]),
                dynamic_dims={int(k): v for k, v in data.get("dynamic_dims", {}).items()},
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InputSpecError):
                raise
            raise InputSpecError(f"malformed output spec {data!r:.200}: {exc}") from exc
