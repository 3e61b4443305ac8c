"""Layers inside a quantized partition: which nodes the quantizer touched, what each one costs, and how
much error each adds alone (the measurements accuracy repair's layer search ranks by).

A *layer* is a node of the partition's float ONNX graph as ONNX Runtime's quantizer reads it (lowered,
``Transpose(w)`` folded, basic optimizations run): its name (``n42``) is canonical, set by position at
lowering, so it names the same node in every instance of one fingerprint and in every compile of the
same model; it is what the quantizer's ``nodes_to_exclude`` takes. Each is described by its op and the
parameter it reads (``m.bert.encoder.layer.3.output.dense.weight``), so a report names it as a user would.

Graphs made by ONNX Runtime's quantizer (ONNX Runtime and TensorRT engines) have their layers here;
Inductor's, quantized in the partition's torch graph (PT2E, rowwise), have theirs in
:mod:`compiler.quantization.torch_layers`, named by node position in that graph (:func:`supports_layers`).
"""

from __future__ import annotations

import logging
import math
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from compiler.backends.capabilities import PT2E_GRAPH, QUANTIZED_GRAPH, ROWWISE_GRAPHS

_log = logging.getLogger(__name__)
# The ops whose work is counted as FLOPs (the GEMMs and convolutions, where int8 kernels pay off).
COMPUTE_OPS = ("MatMul", "Gemm", "Conv", "ConvTranspose")
# Ops that only move or look up values: never candidates (their Q/DQ follows their neighbours').
MOVING_OPS = (
    "Reshape",
    "Transpose",
    "Squeeze",
    "Unsqueeze",
    "Flatten",
    "Concat",
    "Slice",
    "Split",
    "Expand",
    "Shape",
    "Resize",
    "MaxPool",
    "Pad",
    "Identity",
)
# Sensitivities rank layers, the model's validation decides: a few samples rank as well as many.
RANKING_SAMPLES = 4
# The error a layer adds on top of the others is ranked on more: one sample whose logits are near zero
# can hold most of a model's relative error (a 4x256 BERT's classifier: none of it in the first four).
GAIN_SAMPLES = 16
INTEGER_TYPES = (onnx.TensorProto.INT8, onnx.TensorProto.UINT8)


def supports_layers(recipe: Mapping[str, Any] | None) -> bool:
    """Whether a partition of this recipe (``CompileOptions.partition_quantization``) can keep single
    layers in float: graphs of ONNX Runtime's quantizer take ``nodes_to_exclude``; Inductor's PT2E
    quantizer takes a module name with no config, and its rowwise rewrite a set of linears to skip."""
    return bool(recipe) and recipe.get("graph") in (QUANTIZED_GRAPH, PT2E_GRAPH, *ROWWISE_GRAPHS.values())


def relative_error(outputs: Sequence[Sequence[Any]], reference: Sequence[Sequence[Any]]) -> float:
    """The relative L2 error of ``outputs`` vs ``reference`` (per sample, per output: arrays), over all
    of them. A non-finite output is the worst error there is: ``inf``, never ``nan`` (which would rank
    anywhere and read as "not measured")."""
    num = den = 0.0
    for got, want in zip(outputs, reference, strict=False):
        for a, b in zip(got, want, strict=True):
            a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
            num += float(((a - b) ** 2).sum())
            den += float((b**2).sum())
    error = math.sqrt(num / den) if den > 0 else (0.0 if num == 0 else math.inf)
    return math.inf if math.isnan(error) else error


def added_error(full: float, without: float) -> float:
    """The error one layer adds on top of the others: the error with every layer quantized (``full``)
    less the error with that layer kept in float (``without``). Where its float copy makes the output
    finite again it adds ``inf`` (the worst); where the output stays non-finite without it, what it
    adds cannot be seen: 0."""
    if not math.isfinite(without):
        return 0.0
    return full - without


@dataclass(frozen=True)
class Layer:
    """One node the quantizer touched: its canonical name, op, the parameter it reads, its size."""

    name: str
    op: str
    weight: str  # the parameter (weight key) it reads, "" for none (attention's activation GEMMs)
    params: int  # elements of that parameter
    flops: int  # 2 x multiply-adds at the measured input shape (0 for ops that are not GEMMs/convolutions)

    @property
    def costly(self) -> bool:
        """Whether keeping it in float costs what int8 is for: int8 weights (a GEMM's, a convolution's, an
        embedding table's) or GEMM/convolution FLOPs. Elementwise ops and norms cost neither."""
        table = self.op in ("Gather", "embedding") and self.params > 0  # ONNX's op, or a torch graph's
        return self.op in COMPUTE_OPS or table or self.flops > 0

    def label(self) -> str:
        return f"{self.name} {self.op}" + (f" ({self.weight})" if self.weight else "")


@dataclass(frozen=True)
class LayerSensitivity:
    """A layer and its sensitivity: the partition's output error (relative L2 vs its float graph) with
    only it quantized (:meth:`LayerProbe.sensitivity`), or the error it adds on top of every other layer
    at int8 (:meth:`LayerProbe.gain`, what accuracy repair ranks and records). ``inf`` where it made the
    output non-finite (:func:`relative_error`); None where it was not measured (the search's deadline
    came first), written ``null``."""

    layer: Layer
    rel_l2: float | None
    alone: bool = False  # measured quantized alone (sensitivity), not on top of the others (gain)

    def to_dict(self) -> dict:
        rel_l2 = None if self.rel_l2 is None else _finite(self.rel_l2)
        return {**asdict(self.layer), "rel_l2": rel_l2, "alone": self.alone}


class LayerProbe:
    """One partition's float graph prepared and calibrated once; variants of it quantized from the
    cached ranges (no calibration pass each) and run on the evaluation feeds.

    ``float_graph``: the partition lowered in fp32 with its own weights (``lower_float``);
    ``weight_names``: canonical weight name (``w3``) -> weight key; ``calibration``/``evaluation``:
    feeds (``x0..xk`` -> array) captured at the partition's inputs."""

    def __init__(
        self,
        float_graph: bytes,
        weight_names: Mapping[str, str],
        settings: Mapping[str, Any],
        calibration: Sequence[Mapping[str, np.ndarray]],
        evaluation: Sequence[Mapping[str, np.ndarray]],
    ) -> None:
        from compiler.quantization.onnxruntime import _folded, prepared, quiet_quantizer, run_static

        self.settings = {k: v for k, v in settings.items() if k != "float_layers"}
        self.folder = Path(tempfile.mkdtemp(prefix="kiln-layers-"))
        self.calibration = [dict(f) for f in calibration]
        self.evaluation = [dict(f) for f in evaluation]
        self._run_static, self._quiet = run_static, quiet_quantizer
        model = onnx.load_from_string(float_graph)
        weight_of = _weight_inputs(model, weight_names)
        with quiet_quantizer():
            self.source = prepared(_folded(model), self.folder)
        self.ranges = self.folder / "ranges.json"
        self.reference = _run(self.source.read_bytes(), self.evaluation)
        full = self.quantized()
        sizes = {i.name: int(np.prod(i.dims)) for i in onnx.load(self.source).graph.initializer}
        touched = _quantized_nodes(full)
        flops = graph_flops(self.source.read_bytes(), self.evaluation[0]) if self.evaluation else {}
        self.layers = [
            Layer(
                node.name,
                node.op_type,
                weight_of.get(node.name, ("", ""))[1],
                sum(sizes.get(i, 0) for i in node.input if i in sizes and sizes[i] > 1),
                flops.get(node.name, 0),
            )
            for node in onnx.load(self.source).graph.node
            if node.name in touched and node.op_type not in MOVING_OPS
        ]
        self.full_error = self.error(full)
        self._alone = None
        self._full_ranked = self.error(full, GAIN_SAMPLES)
        if self.settings.get("mode") != "dynamic":  # QDQ graphs: one layer's copied from the full one
            from compiler.quantization.onnxruntime import quantized_ops
            from compiler.quantization.single_layer import SingleLayerGraphs

            self._alone = SingleLayerGraphs(onnx.load(self.source), full, quantized_ops(self.settings))

    def quantized(self, *, exclude: Sequence[str] = (), only: Sequence[str] = ()) -> onnx.ModelProto:
        with self._quiet():
            return self._run_static(
                self.source,
                self.folder,
                self.calibration,
                self.settings,
                exclude=exclude,
                only=only,
                ranges=self.ranges,
            )

    def error_without(self, names: Sequence[str]) -> float:
        """The partition's error with the layers ``names`` kept in float: the full graph with their Q/DQ
        taken out (:meth:`SingleLayerGraphs.without`), else asked of the quantizer (from the cached
        ranges: no calibration pass)."""
        if self._alone is not None:
            try:
                graph = self._alone.without(names)
                if graph is None:  # nothing of the full graph changes
                    return self.full_error
                return self._compare(_run_session(self._alone.session(graph), self.evaluation))
            except Exception as exc:  # a graph this copy does not handle: the quantizer's own, slower
                _log.debug("layer search: the quantizer remakes the set %s (%s)", list(names), exc)
        return self.error(self.quantized(exclude=names))

    def error(self, model: onnx.ModelProto, samples: int | None = None) -> float:
        """The partition's relative L2 error vs its float graph over the evaluation feeds (every output;
        the first ``samples``)."""
        return self._compare(_run(model.SerializeToString(), self.evaluation[:samples]))

    def _compare(self, outputs: Sequence[Sequence[np.ndarray]]) -> float:
        return relative_error(outputs, self.reference)

    def sensitivity(self, layer: Layer) -> LayerSensitivity:
        """The error ``layer`` adds alone: only it quantized (its graph built from the full one,
        :mod:`compiler.quantization.single_layer`; asked of the quantizer where that cannot be)."""
        if self._alone is not None:
            try:
                graph = self._alone.graph(layer.name)
                outputs = _run_session(self._alone.session(graph), self.evaluation[:RANKING_SAMPLES])
                return LayerSensitivity(layer, self._compare(outputs))
            except Exception as exc:  # a graph this copy does not handle: the quantizer's own, slower
                _log.debug("layer search: the quantizer remakes layer %s (%s)", layer.name, exc)
        return LayerSensitivity(layer, self.error(self.quantized(only=[layer.name]), RANKING_SAMPLES))

    def gain(self, layer: Layer) -> LayerSensitivity:
        """The error ``layer`` adds on top of every other layer at int8: the partition's error fully
        quantized less its error with only ``layer`` kept in float (graph from the full one,
        :meth:`SingleLayerGraphs.without`; asked of the quantizer where that cannot be). What accuracy
        repair ranks by: on a 4x256 BERT the classifier's Gemm alone added 1.1e-02 (the 67th of 97 by
        that measure) yet kept in float it took the model from 0.21 to 0.07; each layer alone misses
        how the errors of the layers before it pass through it."""
        if self._alone is not None:
            try:
                graph = self._alone.without(layer.name)
                if graph is None:
                    return LayerSensitivity(layer, 0.0)
                outputs = _run_session(self._alone.session(graph), self.evaluation[:GAIN_SAMPLES])
                return LayerSensitivity(layer, added_error(self._full_ranked, self._compare(outputs)))
            except Exception as exc:  # a graph this copy does not handle: the quantizer's own, slower
                _log.debug("layer search: the quantizer remakes layer %s (%s)", layer.name, exc)
        without = self.error(self.quantized(exclude=[layer.name]), GAIN_SAMPLES)
        return LayerSensitivity(layer, added_error(self._full_ranked, without))

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass(frozen=True)
class GraphAccount:
    """What one engine graph holds at int8 and in float: weight elements and GEMM/convolution FLOPs."""

    weights_int8: int = 0
    weights_total: int = 0
    flops_int8: int = 0
    flops_total: int = 0

    def __add__(self, other: GraphAccount) -> GraphAccount:
        return GraphAccount(*(a + b for a, b in zip(astuple(self), astuple(other), strict=True)))

    def float_only(self) -> GraphAccount:
        """The same graph with nothing at int8 (a partition raised whole)."""
        return GraphAccount(0, self.weights_total, 0, self.flops_total)


def astuple(account: GraphAccount) -> tuple[int, int, int, int]:
    return (account.weights_int8, account.weights_total, account.flops_int8, account.flops_total)


def account(
    graph: bytes, feed: Mapping[str, np.ndarray], values: Mapping[str, np.ndarray] | None = None
) -> GraphAccount:
    """Weights and FLOPs of an engine graph (QDQ or float) at ``feed``'s shapes: a weight is int8 when
    it is stored as int8/uint8 for a DequantizeLinear; a GEMM or convolution runs at int8 when an input
    comes from a DequantizeLinear. Q/DQ scales and zero points are not weights. ``values``: the
    stripped initializers' tensors, where known (see :func:`graph_flops`)."""
    model = onnx.load_from_string(graph)
    nodes = model.graph.node
    inits = {i.name: i for i in model.graph.initializer}
    qdq_params = {
        n for node in nodes if node.op_type in ("QuantizeLinear", "DequantizeLinear") for n in node.input[1:]
    }
    dq_out = {node.output[0]: node.input[0] for node in nodes if node.op_type == "DequantizeLinear"}
    int8 = total = 0
    for init in inits.values():
        size = int(np.prod(init.dims)) if init.dims else 1
        if init.name in qdq_params or size <= 1:
            continue
        total += size
        if init.data_type in INTEGER_TYPES and init.name in dq_out.values():
            int8 += size
    flops = graph_flops(graph, feed, values)
    low = sum(f for node in nodes if (f := flops.get(node.name, 0)) and any(i in dq_out for i in node.input))
    return GraphAccount(int8, total, low, sum(flops.values()))


def graph_flops(
    graph: bytes, feed: Mapping[str, np.ndarray], values: Mapping[str, np.ndarray] | None = None
) -> dict[str, int]:
    """Node name -> FLOPs (2 x multiply-adds) of every GEMM and convolution, from one run at ``feed``'s
    shapes with their inputs and outputs made graph outputs. A stripped initializer is run as its
    tensor in ``values``, else as zeros: a shape can depend on one (torch 2.11 exports a Reshape's
    target shape as an initializer, which a quantized graph stores with the weights)."""
    model = onnx.load_from_string(graph)
    nodes = [n for n in model.graph.node if n.op_type in COMPUTE_OPS and n.name]
    if not nodes:
        return {}
    _zero_stripped(model, values or {})
    known = {o.name for o in model.graph.output}
    inits = {i.name: list(i.dims) for i in model.graph.initializer}
    wanted = []
    for node in nodes:
        for name in (node.input[0], node.input[1], node.output[0]):
            if name not in known and name not in inits and name not in {i.name for i in model.graph.input}:
                known.add(name)
                wanted.append(name)
                model.graph.output.append(
                    onnx.helper.make_tensor_value_info(name, onnx.TensorProto.FLOAT, None)
                )
    outputs = [o.name for o in model.graph.output]
    values = dict(zip(outputs, _run(model.SerializeToString(), [feed], typed=False)[0], strict=True))
    shapes = {name: list(np.shape(v)) for name, v in values.items()}
    shapes.update(inits)
    shapes.update({k: list(np.shape(v)) for k, v in feed.items()})
    result = {}
    for node in nodes:
        out, a, b = (shapes.get(n) for n in (node.output[0], node.input[0], node.input[1]))
        if out is None or a is None:
            continue
        if node.op_type == "MatMul":
            k = a[-1]
        elif node.op_type == "Gemm":
            trans = next((x.i for x in node.attribute if x.name == "transA"), 0)
            k = a[0] if trans else a[-1]
        elif b is not None:  # Conv, ConvTranspose: the kernel's input channels per group x its window
            k = int(np.prod(b[1:]))
        else:
            continue
        result[node.name] = 2 * int(np.prod(out)) * int(k)
    return result


def _zero_stripped(model: onnx.ModelProto, values: Mapping[str, np.ndarray]) -> None:
    """Tensors stripped from an engine (refit at load) as their ``values``, else as zeros of their shape
    and type (FLOPs need only the shapes of weights): ONNX Runtime will not run a tensor whose bytes
    are nowhere."""
    for init in model.graph.initializer:
        if init.data_location == onnx.TensorProto.EXTERNAL:
            dtype = onnx.helper.tensor_dtype_to_np_dtype(init.data_type)
            value = values.get(init.name)
            array = np.zeros(tuple(init.dims), dtype) if value is None else np.asarray(value, dtype)
            init.CopyFrom(onnx.numpy_helper.from_array(array.reshape(tuple(init.dims)), init.name))


def _weight_inputs(model: onnx.ModelProto, weight_names: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Node name -> (canonical weight, weight key) of the largest parameter it reads, directly or
    through a ``Transpose`` (what folding turns into a transposed weight)."""
    sizes = {i.name: int(np.prod(i.dims)) for i in model.graph.initializer}
    through = {n.output[0]: n.input[0] for n in model.graph.node if n.op_type == "Transpose" and n.input}
    found = {}
    for node in model.graph.node:
        reads = [through.get(i, i) for i in node.input]
        weights = [w for w in reads if w in weight_names and sizes.get(w, 0) > 1]
        if weights:
            best = max(weights, key=lambda w: sizes[w])
            found[node.name] = (best, weight_names[best])
    return found


def _quantized_nodes(model: onnx.ModelProto) -> set[str]:
    """Names of the nodes reading a DequantizeLinear's output (what the quantizer put at low precision)."""
    dq_out = {o for n in model.graph.node if n.op_type == "DequantizeLinear" for o in n.output}
    return {
        n.name
        for n in model.graph.node
        if n.op_type not in ("QuantizeLinear", "DequantizeLinear") and any(i in dq_out for i in n.input)
    }


def _run_session(session: Any, feeds: Sequence[Mapping[str, np.ndarray]]) -> list[list]:
    names = {i.name for i in session.get_inputs()}
    return [session.run(None, {k: v for k, v in feed.items() if k in names}) for feed in feeds]


def _run(graph: bytes, feeds: Sequence[Mapping[str, np.ndarray]], *, typed: bool = True) -> list[list]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    if not typed:  # outputs added without shapes: no optimizer may fuse them away
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return _run_session(ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"]), feeds)


def _finite(value: float) -> float | str:
    return value if math.isfinite(value) else str(value)
