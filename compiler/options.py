"""CompileOptions: every setting of one compile, in one value object (no long argument lists)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

# Options are built wherever a zoo file is read (a no-op re-run included): these imports need no torch.
from compiler.backends.base import PRECISIONS, QUANTIZED_PRECISIONS, BuildSettings
from compiler.backends.capabilities import (
    Quantizing,
    backend_names,
    capabilities,
    capturable,
    is_backend,
    quantizing_backends,
)
from compiler.device_name import check_device
from compiler.errors import CudaGraphError, OptionsError
from compiler.inputs.profiles import Size, normalize, to_json

CUDA_GRAPH_MODES = ("auto", "on", "off")


def check_mode(mode: str, device: str, backend: str, on_build_failure: str) -> None:
    """CudaGraphError unless ``mode`` is a mode and, when it is ``"on"``, the compile can be graphed."""
    if mode not in CUDA_GRAPH_MODES:
        raise CudaGraphError(f"cuda_graphs {mode!r} is not supported; expected one of {CUDA_GRAPH_MODES}")
    if mode != "on":
        return
    if not str(device).startswith("cuda"):
        raise CudaGraphError(
            f"cuda_graphs 'on' needs a CUDA device; this model runs on {device!r} (CUDA graphs replay GPU "
            "work only): use device 'cuda', or cuda_graphs 'auto' or 'off'"
        )
    for role, name in (("backend", backend), ("on_build_failure", on_build_failure)):
        if is_backend(name) and not capabilities(name).cuda_graph_capture:
            capturing = [n for n in backend_names() if capturable(n) and n != "auto"]
            raise CudaGraphError(
                f"cuda_graphs 'on' with {role} {name!r}: {capabilities(name).no_capture}; use backend "
                f"{' or '.join(repr(n) for n in capturing)} (and on_build_failure 'torch'), or cuda_graphs "
                "'auto'"
            )


# What a partition whose engine build fails becomes (see CompileOptions.on_build_failure).
ON_BUILD_FAILURE = ("torch", "onnxruntime", "error")
# What a compile that misses its accuracy tolerances does (see CompileOptions.on_accuracy_failure).
ON_ACCURACY_FAILURE = ("repair", "error")
# What one partition may be set to (CompileOptions.partition_precision): a precision, or "torch".
PARTITION_LEVELS = (*PRECISIONS, "torch")
# How a quantized partition is quantized: "static" (activation scales calibrated on data, QDQ graph)
# or "dynamic" (weights quantized ahead, activations at run time; no calibration data).
QUANTIZATION_MODES = ("static", "dynamic")
CALIBRATION_METHODS = ("minmax", "entropy", "percentile")
# The layer search's time budget (CompileOptions.repair_seconds): the sensitivity of a 4-layer BERT's
# ~110 layers and one verifying rebuild took ~100 s through kiln zoo on 2 CPU cores shared with other work.
DEFAULT_REPAIR_SECONDS = 300.0
# Whether a batch between profiles is padded up to the next one (compiler.runtime.padding).
PAD_TO_PROFILE = ("off", "auto")


@dataclass(frozen=True)
class Calibration:
    """Where a static int8 compile's activation ranges come from (``compiler.quantize``).

    ``data``: recorded inputs in the validation-data formats (``.safetensors``/``.npz``, one array
    per model input with a leading sample axis); ``None`` means random inputs, which give meaningless
    scales and are refused unless ``allow_random``. ``samples``: how many (the first N); fewer is a
    warning naming the count. ``method``: ONNX Runtime's calibrator (``minmax``, ``entropy``,
    ``percentile``). The samples used are never validated on (``compiler.quantization.quantize.held_out``).
    ``ignore_fields``: recorded fields to leave out, which no model input takes (``token_type_ids``
    from a tokenizer, for a model without them): any other field is an error naming this list.
    """

    data: str | None = None
    samples: int = 16
    method: str = "minmax"
    allow_random: bool = False
    ignore_fields: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.method not in CALIBRATION_METHODS:
            raise OptionsError(
                f"calibration.method {self.method!r} is not supported; expected one of {CALIBRATION_METHODS}"
            )
        if isinstance(self.samples, bool) or not isinstance(self.samples, int) or self.samples < 1:
            raise OptionsError(f"calibration.samples must be an integer >= 1, got {self.samples!r}")
        if self.data is not None:
            object.__setattr__(self, "data", str(self.data))
        if isinstance(self.ignore_fields, str) or not all(isinstance(f, str) for f in self.ignore_fields):
            raise OptionsError(
                f"calibration.ignore_fields must be a list of field names, got {self.ignore_fields!r}"
            )
        object.__setattr__(self, "ignore_fields", tuple(self.ignore_fields))

    def to_dict(self) -> dict:
        data = asdict(self)
        if not self.ignore_fields:  # unset: the same dict (and so the same keys) as before the field
            del data["ignore_fields"]
        else:
            data["ignore_fields"] = list(self.ignore_fields)
        return data


@dataclass(frozen=True)
class CompileOptions:
    """What to build and how.

    ``split_modules``: ``None`` (capability partitioning only), ``"auto"`` (detect repeated blocks) or
    class names (e.g. ``("BertLayer",)``) whose instances each become their own engine, so build time
    grows with the number of unique blocks, not with depth.

    ``strip_weights``: build engines without their weights (names, shapes and dtypes kept; a load puts
    them in, as a refit). A build setting: the engine cache holds what it asked for and the compiled
    module runs those engines. A package (``compiler.save``) holds each weight once, in its weights
    file, whatever it says for ONNX Runtime and Inductor engines: they are stored stripped (a package
    load passes every engine its weights and never read an engine's own copy); TensorRT engines are
    stored as built (a built plan is stripped only by TensorRT on its GPU; its load refits either way).

    ``on_build_failure``: what a partition whose engine build fails (``EngineBuildError``) becomes:
    ``"torch"`` (its original submodule runs eagerly in PyTorch, in the model's own precision),
    ``"onnxruntime"`` (the same lowered ONNX is built with ONNX Runtime; if that fails too, PyTorch) or
    ``"error"`` (the compile fails: strict release pipelines). The report lists every failure. It does
    not change an engine's bytes, so it is not a build setting and stays out of engine cache keys.

    ``on_accuracy_failure``: what a reduced-precision compile that misses its accuracy tolerances does:
    ``"error"`` (it fails; what a release must do) or ``"repair"`` (``compiler.repair`` raises the
    worst partitions one step, fp16/bf16 -> fp32 -> PyTorch, until the tolerances hold). Not a build
    setting.

    ``partition_precision``: per-partition exceptions to ``precision`` (partition name -> ``"fp32"``,
    ``"fp16"``, ``"bf16"`` or ``"torch"``: the partition runs as its PyTorch submodule). Repair writes
    it; a compile given the same options builds the same engines without repairing again. Only the
    named partitions' build settings change, so every other engine keeps its fingerprint and cache entry.

    ``cuda_graphs``: ``"auto"`` (CUDA devices replay the whole module as CUDA graphs where the
    compile-time capture check passes; the CPU runs without), ``"on"`` (required: a CudaGraphError for
    a CPU device, an ONNX Runtime backend or fallback, or a module the check refuses) or ``"off"``.
    See :mod:`compiler.runtime.cudagraphs`. A runtime setting: not a build setting, no engine changes.

    ``profiles``: shape profiles, one ``{dynamic dimension name: size or (min[, opt], max)}`` per
    profile (``({"batch": 1}, {"batch": 8}, {"batch": (9, 32)})``), checked against the input specs at
    partition time; on CUDA the fixed profiles' graphs are captured when the module is assembled, and
    each profile's latency is in the report. See :mod:`compiler.inputs.profiles`. A build setting: with
    Inductor each engine gets one static-shape specialization per fixed profile, run on an exact shape
    match; with TensorRT one optimization profile per profile, beside the declared range's.

    ``pad_to_profile``: ``"off"`` (default) or ``"auto"``: pad a batch up to the next profile where the
    compile-time check showed padded rows leave the real rows' outputs unchanged; refused per profile,
    with the reason, elsewhere (:mod:`compiler.runtime.padding`). Not a build setting.

    ``quantization`` and ``calibration``: how ``int8`` / ``fp8`` partitions are quantized
    (``compiler.quantize``): ``"static"`` (QDQ, activation scales calibrated on ``calibration.data``)
    or ``"dynamic"`` (weights ahead, activations at run time). Which backend builds which quantized
    precision, in which mode, on which device is its record in :mod:`compiler.backends.capabilities`;
    others are refused by name.
    """

    backend: str = "onnxruntime"
    precision: str = "fp32"
    strip_weights: bool = False
    min_block_size: int = 1
    torch_executed_ops: tuple[str, ...] = ()
    split_modules: str | tuple[str, ...] | None = None
    workspace_bytes: int | None = None
    optimization_level: int | None = None
    backend_options: Mapping[str, Any] = field(default_factory=dict)
    on_build_failure: str = "torch"
    # Where the model runs: its export inputs, engine builds, engine runtime and validation.
    device: str = "cpu"
    on_accuracy_failure: str = "error"
    partition_precision: Mapping[str, str] = field(default_factory=dict)
    cuda_graphs: str = "auto"
    profiles: tuple[Mapping[str, Size], ...] = ()
    quantization: str = "static"
    calibration: Calibration = field(default_factory=Calibration)
    pad_to_profile: str = "off"
    # partition -> layers kept in float inside it: what accuracy repair chose (compiler.accuracy.layers).
    # int8/fp8: nodes of its quantizer's float graph ("n42"); fp16/bf16: ops of its torch graph ("n57",
    # compiler.engine_build.float_ops). Only those partitions' keys change.
    float_layers: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # How long accuracy repair may search for the fewest layers to raise before it raises whole
    # partitions instead (seconds). Not a build setting.
    repair_seconds: float = DEFAULT_REPAIR_SECONDS

    def __post_init__(self) -> None:
        if isinstance(self.calibration, Mapping):
            object.__setattr__(self, "calibration", Calibration(**dict(self.calibration)))
        if self.quantization not in QUANTIZATION_MODES:
            raise OptionsError(
                f"quantization {self.quantization!r} is not supported; expected one of {QUANTIZATION_MODES}"
            )
        if self.on_accuracy_failure not in ON_ACCURACY_FAILURE:
            raise OptionsError(
                f"on_accuracy_failure {self.on_accuracy_failure!r} is not supported; expected one of "
                f"{ON_ACCURACY_FAILURE}"
            )
        wrong = {k: v for k, v in dict(self.partition_precision).items() if v not in PARTITION_LEVELS}
        if wrong:
            raise OptionsError(
                f"partition_precision {wrong} is not supported; each value is one of {PARTITION_LEVELS}"
            )
        object.__setattr__(
            self,
            "partition_precision",
            {str(k): str(v) for k, v in sorted(dict(self.partition_precision).items())},
        )
        check_device(self.device)
        capabilities(self.backend)  # a backend it knows (an OptionsError naming them otherwise)
        if self.precision not in PRECISIONS:
            raise OptionsError(f"precision {self.precision!r} is not supported; expected one of {PRECISIONS}")
        self._check_quantizing_backend()
        self._check_float_layers()
        if self.on_build_failure not in ON_BUILD_FAILURE:
            raise OptionsError(
                f"on_build_failure {self.on_build_failure!r} is not supported; expected one of "
                f"{ON_BUILD_FAILURE}"
            )
        if self.on_build_failure == self.backend:
            raise OptionsError(
                f"on_build_failure {self.on_build_failure!r} with backend {self.backend!r}: a backend cannot "
                "fall back to itself; use 'torch' or 'error'"
            )
        if not isinstance(self.min_block_size, int) or self.min_block_size < 1:
            raise OptionsError(f"min_block_size must be an integer >= 1, got {self.min_block_size!r}")
        object.__setattr__(self, "torch_executed_ops", tuple(str(op) for op in self.torch_executed_ops))
        split = self.split_modules
        if split is not None and split != "auto":
            split = (split,) if isinstance(split, str) else tuple(split)
            object.__setattr__(self, "split_modules", split)
        check_mode(self.cuda_graphs, self.device, self.backend, self.on_build_failure)
        object.__setattr__(self, "profiles", normalize(self.profiles))
        if self.pad_to_profile not in PAD_TO_PROFILE:
            raise OptionsError(
                f"pad_to_profile {self.pad_to_profile!r} is not supported; expected one of {PAD_TO_PROFILE}"
            )
        if self.pad_to_profile == "auto" and not self.profiles:
            raise OptionsError("pad_to_profile 'auto' needs profiles to pad to; give profiles or use 'off'")

    def _check_float_layers(self) -> None:
        layers = self.float_layers
        if not isinstance(layers, Mapping) or not all(
            isinstance(v, list | tuple) and all(isinstance(n, str) and n for n in v) for v in layers.values()
        ):
            raise OptionsError(
                f"float_layers must map partition names to lists of layer (node) names, got {layers!r}"
            )
        kept = {str(k): tuple(sorted(set(v))) for k, v in sorted(layers.items()) if v}
        object.__setattr__(self, "float_layers", kept)
        budget = self.repair_seconds
        if isinstance(budget, bool) or not isinstance(budget, int | float) or not budget >= 0:
            raise OptionsError(f"repair_seconds must be a number of seconds >= 0, got {budget!r}")
        object.__setattr__(self, "repair_seconds", float(budget))

    def _check_quantizing_backend(self) -> None:
        """Each quantized precision built by this backend on this device, in a mode it quantizes in
        (compiler.backends.capabilities), or an OptionsError naming what does."""
        levels = tuple(
            sorted({self.precision, *self.partition_precision.values()} & set(QUANTIZED_PRECISIONS))
        )
        record = capabilities(self.backend)
        for level in levels:
            if level not in record.quantizes:
                missing = record.refusals.get(level, f"backend {self.backend!r} has no {level} build here")
                names = ", ".join(repr(b) for b in quantizing_backends(level))
                raise OptionsError(
                    f"precision {level}: {missing}; {level} engines are built by {names} (name one), or "
                    "use a float precision"
                )
        record.check_quantizing(self._quantizing(), levels)

    def _quantizing(self) -> Quantizing:
        return Quantizing(self.backend, self.device, self.quantization, self.calibration.method)

    def build_settings(self, partition: str | None = None) -> BuildSettings:
        """The build settings of ``partition`` (its ``partition_precision``, else ``precision``); with
        no partition, the compile's. The map itself is left out: one partition's exception must not
        change every other engine's fingerprint and cache key."""
        # on_build_failure / on_accuracy_failure are left out on purpose: they decide what happens
        # after a build, not its bytes.
        precision = self.precision_of(partition) if partition is not None else self.precision
        return BuildSettings(
            precision=precision,
            strip_weights=self.strip_weights,
            workspace_bytes=self.workspace_bytes,
            optimization_level=self.optimization_level,
            options=dict(self.backend_options),
            quantization=self.partition_quantization(partition, precision),
            profiles=self.build_profiles(),
            float_ops=self.float_ops(partition) if partition is not None else (),
        )

    def build_profiles(self) -> tuple[Mapping[str, Size], ...]:
        """The profiles engines are built for (so they enter engine cache keys only where they change
        the engine): the backend's ``build_profiles`` policy (compiler.backends.capabilities)."""
        return capabilities(self.backend).profiles_built(self.profiles)

    def quantization_settings(self, precision: str = "int8") -> dict[str, Any]:
        """What decides a quantized graph's structure and types (where Q/DQ nodes go, which integer or
        float8 type each side takes, whether scales are refit or compiled in), so it enters
        fingerprints: the backend's record says (compiler.backends.capabilities). The calibration data
        does not: its values reach engines by refit (docs/compiler-api.md)."""
        return capabilities(self.backend).quantization_settings(self._quantizing(), precision)

    def partition_quantization(self, partition: str | None, precision: str) -> dict[str, Any] | None:
        """The recipe of one partition: ``quantization_settings(precision)`` with the layers it keeps in
        float (``float_layers``), which change its graph and so its key; None for a float partition."""
        if precision not in QUANTIZED_PRECISIONS:
            return None
        recipe = self.quantization_settings(precision)
        if partition is not None and self.float_layers.get(partition):
            recipe["float_layers"] = list(self.float_layers[partition])
        return recipe

    def float_ops(self, partition: str) -> tuple[str, ...]:
        """The ops of an fp16/bf16 partition kept in fp32 (``float_layers``: accuracy repair's choice,
        compiler.engine_build.float_ops); () for any other."""
        if self.precision_of(partition) not in ("fp16", "bf16"):
            return ()
        return tuple(self.float_layers.get(partition, ()))

    @property
    def quantized(self) -> bool:
        """Whether any partition is quantized (the compile's precision or a partition's exception)."""
        levels = {self.precision, *self.partition_precision.values()}
        return any(level in QUANTIZED_PRECISIONS for level in levels)

    def precision_of(self, partition: str) -> str:
        """``"fp32"``, ``"fp16"``, ``"bf16"``, ``"int8"``, ``"fp8"`` or ``"torch"`` (no engine) for one
        partition."""
        return self.partition_precision.get(partition, self.precision)

    def compute_precision(self, partition: str) -> str:
        """The float precision ``partition``'s engine computes in: its precision, or for a quantized
        one what its recipe's other ops compute in (its ``compute``; fp32, as the x86 and ONNX
        quantizers' graphs are)."""
        precision = self.precision_of(partition)
        if precision not in QUANTIZED_PRECISIONS:
            return precision
        return self.quantization_settings(precision).get("compute", "fp32")

    def to_dict(self) -> dict:
        data = asdict(self)
        data["partition_precision"] = dict(self.partition_precision)
        data["torch_executed_ops"] = list(self.torch_executed_ops)
        data["split_modules"] = (
            self.split_modules if isinstance(self.split_modules, str | None) else list(self.split_modules)
        )
        data["backend_options"] = dict(self.backend_options)
        data["profiles"] = to_json(self.profiles)
        data["calibration"] = self.calibration.to_dict()
        # Defaults left out, like pad_to_profile's: requests, keys and packages stay as before.
        data["float_layers"] = {k: list(v) for k, v in self.float_layers.items()}
        if not self.float_layers:
            del data["float_layers"]
        if self.repair_seconds == DEFAULT_REPAIR_SECONDS:
            del data["repair_seconds"]
        if self.pad_to_profile == "off":  # the default left out: requests, keys and packages stay as before
            del data["pad_to_profile"]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CompileOptions:
        data = dict(data)
        if isinstance(data.get("split_modules"), list):
            data["split_modules"] = tuple(data["split_modules"])
        data["torch_executed_ops"] = tuple(data.get("torch_executed_ops", ()))
        if isinstance(data.get("calibration"), Mapping):
            data["calibration"] = Calibration(**data["calibration"])
        return cls(**data)
