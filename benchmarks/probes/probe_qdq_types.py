"""Probe on the GPU machine's host CPU (not a test): is static QDQ int8 slow there because of its
activation type? Quantizes one BertLayer engine of the int8 benchmark's BERT (fp32 build, split per layer)
with ONNX Runtime's quantize_static, activations int8 (S8S8, kiln's choice) and uint8 (U8S8), and times
each against the float engine at batch 1 and 8 (interleaved medians).

    python3 benchmarks/probes/probe_qdq_types.py [layers] [threads]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import compiler
from benchmarks.quantization import bert_case


def main() -> None:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else 0
    model_, kwargs, shapes, split, _, _ = bert_case(layers)
    program = compiler.export(model_, (), kwargs, dynamic_shapes=shapes)
    # Split per layer as the int8 benchmark does: the largest engine is one BertLayer.
    module = compiler.compile(program, backend="onnxruntime", cache=False, split_modules=split)
    engines = {fp: onnx.load_from_string(a.engine) for fp, a in module.engines.items() if a.engine}
    matmuls = {fp: sum(n.op_type in ("MatMul", "Gemm") for n in m.graph.node) for fp, m in engines.items()}
    picks = {
        "bert_layer": max(matmuls, key=matmuls.get),  # the most matrix products: one BertLayer
        "embeddings": max(engines, key=lambda fp: len(module.engines[fp].engine)),  # the most bytes
    }
    results = {"threads": threads, "layers": layers, "onnxruntime": ort.__version__}
    for what, fingerprint in picks.items():
        results[what] = _measure(module.engines[fingerprint], engines[fingerprint], threads)
    print(json.dumps(results))


def _measure(artifact, model: onnx.ModelProto, threads: int) -> dict:
    names = [i.name for i in model.graph.input if i.name not in {w.name for w in model.graph.initializer}]
    rng = np.random.default_rng(0)

    def feed(batch: int) -> dict[str, np.ndarray]:
        out = {}
        for name, spec in zip(names, artifact.io.inputs, strict=True):
            shape = (batch, *spec.opt_shape[1:])
            out[name] = (
                rng.standard_normal(shape).astype(np.float32)
                if spec.dtype.startswith("float")
                else np.zeros(shape, dtype=np.int64)
            )
        return out

    class Reader(CalibrationDataReader):
        def __init__(self) -> None:
            self.rows = iter([feed(1) for _ in range(8)])

        def get_next(self):
            return next(self.rows, None)

    sessions = {}
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "float.onnx"
        onnx.save_model(model, source)
        sessions["fp32"] = ort.InferenceSession(str(source), options, providers=["CPUExecutionProvider"])
        for label, activation in (("s8s8", QuantType.QInt8), ("u8s8", QuantType.QUInt8)):
            target = Path(tmp) / f"{label}.onnx"
            quantize_static(
                source,
                target,
                Reader(),
                quant_format=QuantFormat.QDQ,
                per_channel=True,
                activation_type=activation,
                weight_type=QuantType.QInt8,
            )
            sessions[label] = ort.InferenceSession(str(target), options, providers=["CPUExecutionProvider"])
    result = {"engine_inputs": names}
    for batch in (1, 8):
        inputs = feed(batch)
        times = {k: [] for k in sessions}
        for _ in range(5):
            for s in sessions.values():
                s.run(None, inputs)
        for _ in range(20):
            for label, s in sessions.items():
                start = time.perf_counter()
                s.run(None, inputs)
                times[label].append(time.perf_counter() - start)
        medians = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in times.items()}
        result[f"batch{batch}_ms"] = {k: round(v, 3) for k, v in medians.items()}
        result[f"batch{batch}_vs_fp32"] = {k: round(v / medians["fp32"], 3) for k, v in medians.items()}
    return result


if __name__ == "__main__":
    main()
