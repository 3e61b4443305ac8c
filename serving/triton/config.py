"""What Triton is told about a served version: its signature and the ``config.pbtxt`` written from it.

A :class:`ServedModel` is written beside each staged package (``<repository>/<model>/<N>/kiln.json``)
when the version is staged, from what the package's manifest records (:func:`served_model`): its input
specs (names, dtypes, shape ranges; a keyword-input model is served under its input names) and its
output specs, recorded at compile from the exported program. Nothing runs on the exporting host, so
any host describes any engine target (a CUDA version on a CPU-only host). ``config.pbtxt`` is rendered
from the champion's ``ServedModel`` alone, so a release or rollback rewrites it without torch.

Every value that reaches ``config.pbtxt`` is checked when a ``ServedModel`` is made or read back
(:data:`NAME_RULE` for model and tensor names, digits for versions, integers for sizes, a closed set
of dtypes and targets), and strings are written quoted and escaped: a ``kiln.json`` edited to carry a
newline or a quote cannot add lines to the config (``default_model_filename``, another backend).

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
import re
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
DEFAULT_INSTANCES = 0  # automatic: instance_count
GPU_INSTANCES = 2
# Intra-op threads per model instance (ONNX Runtime's and torch's); 0: one per core of the serving
# machine left after Triton's own (see runtime.instance_threads).
DEFAULT_THREADS = 0
THREADS_PARAMETER = "kiln_threads"
SERVED_FILE = "kiln.json"  # the ServedModel beside a staged package
PACKAGE_DIR = "package"  # the verified package inside a version folder
BACKEND_FILE = "model.py"  # kiln's Python backend, the same bytes in every version folder
METHODS = ("forward", "generate")  # ServedModel.method


# Model and tensor names Triton is given: letters, digits, '_', '.', '-' (no quote, newline or space,
# which a config line or a model path would have to escape), not starting with '.' or '-'.
NAME_RULE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]{0,127}")
_DIGITS = re.compile(r"[0-9]{1,9}")
_HASH = re.compile(r"[0-9a-f]{64}")
_ENGINE_TARGET = re.compile(r"[a-z][a-z0-9_]{0,15}(:[a-z0-9_]{1,16})?")  # cpu, cuda:sm_90
_TARGET = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:\-]{0,63}")


def checked_name(value: Any, what: str) -> str:
    """``value`` when it is a string matching :data:`NAME_RULE`; TritonConfigError naming ``what``."""
    if not isinstance(value, str) or NAME_RULE.fullmatch(value) is None:
        raise TritonConfigError(
            f"{what} is {value!r:.80}, which Triton cannot be given: expected letters, digits, '_', '.' "
            "or '-' (at most 128, not starting with '.' or '-')"
        )
    return value


def checked_int(value: Any, what: str, *, minimum: int) -> int:
    """``value`` when it is an integer (not a bool, not a string) >= ``minimum``; else TritonConfigError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TritonConfigError(f"{what} is {value!r:.40}; expected an integer >= {minimum}")
    return value


def checked_target(value: Any, what: str) -> str:
    """A registry target as the CLI takes it (``cpu``, ``cuda``, ``cuda:sm_90``, ``cuda_sm_90``)."""
    return _matching(value, _TARGET, what, "a target like 'cpu', 'cuda' or 'cuda:sm_90'")


def _matching(value: Any, rule: re.Pattern, what: str, expected: str) -> str:
    if not isinstance(value, str) or rule.fullmatch(value) is None:
        raise TritonConfigError(f"{what} is {value!r:.80}; expected {expected}")
    return value


def triton_type(dtype: str, what: str) -> str:
    """``TYPE_FP32`` for ``float32``; TritonConfigError naming ``what`` (``input 'x'``) otherwise."""
    try:
        return TRITON_TYPES[dtype]
    except KeyError:
        raise TritonConfigError(
            f"{what} has dtype {dtype}, which Triton has no type for (it takes {sorted(TRITON_TYPES)}); "
            "compile the model with that input or output in one of those dtypes to serve it on Triton"
        ) from None


@dataclass(frozen=True)
class TensorSig:
    """One input or output: name, kiln dtype, full shape with -1 for every dynamic axis (batch included);
    ``optional``: an input a request may leave out (a generation version's sampling parameters)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    optional: bool = False

    def __post_init__(self) -> None:
        checked_name(self.name, "a tensor name")
        if not isinstance(self.optional, bool):
            raise TritonConfigError(f"tensor {self.name!r}: optional is {self.optional!r:.40}; expected bool")
        if not isinstance(self.shape, list | tuple):
            raise TritonConfigError(f"tensor {self.name!r}: shape is {self.shape!r:.40}; expected a list")
        object.__setattr__(
            self,
            "shape",
            tuple(checked_int(d, f"tensor {self.name!r} shape", minimum=-1) for d in self.shape),
        )


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
    # How the backend calls the loaded package: "forward" (its inputs, as the manifest records them) or
    # "generate" (a generation package: token ids in, token ids out; serving/triton/generation.py).
    method: str = "forward"

    def __post_init__(self) -> None:
        checked_name(self.name, "the model name")
        checked_name(self.registered_model, "the registered model")
        _matching(self.version, _DIGITS, "the version", "decimal digits")
        _matching(self.content_hash, _HASH, "the content hash", "64 lowercase hex digits")
        _matching(self.engine_target, _ENGINE_TARGET, "the engine target", "one like 'cpu' or 'cuda:sm_90'")
        checked_int(self.max_batch_size, "max_batch_size", minimum=0)
        for size in self.preferred_batch_sizes:
            checked_int(size, "a preferred batch size", minimum=1)
        if self.signature_key:
            _matching(self.signature_key, _HASH, "the signature key", "64 lowercase hex digits")
        if self.method not in METHODS:
            raise TritonConfigError(f"the method is {self.method!r:.40}; expected one of {list(METHODS)}")
        for sig in self.inputs:
            triton_type(sig.dtype, f"input {sig.name!r} of {self.registered_model}")
        for sig in self.outputs:
            triton_type(sig.dtype, f"output {sig.name!r} of {self.registered_model}")
        if not self.outputs:
            raise TritonConfigError(f"{self.registered_model} version {self.version} returns no tensor")
        if not self.inputs:
            raise TritonConfigError(f"{self.registered_model} version {self.version} takes no tensor")

    @property
    def kind(self) -> str:
        return "KIND_GPU" if self.engine_target.startswith("cuda") else "KIND_CPU"

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str) -> ServedModel:
        """Read ``kiln.json`` back; every field keeps its type (no coercion: a version written as a
        number or a size as a string is refused by name, as is anything :meth:`__post_init__` refuses)."""
        try:
            data: dict[str, Any] = json_reader.loads(text, where)
            if not isinstance(data, dict):
                raise TypeError(f"expected an object, got {type(data).__name__}")

            def sigs(key: str) -> tuple[TensorSig, ...]:
                return tuple(
                    TensorSig(s["name"], s["dtype"], s["shape"], s.get("optional", False)) for s in data[key]
                )

            return cls(
                name=data["name"],
                registered_model=data["registered_model"],
                version=data["version"],
                content_hash=data["content_hash"],
                engine_target=data["engine_target"],
                inputs=sigs("inputs"),
                outputs=sigs("outputs"),
                max_batch_size=data["max_batch_size"],
                preferred_batch_sizes=tuple(data["preferred_batch_sizes"]),
                signature_key=data.get("signature_key", ""),
                method=data.get("method", "forward"),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise TritonConfigError(
                f"{where} is not a kiln served-model record ({exc}); export again"
            ) from exc


def served_model(
    *,
    name: str,
    registered: str,
    version: str,
    content_hash: str,
    engine_target: str,
    inputs: Sequence[Any],
    outputs: Sequence[Any],
    profiles: Sequence[Mapping[str, Any]] = (),
) -> ServedModel:
    """The :class:`ServedModel` of a version from its input specs and output specs (``InputSpec``,
    ``OutputSpec``: what the manifest records), torch-free. The batch axis is Triton's when every
    input's axis 0 is one named dimension from 1 and every output's axis 0 is that dimension."""
    batch = batch_axis(inputs)
    if batch is not None and not all(o.rank and o.dynamic_dims.get(0) == batch[0] for o in outputs):
        batch = None
    ins = tuple(
        TensorSig(
            spec.name,
            spec.dtype,
            [-1 if axis in spec.dynamic_dims else d for axis, d in enumerate(spec.max_shape)],
        )
        for spec in inputs
    )
    outs = tuple(
        TensorSig(
            out.name,
            out.dtype,
            [-1 if axis in out.dynamic_dims else d for axis, d in enumerate(out.max_shape)],
        )
        for out in outputs
    )
    record = ServedModel(name, registered, version, content_hash, engine_target, ins, outs)
    if batch is None:
        return record
    dim, max_batch = batch
    return ServedModel(
        name,
        registered,
        version,
        content_hash,
        engine_target,
        ins,
        outs,
        max_batch,
        preferred_sizes(profiles, dim, max_batch),
    )


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


def instance_count(configured: int, kind: str) -> int:
    """Model instances to run: ``configured``, or where it is 0 (automatic) two per GPU, one on the CPU.
    Two instances on one GPU overlap one instance's per-request Python work with the other's kernels:
    on the H100 a BERT-base version served 2,859 requests/s at 16 clients with one and 3,409 with two,
    0.48x and 0.72x the package in-process (benchmarks/results/triton_serving_cuda_bert_h100_*). On the
    CPU instances share the cores, so one with all the threads is kiln's choice."""
    checked_int(configured, "instances (0: automatic)", minimum=0)
    return configured or (GPU_INSTANCES if kind == "KIND_GPU" else 1)


def render_config(
    served: ServedModel,
    *,
    queue_delay_us: int = DEFAULT_QUEUE_DELAY_US,
    instances: int = DEFAULT_INSTANCES,
    threads: int = DEFAULT_THREADS,
    stream: bool = False,
) -> str:
    """``config.pbtxt`` serving exactly ``served.version`` (the champion) of ``served.name``. ``stream``:
    a generation version answers each request with one response per generated token (Triton's
    decoupled transaction policy; serving/triton/generation.py), for gRPC streaming clients."""
    instances = instance_count(instances, served.kind)
    if not isinstance(stream, bool):
        raise TritonConfigError(f"stream is {stream!r:.40}; expected true or false")
    if stream and served.method != "generate":
        raise TritonConfigError(
            f"{served.registered_model} version {served.version} is not a generation version (it is served "
            "by its forward pass, one answer per request): streaming tokens (--stream-tokens) needs a "
            "package compiled with task: text-generation; export it without --stream-tokens"
        )
    checked_int(threads, "threads (0: automatic)", minimum=0)
    checked_int(queue_delay_us, "the queue delay in microseconds", minimum=0)
    batched = served.max_batch_size > 0

    def tensors(sigs: Sequence[TensorSig], what: str) -> str:
        rows = []
        for sig in sigs:
            dims = sig.shape[1:] if batched else sig.shape
            kind = triton_type(sig.dtype, f"{what} {sig.name!r}")
            shape = ", ".join(str(d) for d in dims)
            optional = " optional: true" if sig.optional else ""
            rows.append(f"  {{ name: {json.dumps(sig.name)} data_type: {kind} dims: [ {shape} ]{optional} }}")
        return ",\n".join(rows)

    # served's fields were checked when it was made (names, digits): no value can end the comment line.
    lines = [
        f"# Written by kiln (serving/triton) for {served.registered_model} version {served.version}, the",
        "# champion; `kiln release`/`kiln rollback --triton` rewrite it. Edits are overwritten.",
        f"name: {json.dumps(served.name)}",
        'backend: "python"',
        f"max_batch_size: {int(served.max_batch_size)}",
        f"version_policy: {{ specific: {{ versions: [ {int(served.version)} ] }} }}",
        f"input [\n{tensors(served.inputs, 'input')}\n]",
        f"output [\n{tensors(served.outputs, 'output')}\n]",
        f"instance_group [ {{ kind: {served.kind} count: {instances} }} ]",
        f'parameters: {{ key: "{THREADS_PARAMETER}" value: {{ string_value: "{threads}" }} }}',
    ]
    if stream:  # several responses per request, the last flagged final: gRPC streaming only
        lines.append("model_transaction_policy { decoupled: true }")
    if batched:
        sizes = served.preferred_batch_sizes if served.kind == "KIND_GPU" else ()
        preferred = ", ".join(str(b) for b in sizes)
        lines.append(
            "dynamic_batching { "
            + (f"preferred_batch_size: [ {preferred} ] " if preferred else "")
            + f"max_queue_delay_microseconds: {queue_delay_us} }}"
        )
    return "\n".join(lines) + "\n"
