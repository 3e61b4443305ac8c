"""ONNX models that carry all their data: what an engine must be before ONNX Runtime or TensorRT reads it.

An ONNX tensor may be stored as *external data*: a ``location`` that the library reads from the file
system, relative to the model's directory, or, for a model given as bytes, to the loading process's
working directory. An engine from an untrusted package could then make a load read any file the
process can (a ``secrets.env`` came back as model output). kiln writes every tensor inline, so an
engine that names external data, or any other file the library would read, is refused before the
library sees it (docs/security.md).
"""

from __future__ import annotations

from typing import Any

import onnx

from compiler.errors import UnsafeEngineError

# ONNX Runtime reads a file named by the model for these: an EPContext node's cached engine (a path when
# its embed_mode is 0), and a session configuration in the metadata (where ORT_LOAD_CONFIG_FROM_MODEL=1).
_FILE_READING_OPS = frozenset({"EPContext"})
_SESSION_CONFIG_KEYS = frozenset({"ort_config"})


def check_self_contained(model: onnx.ModelProto, *, supplied: frozenset[str] = frozenset()) -> None:
    """UnsafeEngineError unless the model carries all its data inline and asks ONNX Runtime to read no
    file: no tensor (initializer, sparse initializer, node attribute, in any subgraph or function) stored
    as external data, no EPContext node, no session configuration. ``supplied``: the main graph's
    initializers whose data the loader hands ONNX Runtime itself (weights, from memory): those may be
    external with no location at all, which names no file."""
    problems = []

    def tensor(t: onnx.TensorProto, where: str) -> None:
        if t.name in supplied and where == "graph initializer" and not len(t.external_data):
            return
        if t.data_location == onnx.TensorProto.EXTERNAL or len(t.external_data):
            location = next((e.value for e in t.external_data if e.key == "location"), None)
            problems.append(f"{where} {t.name!r} is external data (location {location!r})")

    def graph(g: onnx.GraphProto, where: str) -> None:
        for init in g.initializer:
            tensor(init, f"{where} initializer")
        for sparse in g.sparse_initializer:
            tensor(sparse.values, f"{where} sparse initializer")
            tensor(sparse.indices, f"{where} sparse initializer indices")
        nodes(g.node, where)

    def nodes(items: Any, where: str) -> None:
        for node in items:
            here = f"{where} node {node.name or node.op_type!r}"
            if node.op_type in _FILE_READING_OPS:
                problems.append(f"{here} is an {node.op_type} node (reads a file by name)")
            for attr in node.attribute:
                if attr.HasField("t"):
                    tensor(attr.t, f"{here} attribute")
                for t in attr.tensors:
                    tensor(t, f"{here} attribute")
                if attr.HasField("sparse_tensor"):
                    tensor(attr.sparse_tensor.values, f"{here} attribute")
                for sparse in attr.sparse_tensors:
                    tensor(sparse.values, f"{here} attribute")
                if attr.HasField("g"):
                    graph(attr.g, f"{here} subgraph")
                for g in attr.graphs:
                    graph(g, f"{here} subgraph")

    graph(model.graph, "graph")
    for function in model.functions:
        nodes(function.node, f"function {function.name!r}")
    for info in model.training_info:
        graph(info.initialization, "training initialization")
        graph(info.algorithm, "training algorithm")
    problems += [
        f"metadata {p.key!r} (an ONNX Runtime session configuration)"
        for p in model.metadata_props
        if p.key in _SESSION_CONFIG_KEYS
    ]
    if problems:
        raise UnsafeEngineError(
            f"ONNX engine refused: {'; '.join(problems[:5])}; an engine carries all its data inline and "
            "reads no file (ONNX Runtime would read these relative to the loading process)"
        )
