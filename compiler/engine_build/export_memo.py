"""The ONNX export of a partition, kept for the rest of the process, keyed by what the exporter traces.

``torch.onnx.export`` of one partition is the most expensive step of an int8 compile on ONNX Runtime:
the quantizer lowers each int8 partition in fp32 at partitioning, the layer search lowers it again, and
accuracy repair (also a repair reused from the engine cache) quantizes it once more with its float
layers, each an identical export (~5 s for a BERT 4 x 256 on 2 cores). Weights are graph inputs until
after the export (:func:`compiler.engine_build.lower.lower_float`), so the exported graph depends on
the traced graph and the types and shapes of its inputs, never on weight values: that is the key.
The graph is the fingerprint's own structure (:func:`compiler.partitioning.fingerprint.structure`: ops,
arguments, shapes with their dimension names and ranges, dtypes, input kinds), which engine dedup
already trusts to decide that two partitions lower to one engine graph. What is kept is the exported
graph without weights (small); each use gets its own copy to put its weights into.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence

import onnx
import torch

from compiler.partitioning.fingerprint import structure

# A few partitions' graphs: one compile's int8 partitions are lowered again within minutes of each other.
KEEP = 8

_graphs: OrderedDict[str, bytes] = OrderedDict()
_lock = threading.Lock()


def export_key(
    graph: torch.fx.Graph,
    kinds: Sequence[str],
    symbols: Mapping[str, tuple[str, int, int, int]],
    traced: Mapping[str, object],
    weights: Mapping[str, torch.Tensor],
) -> str:
    """sha256 of what the exporter sees: the partition's structure, ``traced`` (precision, ops kept in
    fp32, input and output names and types, dynamic shapes) and each weight input's dtype and shape."""
    payload = {
        "structure": structure(graph, tuple(kinds), symbols),
        "traced": {k: repr(v) for k, v in sorted(traced.items())},
        "weights": [[name, str(t.dtype), list(t.shape)] for name, t in weights.items()],
        "torch": torch.__version__,
        "onnx": onnx.__version__,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def exported(key: str, export: Callable[[], onnx.ModelProto]) -> onnx.ModelProto:
    """A fresh copy of the exported graph under ``key``, exporting it with ``export`` the first time.
    Two threads missing at once both export (the same graph); a failed export keeps nothing."""
    with _lock:
        blob = _graphs.get(key)
        if blob is not None:
            _graphs.move_to_end(key)
    if blob is None:
        model = export()
        blob = model.SerializeToString()
        with _lock:
            _graphs[key] = blob
            while len(_graphs) > KEEP:
                _graphs.popitem(last=False)
        return model
    return onnx.load_from_string(blob)


def clear() -> None:
    """Forget every kept graph (tests that count exports)."""
    with _lock:
        _graphs.clear()
