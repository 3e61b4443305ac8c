"""What an int8 engine graph keeps at low precision is counted from its stripped graph (compiler.
quantization.layers.account): a weight's bytes are nowhere and zeros stand in, but a shape constant
(torch 2.11 exports a Reshape's target shape as an initializer, which the quantized graph stores with
the weights) is run as its value: with zeros, accuracy repair's record of BERT-4x768 failed on the H200
host ("Incompatible dimensions for matrix multiplication")."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from compiler.quantization.layers import account


def _stripped(array: np.ndarray, name: str) -> onnx.TensorProto:
    tensor = numpy_helper.from_array(array, name)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value="")
    return tensor


def test_a_stripped_shape_constant_is_run_as_its_value_and_the_weights_as_zeros():
    weights = [
        _stripped(np.ones((8, 8), np.int8), "w0"),
        _stripped(np.float32(0.1), "w1"),
        _stripped(np.array([-1, 2, 4], np.int64), "w2"),  # the Reshape's target shape
        _stripped(np.ones((4, 3), np.float32), "w3"),
    ]
    graph = helper.make_graph(
        [
            helper.make_node("DequantizeLinear", ["w0", "w1"], ["dq"], name="dq"),
            helper.make_node("MatMul", ["x", "dq"], ["m1"], name="int8_gemm"),
            helper.make_node("Reshape", ["m1", "w2"], ["r"], name="reshape"),
            helper.make_node("MatMul", ["r", "w3"], ["y"], name="float_gemm"),
        ],
        "stripped",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2, 3])],
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feed = {"x": np.zeros((5, 8), np.float32)}
    counted = account(model.SerializeToString(), feed, {"w2": np.array([-1, 2, 4], np.int64)})
    assert counted.flops_total == 2 * 5 * 8 * 8 + 2 * 5 * 2 * 4 * 3  # both GEMMs at the run's shapes
    assert counted.flops_int8 == 2 * 5 * 8 * 8  # the one reading a DequantizeLinear
    assert counted.weights_int8 == 64
