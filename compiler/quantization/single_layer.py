"""One layer quantized alone, or a set of layers kept in float, without running the quantizer again: the
partition's float graph with the Q/DQ nodes ONNX Runtime's quantizer puts on that one node's tensors,
copied from the fully quantized graph; or the fully quantized graph with the set's Q/DQ taken out.

Accuracy repair's layer search ranks every layer of a partition by the error it adds alone
(:class:`compiler.quantization.layers.LayerProbe`). Asking the quantizer for each (``nodes_to_quantize``)
costs a shape inference, a calibration-cache read and two serializations of the whole model per layer:
about 1.6 s for a 4-layer BERT on 2 cores, 3 minutes for its ~110 layers. Built here instead, a layer's
graph costs a copy of the weight-free graph and a session whose float weights come from memory.

What the quantizer does for one node (``onnxruntime.quantization``'s QDQ quantizer, static mode), and so
what is copied: the node's inputs and outputs that the full graph quantizes, each tensor's one Q/DQ pair
read by *every* consumer of the tensor (the quantizer shares one pair per tensor); nothing for ops it does
not quantize (``Gelu``, ``Tanh``) or for a ``Gather`` of an activation (quantized only after its input).
Scales are the full graph's: where the full graph shares a scale along a chain (a ``Gather``'s output
takes its table's), the quantizer alone would calibrate the tensor's own; the error is then a little
different (within 2x on BERT), which only ranks layers: every set kept in float is rebuilt and validated.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import numpy_helper

from compiler.quantization.onnxruntime import float_inputs

# A float initializer larger than this is supplied from memory at session creation, not copied per layer.
INLINE_ELEMENTS = 64
QDQ = ("QuantizeLinear", "DequantizeLinear")


def quantized_alone(node_op: str, ops: Sequence[str] | None) -> bool:
    """Whether the quantizer quantizes a node of this op when it is the only node asked for (``ops``:
    the recipe's ``op_types_to_quantize``, None for its default)."""
    if ops is not None:
        return node_op in ops
    from onnxruntime.quantization.registry import QDQRegistry, QLinearOpsRegistry

    return node_op in QDQRegistry or node_op in QLinearOpsRegistry


class SingleLayerGraphs:
    """Graphs of ``source`` (the float graph the quantizer read) with one node's tensors quantized as in
    ``full`` (the quantizer's graph of every layer), and sessions that run them."""

    def __init__(self, source: onnx.ModelProto, full: onnx.ModelProto, ops: Sequence[str] | None) -> None:
        self.ops = ops
        self.full = full
        self.weights = {
            init.name: numpy_helper.to_array(init)
            for init in source.graph.initializer
            if init.data_type == onnx.TensorProto.FLOAT and int(np.prod(init.dims)) > INLINE_ELEMENTS
        }
        self.skeleton = copy.deepcopy(source)
        for init in self.skeleton.graph.initializer:
            if init.name in self.weights:
                for attr in ("raw_data", "float_data"):
                    init.ClearField(attr)
                init.data_location = onnx.TensorProto.EXTERNAL
        self.source_inits = {init.name for init in source.graph.initializer}
        self.nodes = {n.name: n for n in full.graph.node}
        self.full_order = [n.name for n in full.graph.node]
        # Nodes of the float graph the quantizer dropped: a Relu after a quantized op, which the
        # Quantize's uint8 clamp does. Kept in float, the op needs it back; ``without`` cannot know that.
        self.removed = {n.name for n in source.graph.node} - set(self.full_order)
        self.producer = {o: n for n in full.graph.node for o in n.output}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for node in full.graph.node:
            for name in node.input:
                self.consumers.setdefault(name, []).append(node)
        self.full_inits = {init.name: init for init in full.graph.initializer}

    def graph(self, name: str) -> onnx.ModelProto:
        """``source`` with only node ``name``'s tensors quantized (see the module docstring)."""
        node = self.nodes[name]
        model = copy.deepcopy(self.skeleton)
        own = next(n for n in model.graph.node if n.name == name)
        found = self._tensors(node, own)
        chains = [self._chain(t) for t in found]
        added: dict[str, onnx.NodeProto] = {}
        redirect: dict[str, str] = {}
        for dq_out, chain in zip(found, chains, strict=True):
            for step in chain:
                added.setdefault(step.output[0], step)
            if chain[0].op_type == "QuantizeLinear":  # an activation: every reader takes its DQ
                redirect[chain[0].input[0]] = dq_out
        for k, dq_out in enumerate(node.input):  # a weight: the float one it replaces, every reader
            if dq_out in added and own.input[k] != dq_out:
                redirect.setdefault(own.input[k], dq_out)
        for k, out in enumerate(node.output):  # a graph output quantized: its producer feeds the Q
            if out != own.output[k] and any(step.input[0] == out for step in added.values()):
                own.output[k] = out
        kept = [i for i in model.graph.initializer if i.name not in added]  # a DQ may output its name
        names = {i.name for i in kept}
        for step in added.values():
            kept += [
                self.full_inits[i] for i in step.input if i in self.full_inits and i not in names and i != ""
            ]
            names.update(step.input)
        del model.graph.initializer[:]
        model.graph.initializer.extend(kept)
        for other in model.graph.node:
            other.input[:] = [redirect.get(i, i) for i in other.input]
        model.graph.node.extend(added.values())
        _sort(model.graph)
        return model

    def without(self, names: str | Sequence[str]) -> onnx.ModelProto | None:
        """``full`` with only the nodes ``names`` (one name, or several) kept in float, close to what the
        quantizer's ``nodes_to_exclude`` makes: a tensor of such a node keeps its Q/DQ pair only where
        another node beside it (its producer, another reader) is one the quantizer quantizes and is not
        kept in float, which marks it too; the others go, the node reading the float activation (or
        ``source``'s float weight) and writing its output unquantized; then, as the quantizer's graph is
        made (:func:`float_inputs`), the kept nodes read float activations. An elementwise op between
        quantized neighbours then changes nothing, and a graph's last GEMM loses the Q/DQ on the logits.
        None when nothing would change (keeping the nodes in float adds no accuracy, only Q/DQ
        boundaries). The quantizer takes a few more pairs out around some sets: the error here is then
        mostly higher (0.9x-2.5x the quantizer's on the test BERT's random sets, equal on most), and
        the search verifies every set it keeps by a rebuild. Several names: the layer search's
        guesses of a set's error, without a quantizer run each (~2.5 s on a 4x256 BERT on 2 cores).
        ValueError where the quantizer removed nodes of the float graph (:attr:`removed`): the caller
        asks the quantizer instead."""
        if self.removed:
            raise ValueError(
                f"the quantizer removed {sorted(self.removed)[:3]} (a Relu folded into its Quantize): "
                "a set's graph copied from the full one would lose it"
            )
        kept = {names} if isinstance(names, str) else set(names)
        changing = [name for name in self.full_order if name in kept and self._changes(name, kept)]
        if not changing:
            return None
        model = copy.deepcopy(self.full)
        nodes = {n.name: n for n in model.graph.node}
        skeleton_nodes = {n.name: n for n in self.skeleton.graph.node}
        skeleton_inits = {i.name: i for i in self.skeleton.graph.initializer}
        present = {i.name for i in model.graph.initializer}
        outputs = {o.name for o in model.graph.output}
        rename: dict[str, str] = {}
        for name in changing:
            own, source = nodes[name], skeleton_nodes[name]
            for k, tensor in enumerate(self.nodes[name].input):
                chain = self._chain(tensor)
                if not chain or self._marked_elsewhere(chain, kept):
                    continue
                if chain[0].op_type == "QuantizeLinear":
                    own.input[k] = chain[0].input[0]
                    continue
                original = source.input[k]
                if original in skeleton_inits and original not in present:
                    model.graph.initializer.append(skeleton_inits[original])
                    present.add(original)
                own.input[k] = original
            for k, out in enumerate(self.nodes[name].output):
                for q in self.consumers.get(out, ()):
                    if q.op_type != "QuantizeLinear":
                        continue
                    for dq in self.consumers.get(q.output[0], ()):
                        if dq.op_type != "DequantizeLinear" or self._marked_elsewhere([q, dq], kept):
                            continue
                        if dq.output[0] in outputs:  # a graph output keeps its name: the node writes it
                            own.output[k] = dq.output[0]
                            rename[out] = dq.output[0]
                        else:
                            rename[dq.output[0]] = out
        for node in model.graph.node:
            node.input[:] = [rename.get(i, i) for i in node.input]
        # A DQ that wrote a name a kept node now writes (a graph output) or a float weight now holds (a
        # weight's DQ may write the weight's own name: a LayerNorm's) goes with the Q/DQ no node reads.
        written = {o for name in changing for o in nodes[name].output}
        written |= present - {i.name for i in self.full.graph.initializer}
        for _ in range(2):
            used = {i for n in model.graph.node for i in n.input} | outputs
            left = [
                n
                for n in model.graph.node
                if n.name in kept or (any(o in used for o in n.output) and not written & set(n.output))
            ]
            del model.graph.node[:]
            model.graph.node.extend(left)
        float_inputs(model.graph, sorted(kept))  # as the quantizer's graph is made (run_static)
        used = {i for n in model.graph.node for i in n.input}
        inits = [i for i in model.graph.initializer if i.name in used]
        del model.graph.initializer[:]
        model.graph.initializer.extend(inits)
        return model

    def _changes(self, name: str, kept: set[str]) -> bool:
        node = self.nodes[name]
        chains = [c for c in (self._chain(t) for t in node.input) if c]
        for out in node.output:
            for q in self.consumers.get(out, ()):
                if q.op_type == "QuantizeLinear":
                    chains += [[q, d] for d in self.consumers.get(q.output[0], ()) if d.op_type == QDQ[1]]
        return any(not self._marked_elsewhere(c, kept) for c in chains)

    def _marked_elsewhere(self, chain: Sequence[onnx.NodeProto], kept: set[str]) -> bool:
        """Whether a node the quantizer quantizes, other than those ``kept`` in float, touches the
        tensor of this Q/DQ ``chain``: its producer, or another reader of the dequantized value."""
        near = [n for n in self.consumers.get(chain[-1].output[0], ()) if n.name not in kept]
        if chain[0].op_type == "QuantizeLinear":
            producer = self.producer.get(chain[0].input[0])
            if producer is not None and producer.name not in kept:
                near.append(producer)
        return any(n.op_type not in QDQ and quantized_alone(n.op_type, self.ops) for n in near)

    def session(self, model: onnx.ModelProto):
        """An ONNX Runtime session of ``model`` (a :meth:`graph` or the skeleton), its large float
        weights given from memory."""
        import onnxruntime as ort

        used = {i for n in model.graph.node for i in n.input}
        present = {i.name for i in model.graph.initializer}
        names = [n for n in self.weights if n in used and n in present]
        keep = [i for i in model.graph.initializer if i.name in names or i.name not in self.weights]
        del model.graph.initializer[:]
        model.graph.initializer.extend(keep)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        options.add_external_initializers(
            names, [ort.OrtValue.ortvalue_from_numpy(self.weights[n]) for n in names]
        )
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    def _tensors(self, node: onnx.NodeProto, own: onnx.NodeProto) -> list[str]:
        """The DQ outputs in ``full`` that quantizing only ``node`` makes."""
        if not quantized_alone(node.op_type, self.ops):
            return []
        if node.op_type in ("Gather", "GatherElements") and own.input[0] not in self.source_inits:
            return []  # quantized only once its input is: never alone
        found = [t for t in node.input if self._chain(t)]
        for out in node.output:
            for q in self.consumers.get(out, ()):
                if q.op_type == "QuantizeLinear":
                    found += [d.output[0] for d in self.consumers.get(q.output[0], ()) if d.op_type == QDQ[1]]
        return list(dict.fromkeys(found))

    def _chain(self, name: str) -> list[onnx.NodeProto]:
        """The Q (for an activation) and DQ nodes of ``full`` that make ``name``; [] if none."""
        dq = self.producer.get(name)
        if dq is None or dq.op_type != "DequantizeLinear":
            return []
        q = self.producer.get(dq.input[0])
        return [q, dq] if q is not None and q.op_type == "QuantizeLinear" else [dq]


def _sort(graph: onnx.GraphProto) -> None:
    """The graph's nodes in an order where each reads only what is defined before it."""
    ready = {i.name for i in graph.input} | {i.name for i in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        left = []
        for node in pending:
            if all(i in ready for i in node.input):
                ordered.append(node)
                ready.update(node.output)
            else:
                left.append(node)
        if len(left) == len(pending):
            raise ValueError(f"a layer's graph has a cycle or an undefined input at {left[0].name}")
        pending = left
    del graph.node[:]
    graph.node.extend(ordered)
