"""ONNX rewrites of a lowered partition before TensorRT's parser sees it, and the canonical weights
the rewrites keep.

Guarantees: a rewrite changes no output beyond floating-point rounding (each is checked against
ONNX Runtime on CPU in ``tests/backends/tensorrt/test_tensorrt_backend.py``); canonical weights (initializers
``w0..wN``, the ones kiln refits) keep their names, shapes and dtypes and stay consumed by name, so
TensorRT can mark them refittable. Needs ``onnx``; no TensorRT, no GPU.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from compiler.errors import EngineBuildError

_CANONICAL_WEIGHT = re.compile(r"^w(\d+)$")


def canonical_initializers(model: Any) -> dict[str, dict[str, Any]]:
    """Canonical weights of a lowered ONNX model (initializers ``w0..wN``): name -> shape and dtype,
    in index order. Other initializers are constants of the structure and stay in the engine."""
    import onnx
    from onnx import helper

    found: dict[int, dict[str, Any]] = {}
    for init in model.graph.initializer:
        match = _CANONICAL_WEIGHT.match(init.name)
        if match is None:
            continue
        np_dtype = helper.tensor_dtype_to_np_dtype(init.data_type)
        torch_name = {
            "float32": "float32",
            "float16": "float16",
            "int64": "int64",
            "int32": "int32",
            "int8": "int8",
            "uint8": "uint8",
            "bool": "bool",
            "float64": "float64",
        }.get(str(np_dtype))
        if init.data_type == onnx.TensorProto.BFLOAT16:
            torch_name = "bfloat16"
        if init.data_type == onnx.TensorProto.FLOAT8E4M3FN:  # fp8 partitions' weights and zero points
            torch_name = "float8_e4m3fn"
        if torch_name is None:
            raise EngineBuildError(f"weight {init.name!r} has ONNX dtype {np_dtype}, which kiln cannot refit")
        found[int(match.group(1))] = {
            "name": init.name,
            "shape": [int(d) for d in init.dims],
            "dtype": torch_name,
        }
    return {found[i]["name"]: {"shape": found[i]["shape"], "dtype": found[i]["dtype"]} for i in sorted(found)}


def unfold_batch_norm(model: Any) -> int:
    """Rewrite inference BatchNormalization nodes whose parameters are canonical weights into
    Sub/Div/Mul/Add (in place); returns how many. TensorRT's ONNX parser folds a BatchNormalization's
    scale, bias, mean and variance into new unnamed weights, so they could be neither marked
    refittable nor refitted by name; as elementwise operands they stay named weights (and TensorRT
    still fuses the arithmetic into the convolution)."""
    import onnx
    from onnx import helper, numpy_helper

    canonical = set(canonical_initializers(model))
    if not any(n.op_type == "BatchNormalization" and set(n.input[1:]) & canonical for n in model.graph.node):
        return 0
    inferred = onnx.shape_inference.infer_shapes(model)
    ranks = {
        v.name: len(v.type.tensor_type.shape.dim)
        for v in [*inferred.graph.value_info, *inferred.graph.input]
        if v.type.tensor_type.HasField("shape")
    }
    dtypes = {i.name: i.data_type for i in model.graph.initializer}
    nodes, count = [], 0
    for node in model.graph.node:
        if (
            node.op_type != "BatchNormalization"
            or not set(node.input[1:]) & canonical
            or len(node.output) != 1
        ):
            nodes.append(node)
            continue
        count += 1
        x, scale, bias, mean, var = node.input
        eps = next((a.f for a in node.attribute if a.name == "epsilon"), 1e-5)
        rank = ranks.get(x, 4)
        tag = f"kiln_bn{count}"
        shape = numpy_helper.from_array(
            np.array([-1] + [1] * max(rank - 2, 0), dtype=np.int64), f"{tag}_shape"
        )
        eps_t = helper.make_tensor(f"{tag}_eps", dtypes.get(var, onnx.TensorProto.FLOAT), [], [eps])
        model.graph.initializer.extend([shape, eps_t])
        for name in (scale, bias, mean, var):
            nodes.append(
                helper.make_node("Reshape", [name, shape.name], [f"{tag}_{name}"], name=f"{tag}_r_{name}")
            )
        nodes += [
            helper.make_node("Add", [f"{tag}_{var}", eps_t.name], [f"{tag}_ve"], name=f"{tag}_add_eps"),
            helper.make_node("Sqrt", [f"{tag}_ve"], [f"{tag}_sd"], name=f"{tag}_sqrt"),
            helper.make_node("Sub", [x, f"{tag}_{mean}"], [f"{tag}_xc"], name=f"{tag}_sub"),
            helper.make_node("Div", [f"{tag}_xc", f"{tag}_sd"], [f"{tag}_xn"], name=f"{tag}_div"),
            helper.make_node("Mul", [f"{tag}_xn", f"{tag}_{scale}"], [f"{tag}_xs"], name=f"{tag}_mul"),
            helper.make_node(
                "Add", [f"{tag}_xs", f"{tag}_{bias}"], [node.output[0]], name=node.name or f"{tag}_out"
            ),
        ]
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    return count
