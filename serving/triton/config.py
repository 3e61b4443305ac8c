"""What Triton is told about a served version: its signature and the ``config.pbtxt`` written from it.

A :class:`ServedModel` is written beside each staged package (``<repository>/<model>/<N>/kiln.json``)
when the version is staged, from the package's input specs and from running the verified package once
at its smallest and largest shapes (which output axes follow the inputs). ``config.pbtxt`` is rendered
from the champion's ``ServedModel`` alone, so a release or rollback rewrites it without torch.

Mapping, per input spec: ``dims`` has -1 for every dynamic axis; when every input's axis 0 is one named
dynamic dimension starting at 1 and every output's axis 0 follows it, that axis is Triton's batch axis:
``max_batch_size`` is its maximum, it is left out of ``dims``, and ``dynamic_batching`` is on. On a
GPU it lists the fixed shape profiles' sizes of that axis as preferred batch sizes (the shapes whose
CUDA graphs were captured and TensorRT profiles tuned). On the CPU it lists none: an ONNX Runtime
engine runs every batch size alike, and a preferred size makes the batcher send that many at once
and leave the rest queued for the next execution (with the profile size 1, every request alone):
with 16 clients on 2 cores, 3 requests per batch instead of 10 and a longer tail
(benchmarks/triton_serving.py). Otherwise ``max_batch_size`` is 0 (Triton does not batch) and axis 0
stays in ``dims``. The engine target picks ``KIND_CPU`` or ``KIND_GPU``. No torch here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from compiler import json_reader
from serving.triton.errors import TritonConfigError

# kiln dtype name (compiler.inputs.specs) -> Triton's model-config type. fp8 has no Triton type.
TRITON_TYPES = {
    "float32": "TYPE_FP32",
    "float16": "TYPE_FP16",
    "bfloat16": "TYPE_BF16",
    "float64": "TYPE_FP64",
    "int64": "TYPE_INT64",
    "int32": "TYPE_INT32",
    "int8": "TYPE_INT8",
    "uint8": "TYPE_UINT8",
    "bool": "TYPE_BOOL",
}
DEFAULT_QUEUE_DELAY_US = 1000
# Intra-op threads per model instance (ONNX Runtime's and torch's); 0: one per core of the serving
# machine left after Triton's own (see runtime.instance_threads).
DEFAULT_THREADS = 0
THREADS_PARAMETER = "kiln_threads"
SERVED_FILE = "kiln.json"  # the ServedModel beside a staged package
PACKAGE_DIR = "package"  # the verified package inside a version folder
BACKEND_FILE = "model.py"  # kiln's Python backend, the same bytes in every version folder


def triton_type(dtype: str, what: str) -> str:
    """``TYPE_FP32`` for ``float32``; TritonConfigError naming ``what`` (``input 'x'``) otherwise."""
    try:
        return TRITON_TYPES[dtype]
    except KeyError:
        raise TritonConfigError(
            f"{what} has dtype {dtype}, which Triton has no type for (it takes {sorted(TRITON_TYPES)}); "
            "compile the model with that input or output in one of those dtypes to serve it on Triton"
        ) from None


def wire_type(dtype: str, what: str) -> str:
    """The inference protocol's datatype (``FP32``) for a kiln dtype."""
    return triton_type(dtype, what).removeprefix("TYPE_")


@dataclass(frozen=True)
class TensorSig:
    """One input or output: name, kiln dtype, full shape with -1 for every dynamic axis (batch included)."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))


@dataclass(frozen=True)
class ServedModel:
    """A staged version as Triton serves it (``kiln.json``). ``max_batch_size`` 0: Triton does not batch."""

    name: str  # the Triton model name: the kiln model name
    registered_model: str  # kiln.<model>.<target>
    version: str  # the registry version, also the Triton version number
    content_hash: str  # what the registry recorded; the backend refuses a package with another
    engine_target: str
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]
    max_batch_size: int = 0
    preferred_batch_sizes: tuple[int, ...] = field(default_factory=tuple)
    # What the signature depends on besides weights (repository.signature_key): a later version with
    # the same key is served with this signature, without loading it (a release stays torch-free).
    signature_key: str = ""

    def __post_init__(self) -> None:
        for sig in self.inputs:
            triton_type(sig.dtype, f"input {sig.name!r} of {self.registered_model}")
        for sig in self.outputs:
            triton_type(sig.dtype, f"output {sig.name!r} of {self.registered_model}")
        if not self.outputs:
            raise TritonConfigError(f"{self.registered_model} version {self.version} returns no tensor")

    @property
    def kind(self) -> str:
        return "KIND_GPU" if self.engine_target.startswith("cuda") else "KIND_CPU"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> ServedModel:
        try:
            data: dict[str, Any] = json_reader.loads(text, where)
            return cls(
                name=str(data["name"]),
                registered_model=str(data["registered_model"]),
                version=str(data["version"]),
                content_hash=str(data["content_hash"]),
                engine_target=str(data["engine_target"]),
                inputs=tuple(TensorSig(str(s["name"]), str(s["dtype"]), s["shape"]) for s in data["inputs"]),
                outputs=tuple(
                    TensorSig(str(s["name"]), str(s["dtype"]), s["shape"]) for s in data["outputs"]
                ),
                max_batch_size=int(data["max_batch_size"]),
                preferred_batch_sizes=tuple(int(b) for b in data["preferred_batch_sizes"]),
                signature_key=str(data.get("signature_key", "")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            if isinstance(exc, TritonConfigError):
                raise
            raise TritonConfigError(
                f"{where} is not a kiln served-model record ({exc}); export again"
            ) from exc


def batch_axis(specs: Sequence[Any]) -> tuple[str, int] | None:
    """(dimension name, max) when every input's axis 0 is the same named dynamic dimension from 1."""
    names = {spec.dynamic_dims.get(0) for spec in specs}
    if len(names) != 1 or None in names or any(spec.min_shape[0] > 1 for spec in specs):
        return None
    return names.pop(), min(spec.max_shape[0] for spec in specs)


def preferred_sizes(profiles: Sequence[Mapping[str, Any]], dim: str, max_batch: int) -> tuple[int, ...]:
    """The fixed profiles' sizes of the batch dimension (the shapes the engines were tuned for)."""
    sizes = {int(p[dim]) for p in profiles if isinstance(p.get(dim), int) and 1 <= int(p[dim]) <= max_batch}
    return tuple(sorted(sizes))


def render_config(
    served: ServedModel,
    *,
    queue_delay_us: int = DEFAULT_QUEUE_DELAY_US,
    instances: int = 1,
    threads: int = DEFAULT_THREADS,
) -> str:
    """``config.pbtxt`` serving exactly ``served.version`` (the champion) of ``served.name``."""
    if instances < 1:
        raise TritonConfigError(f"instances must be at least 1, got {instances}")
    if threads < 0:
        raise TritonConfigError(f"threads must be >= 0 (0: automatic), got {threads}")
    if queue_delay_us < 0:
        raise TritonConfigError(f"the queue delay must be >= 0 microseconds, got {queue_delay_us}")
    batched = served.max_batch_size > 0

    def tensors(sigs: Sequence[TensorSig], what: str) -> str:
        rows = []
        for sig in sigs:
            dims = sig.shape[1:] if batched else sig.shape
            kind = triton_type(sig.dtype, f"{what} {sig.name!r}")
            shape = ", ".join(str(d) for d in dims)
            rows.append(f"  {{ name: {json.dumps(sig.name)} data_type: {kind} dims: [ {shape} ] }}")
        return ",\n".join(rows)

    lines = [
        f"# Written by kiln (serving/triton) for {served.registered_model} version {served.version}, the",
        "# champion; `kiln release`/`kiln rollback --triton` rewrite it. Edits are overwritten.",
        f"name: {json.dumps(served.name)}",
        'backend: "python"',
        f"max_batch_size: {served.max_batch_size}",
        f"version_policy: {{ specific: {{ versions: [ {int(served.version)} ] }} }}",
        f"input [\n{tensors(served.inputs, 'input')}\n]",
        f"output [\n{tensors(served.outputs, 'output')}\n]",
        f"instance_group [ {{ kind: {served.kind} count: {instances} }} ]",
        f'parameters: {{ key: "{THREADS_PARAMETER}" value: {{ string_value: "{threads}" }} }}',
    ]
    if batched:
        sizes = served.preferred_batch_sizes if served.kind == "KIND_GPU" else ()
        preferred = ", ".join(str(b) for b in sizes)
        lines.append(
            "dynamic_batching { "
            + (f"preferred_batch_size: [ {preferred} ] " if preferred else "")
            + f"max_queue_delay_microseconds: {queue_delay_us} }}"
        )
    return "\n".join(lines) + "\n"
