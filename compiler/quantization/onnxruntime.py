"""ONNX Runtime's quantization recipe: a fingerprint's partitions as QDQ ONNX graphs, canonically named.

The recipe of ONNX Runtime and TensorRT engines (steps 3-4 of :mod:`compiler.quantization.quantize`):
each partition lowered to fp32 ONNX, its constant subgraphs folded, ONNX Runtime's basic optimizations
run, quantized by ``onnxruntime.quantization`` (static QDQ or dynamic) and canonicalized, so the
instances of one fingerprint share one graph and differ only in their tensors. Every recipe module
(this one, :mod:`compiler.quantization.pt2e`, :mod:`compiler.quantization.rowwise`) has the same
entry point, :func:`quantize_fingerprint` (:mod:`compiler.quantization.recipe`).
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper

from compiler.errors import QuantizationError
from compiler.partitioning.partition import QUANTIZED_PREFIX
from compiler.quantization.recipe import RecipeCall

# The quantizer reads each partition lowered in fp32.
FLOAT_PRECISION = "fp32"


def quantize_fingerprint(call: RecipeCall) -> tuple[bytes, dict[str, torch.Tensor]]:
    """(the canonical quantized graph, each instance's tensors) for the partitions of one fingerprint,
    quantized with the call's recipe and calibrated on its feeds (:class:`RecipeCall`)."""
    plan, parts, feeds, settings, fp = call.plan, call.parts, call.feeds, call.recipe, call.fp
    from compiler.backends.onnxruntime import OnnxRuntimeBackend
    from compiler.engine_build.lower import lower_float
    from compiler.partitioning.dedup import canonical_weights

    by_name = {p.name: p for p in plan.partitions}
    float_graph = lower_float(plan, by_name[parts[0]], FLOAT_PRECISION, fp).onnx
    every = plan.weights()
    template: bytes | None = None
    graph = b""
    tensors: dict[str, torch.Tensor] = {}
    for name in parts:
        weights = {
            k: every[key].float() if every[key].is_floating_point() else every[key]
            for k, key in canonical_weights(by_name[name]).items()
        }
        own_graph = float_graph if name == parts[0] else OnnxRuntimeBackend().refit(float_graph, weights)
        model = _folded(onnx.load_from_string(own_graph))
        quantized = _run_quantizer(model, feeds.get(name, []), settings)
        structure, canonical, values = _canonical(quantized, settings["scales"] == "graph")
        if template is None:
            template, graph = structure, canonical
        elif structure != template:
            raise QuantizationError(
                f"{name}: its quantized graph differs from {parts[0]}'s (same fingerprint), so the two "
                "cannot share one engine"
            )
        tensors.update({f"{QUANTIZED_PREFIX}{name}/{k}": v for k, v in values.items()})
    return graph, tensors


def _folded(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every ``Transpose`` of an initializer replaced by the transposed initializer.

    Lowering keeps weights as graph inputs until after export, so ``Transpose(w)`` before a MatMul
    (every ``nn.Linear`` on a 3-D input) is still a node: the quantizer would then quantize the
    transposed weight as an activation and leave the fp32 weight in the graph. Folded, the MatMul
    reads an initializer and gets per-channel int8 weights. Only this one pattern is folded: a
    general constant folder may bake traced shapes into a graph with dynamic dimensions."""
    graph = model.graph
    inits = {init.name: init for init in graph.initializer}
    users: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            users[name] = users.get(name, 0) + 1
    keep = []
    for node in graph.node:
        source = node.input[0] if node.op_type == "Transpose" and node.input else ""
        if source in inits and users.get(source) == 1:
            perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
            array = numpy_helper.to_array(inits[source])
            folded = np.ascontiguousarray(np.transpose(array, perm) if perm else array.T)
            inits[source].CopyFrom(numpy_helper.from_array(folded, node.output[0]))
            continue
        keep.append(node)
    del graph.node[:]
    graph.node.extend(keep)
    return model


_METHODS = {
    "minmax": "MinMax",
    "entropy": "Entropy",
    "percentile": "Percentile",
    "distribution": "Distribution",
}


def _run_quantizer(
    model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], settings: Mapping[str, Any]
) -> onnx.ModelProto:
    """ONNX Runtime's quantizer on ``model`` with the recipe ``settings`` names
    (``CompileOptions.quantization_settings``), through files: it takes paths and rewrites its input.
    The layers ``settings["float_layers"]`` names (accuracy repair's choice) are left in float."""
    with tempfile.TemporaryDirectory(prefix="kiln-quantize-") as tmp, quiet_quantizer():
        source = prepared(model, Path(tmp))
        return run_static(source, Path(tmp), feeds, settings, exclude=settings.get("float_layers", ()))


def prepared(model: onnx.ModelProto, folder: Path) -> Path:
    """``model`` as the quantizer reads it (basic optimizations run), saved in ``folder``."""
    source = folder / "float.onnx"
    onnx.save_model(model, source)
    _optimize_basic(source, source)
    return source


def run_static(
    source: Path,
    folder: Path,
    feeds: list[dict[str, np.ndarray]],
    settings: Mapping[str, Any],
    *,
    exclude: Sequence[str] = (),
    only: Sequence[str] = (),
    ranges: Path | None = None,
) -> onnx.ModelProto:
    """The quantizer on a :func:`prepared` graph: every layer but ``exclude`` (or only ``only``).
    ``ranges``: a calibration cache file (ONNX Runtime's JSON of tensor ranges): written by the first
    call, read by the next, so a layer search calibrates once."""
    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_dynamic,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.rows: Iterator[dict[str, np.ndarray]] = iter(feeds)

        def get_next(self) -> dict[str, np.ndarray] | None:
            return next(self.rows, None)

    target = folder / "int8.onnx"
    if settings["mode"] == "dynamic":
        quantize_dynamic(
            source,
            target,
            per_channel=True,
            weight_type=QuantType.QInt8,
            reduce_range=bool(settings.get("reduce_range")),
            nodes_to_exclude=list(exclude),
            nodes_to_quantize=list(only),
        )
        return onnx.load(target)
    if not feeds and not (ranges is not None and ranges.is_file()):
        raise QuantizationError("no calibration inputs reached this partition")
    shapes = {tuple((k, a.shape) for k, a in sorted(feed.items())) for feed in feeds}
    if settings["method"] == "distribution" and len(shapes) > 1:
        raise QuantizationError(
            "ONNX Runtime's float8 calibrator (distribution) stacks its samples: every "
            f"calibration sample must reach this partition in one shape, got {len(shapes)} shapes"
        )
    types = {
        # uint8 activations (U8S8): with int8 ones BERT's embeddings partition (a Gather over the
        # vocabulary table) ran at 22-50x fp32 latency at batch 1
        # (benchmarks/probes/probe_qdq_types.py).
        "u8s8": (QuantType.QUInt8, QuantType.QInt8, {}),
        # TensorRT: zero points 0 on both sides, biases stay float (it has no int32 dequantize).
        "s8s8-symmetric": (QuantType.QInt8, QuantType.QInt8, _SYMMETRIC),
        "e4m3fn-symmetric": (QuantType.QFLOAT8E4M3FN, QuantType.QFLOAT8E4M3FN, _SYMMETRIC),
    }
    activations, weights, extra = types[settings["types"]]
    # TensorRT: Q/DQ at the inputs of GEMMs and convolutions only, where its int8 and fp8 kernels
    # are (it propagates them on). A quantized constant of an elementwise op (BERT's attention
    # scale) is refused ("Quantized constant is only allowed before DQ"), and ONNX Runtime's
    # float8 calibrator fails on a Softmax's [0, 1] range ("Attributes 'avg' and/or 'std'
    # missing") and on zero biases (scale 0: "Initializer has nan").
    ops = quantized_ops(settings)
    if ops and not any(node.op_type in ops for node in onnx.load(source).graph.node):
        raise QuantizationError(f"no {', '.join(ops)} to quantize (TensorRT's are in GEMMs)")
    quantize_static(
        source,
        target,
        Reader(),
        quant_format=QuantFormat.QDQ,
        per_channel=bool(settings["per_channel"]),
        activation_type=activations,
        weight_type=weights,
        calibrate_method=getattr(CalibrationMethod, _METHODS[settings["method"]]),
        extra_options=dict(extra),
        op_types_to_quantize=ops,
        nodes_to_exclude=list(exclude),
        nodes_to_quantize=list(only),
        calibration_cache_path=ranges,
        reduce_range=bool(settings.get("reduce_range")),  # 7-bit weights: see the backend's record
    )
    model = onnx.load(target)
    float_inputs(model.graph, exclude)
    return model


def float_inputs(graph: onnx.GraphProto, kept: Sequence[str]) -> None:
    """Layers ``kept`` in float read their activations as float. The quantizer leaves them out, but an
    activation it quantizes for another consumer reaches them through that consumer's Quantize/
    Dequantize pair: ONNX Runtime then computes them on rounded inputs, and TensorRT, which builds an
    int8 GEMM wherever both operands come through DequantizeLinear, in int8 (its H100 build of a kept
    attention MatMul did, benchmarks/tensorrt_mixed_precision_proof.py). Each such input is wired to the
    float tensor the pair rounds; pairs nothing reads any more are removed."""
    if not kept:
        return
    producer = {out: node for node in graph.node for out in node.output}
    names = set(kept)
    for node in graph.node:
        if node.name not in names:
            continue
        for i, tensor in enumerate(node.input):
            dq = producer.get(tensor)
            q = producer.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
            if q is not None and q.op_type == "QuantizeLinear":
                node.input[i] = q.input[0]
    while True:  # drop pairs left without readers (a Dequantize first, then its Quantize)
        read = {t for node in graph.node for t in node.input} | {o.name for o in graph.output}
        dead = [
            n
            for n in graph.node
            if n.op_type in ("QuantizeLinear", "DequantizeLinear") and n.output[0] not in read
        ]
        if not dead:
            return
        for n in dead:
            graph.node.remove(n)


def quantized_ops(settings: Mapping[str, Any]) -> list[str] | None:
    """The op types the quantizer is given (``op_types_to_quantize``): None (its default: every op it
    knows) for ONNX Runtime's u8s8, GEMMs and convolutions only for TensorRT's types (see run_static)."""
    return None if settings["types"] == "u8s8" else ["MatMul", "Gemm", "Conv"]


_SYMMETRIC = {"ActivationSymmetric": True, "WeightSymmetric": True, "QuantizeBias": False}


def _optimize_basic(source: Path, target: Path) -> None:
    """ONNX Runtime's basic graph optimizations on ``source`` (what its ``quant_pre_process`` runs):
    constant folding and fusions of standard ops, Conv+BatchNorm among them. Unfused, each BatchNorm
    runs in fp32 between a DequantizeLinear and a QuantizeLinear that the fp32 engine never had:
    ResNet-50 int8 ran at 0.99x fp32 on the AMX host, its BatchNorms, Q/DQ and layout Transposes
    taking 3x the int8 convolutions' time (benchmarks/probes/probe_resnet_int8.py). Basic level emits only
    standard ONNX ops, so the result still parses anywhere (TensorRT included)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    options.optimized_model_filepath = str(target)
    options.log_severity_level = 3
    ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
    # It imports every domain it registers (com.microsoft, nchwc, ...): keep those the nodes use.
    model = onnx.load(target)
    used = {node.domain for node in model.graph.node}
    kept = [o for o in model.opset_import if o.domain in used or o.domain in ("", "ai.onnx")]
    del model.opset_import[:]
    model.opset_import.extend(kept)
    onnx.save_model(model, target)


def _canonical(
    model: onnx.ModelProto, scales_in_graph: bool = False
) -> tuple[bytes, bytes, dict[str, torch.Tensor]]:
    """(structure: the graph without initializer values, the graph, initializer ``w<k>`` -> tensor).

    ``scales_in_graph`` (TensorRT): only quantized weights (what a DequantizeLinear reads) and float
    tensors are refit tensors; Q/DQ scales, zero points, scalars and integer constants (shapes, axes) are
    constants ``c<k>`` of the graph and of its structure. TensorRT compiles scales into its kernels
    and refuses to mark them, or a shape's constant, refittable
    (benchmarks/results/tensorrt_rtx_quantized_build_proof.json). A scale that is not positive (a
    range of zeros: every value quantizes to 0 whatever the scale) becomes 1, which it requires."""
    graph = model.graph
    keep = {i.name for i in graph.input} | {o.name for o in graph.output}
    if scales_in_graph:
        _positive_scales(graph)
    scales = _graph_constants(graph) if scales_in_graph else set()
    constants = [init.name for init in graph.initializer if init.name in scales]
    weights = [init.name for init in graph.initializer if init.name not in scales]
    inits = {**{n: f"c{k}" for k, n in enumerate(constants)}, **{n: f"w{k}" for k, n in enumerate(weights)}}
    values: dict[str, str] = {}

    def rename(name: str) -> str:
        if not name or name in keep:
            return name
        return inits.get(name) or values.setdefault(name, f"v{len(values)}")

    tensors = {}
    for init in graph.initializer:
        init.name = rename(init.name)
        if init.name.startswith("w"):
            tensors[init.name] = _tensor(init)
    for index, node in enumerate(graph.node):
        node.name = f"n{index}"
        node.input[:] = [rename(n) for n in node.input]
        node.output[:] = [rename(n) for n in node.output]
    for info in graph.value_info:
        info.name = rename(info.name)
    del model.metadata_props[:]
    structure = copy.deepcopy(model)
    for init in structure.graph.initializer:
        if init.name.startswith("c"):  # compiled in: part of the structure
            continue
        init.ClearField("raw_data")
        for attr in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
            init.ClearField(attr)
    return structure.SerializeToString(), model.SerializeToString(), tensors


def _graph_constants(graph: onnx.GraphProto) -> set[str]:
    """The initializers TensorRT must see as constants (see :func:`_canonical`)."""
    params, quantized = set(), set()
    for node in graph.node:
        if node.op_type in ("QuantizeLinear", "DequantizeLinear"):
            params.update(node.input[1:])
            if node.op_type == "DequantizeLinear":
                quantized.add(node.input[0])
    floating = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    constants = set()
    for init in graph.initializer:
        # Scalars stay constants: a refittable quantized scalar (BERT's attention scale, quantized as
        # Mul's operand) is refused ("Quantized constant is only allowed before DQ").
        tensor = init.name not in params and np.prod(init.dims) > 1
        if tensor and (init.name in quantized or init.data_type in floating):
            continue
        constants.add(init.name)
    return constants


def _positive_scales(graph: onnx.GraphProto) -> None:
    """Every Q/DQ scale that is not positive (a range of zeros) set to 1, in place: TensorRT requires
    positive scales, and every value of such a range quantizes to 0 whatever the scale."""
    scales = {node.input[1] for node in graph.node if node.op_type in ("QuantizeLinear", "DequantizeLinear")}
    for init in graph.initializer:
        if init.name in scales and init.data_type == onnx.TensorProto.FLOAT:
            scale = numpy_helper.to_array(init)
            if not (np.isfinite(scale) & (scale > 0)).all():
                fixed = np.where(np.isfinite(scale) & (scale > 0), scale, np.float32(1)).astype(np.float32)
                init.CopyFrom(numpy_helper.from_array(fixed, init.name))


def _tensor(init: onnx.TensorProto) -> torch.Tensor:
    array = np.array(numpy_helper.to_array(init))
    if init.data_type == onnx.TensorProto.FLOAT8E4M3FN:  # an ml_dtypes array: torch takes its bytes
        return torch.from_numpy(array.view(np.uint8)).view(torch.float8_e4m3fn)
    return torch.from_numpy(array)


@contextlib.contextmanager
def quiet_quantizer() -> Iterator[None]:
    """ONNX Runtime's quantizer logs advice ("consider pre-processing") on the root logger per call,
    and its histogram calibrators print progress to stdout."""
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            yield
    finally:
        root.setLevel(level)
