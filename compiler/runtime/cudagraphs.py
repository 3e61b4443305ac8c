"""CUDA graphs for a compiled module: its whole call (engines and the PyTorch ops between them)
captured once per input-shape signature and replayed.

Why the whole module: at small batches the GPU waits on the host (a 12-layer model is hundreds of
kernel launches and Python dispatches per call, and every engine boundary adds its own); one replay
launches them all at once. ``CompileOptions.cuda_graphs`` is ``"auto"`` (on for CUDA devices when the
compile-time capture check passed), ``"on"`` (required: a typed error where it cannot be) or
``"off"``. :func:`decide` is the one place that turns the mode, the device, the engines' backends and
the check recorded in the report into "graphed or not, and why"; it lives with the modes and
:class:`CaptureCheck` in :mod:`compiler.runtime.cudagraph_policy` (no torch), re-exported here.

The runtime (:class:`CudaGraphs`, the module's ``cuda_graphs`` attribute):

- each input-shape signature (shapes and dtypes) gets static input buffers and one captured graph;
  a call copies its inputs in, replays on the caller's current stream and returns **fresh** output
  tensors (clones). ``static_outputs = True`` returns the graph's own output buffers instead (no copy;
  the next call of that shape overwrites them: read or copy them first);
- every capture of a module allocates from one memory pool (``pool_bytes`` reads its size); at most
  ``max_shapes`` signatures stay captured, the least recently used is evicted (``captured_shapes``,
  ``evictions``);
- replays are ordered across streams (each waits for the previous one's outputs to be copied), so
  calls from several streams or threads are correct;
- capture runs out of GPU memory: the other shapes are evicted and the capture tried once more, else
  that call runs uncaptured (``last_failure`` says why); any other capture failure turns graphs off for
  the module with the reason (``reason``), and the call runs uncaptured: never a wrong answer.

:func:`check_capture` is the compile-time check (``assemble`` runs it for a fresh compile on CUDA):
capture at the opt shapes, replay on fresh random inputs and compare with an uncaptured run. A host
sync or data-dependent shape fails the capture; a CPU op whose result the capture froze fails the
comparison. Its result lands in the report (``CompileReport.cuda_graphs``) and so in the manifest; a
load trusts it and never captures a module the check refused.
"""

from __future__ import annotations

import contextlib
import threading
import time
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from compiler.runtime.cudagraph_policy import CaptureCheck, Decision

__all__ = [
    "DEFAULT_MAX_SHAPES",
    "CudaGraphs",
    "check_capture",
    "signature",
]

DEFAULT_MAX_SHAPES = 8
# Uncaptured runs before a capture: Triton autotuning, cuBLAS handles and lazy inits happen here.
_WARMUP_RUNS = 2
# The capture check's tolerance: a replay runs the very kernels of an uncaptured run.
_CHECK_REL_L2 = 1e-3


def signature(flat: Sequence[object]) -> tuple:
    """What one captured graph serves: every input's shape and dtype."""
    return tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else (type(x), x) for x in flat)


@dataclass
class _Capture:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: list[object]


class CudaGraphs:
    """A module's CUDA-graph runtime: captures by input signature, one pool, LRU-bounded."""

    def __init__(
        self,
        run: Callable[[list[torch.Tensor]], list[object]],
        device: torch.device,
        decision: Decision,
        *,
        mode: str = "auto",
        max_shapes: int = DEFAULT_MAX_SHAPES,
        static_outputs: bool = False,
    ):
        self._run, self.device, self.mode = run, device, mode
        self.enabled, self.reason = decision.enabled, decision.reason
        self.max_shapes, self.static_outputs = max_shapes, static_outputs
        self.evictions, self.last_failure = 0, None
        self.captures = 0  # every capture taken, re-captures included (``captured_shapes``: held now)
        self.warmup_seconds = 0.0  # capturing the shape profiles when the module was assembled
        self._captures: OrderedDict[tuple, _Capture] = OrderedDict()
        self._pool = None
        self._stream: torch.cuda.Stream | None = None
        self._done: torch.cuda.Event | None = None  # the last replay's outputs copied out
        self._mutex = threading.RLock()  # reentrant: clear() inside exclusive()

    # -- what a user reads ---------------------------------------------------------------------
    @property
    def captured_shapes(self) -> int:
        return len(self._captures)

    @property
    def pool_bytes(self) -> int:
        """Bytes the captures' memory pool holds on the device (reserved segments of the pool)."""
        if self._pool is None:
            return 0
        pool = tuple(self._pool)
        return sum(
            s["total_size"]
            for s in torch.cuda.memory_snapshot()
            if tuple(s.get("segment_pool_id", ())) == pool
        )

    def to_dict(self) -> dict:
        return {
            "mode": self.mode,
            "enabled": self.enabled,
            "reason": self.reason,
            "captured_shapes": self.captured_shapes,
            "max_shapes": self.max_shapes,
            "evictions": self.evictions,
            "captures": self.captures,
            "pool_bytes": self.pool_bytes,
            "static_outputs": self.static_outputs,
            "last_failure": self.last_failure,
            "warmup_seconds": self.warmup_seconds,
        }

    def clear(self) -> None:
        """Drop every capture (their pool memory goes back once nothing references it)."""
        with self._mutex:
            self._captures.clear()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """Holds captured calls off and waits for the device's work: for changing, in place, tensors
        the captures read (refit). Uncaptured calls are not held (they take no lock)."""
        with self._mutex:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            yield

    # -- calls ---------------------------------------------------------------------------------
    def __call__(self, flat: list[torch.Tensor]) -> list[object]:
        if not self.enabled:
            return self._run(flat)
        key = signature(flat)
        with self._mutex:
            capture = self._captures.get(key)
            if capture is None:
                capture = self._capture(key, flat)
                if capture is None:
                    return self._run(flat)
            else:
                self._captures.move_to_end(key)
            return self._replay(capture, flat)

    def _replay(self, capture: _Capture, flat: list[torch.Tensor]) -> list[object]:
        stream = torch.cuda.current_stream(self.device)
        if self._done is not None:
            stream.wait_event(self._done)  # the previous call (any stream) is done with the buffers
        for static, value in zip(capture.inputs, flat, strict=True):
            if isinstance(static, torch.Tensor):
                static.copy_(value, non_blocking=True)
        capture.graph.replay()  # on the current stream
        outputs = capture.outputs
        if not self.static_outputs:
            outputs = [o.clone() if isinstance(o, torch.Tensor) else o for o in outputs]
        self._done = torch.cuda.Event()
        self._done.record(stream)
        return outputs

    def _capture(self, key: tuple, flat: list[torch.Tensor]) -> _Capture | None:
        while len(self._captures) >= max(1, self.max_shapes):
            self._captures.popitem(last=False)
            self.evictions += 1
        try:
            capture = self._try_capture(flat)
        except torch.OutOfMemoryError as exc:
            # Room for this shape first: the others go, and one more try.
            self.evictions += len(self._captures)
            self._captures.clear()
            torch.cuda.empty_cache()
            try:
                capture = self._try_capture(flat)
            except Exception as again:
                self.last_failure = f"capture ran out of GPU memory ({_short(exc)}); ran uncaptured"
                warnings.warn(f"CUDA graphs: {self.last_failure}: {_short(again)}", stacklevel=4)
                return None
        except Exception as exc:  # a host sync, a CPU op, a launch outside the stream: never graph it
            self.enabled, self.reason = False, f"capture failed at shapes {_shapes(flat)}: {_short(exc)}"
            warnings.warn(f"CUDA graphs off for this module: {self.reason}", stacklevel=4)
            return None
        self._captures[key] = capture
        self.captures += 1
        return capture

    def _try_capture(self, flat: list[torch.Tensor]) -> _Capture:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
            self._stream = torch.cuda.Stream(self.device)
        current = torch.cuda.current_stream(self.device)
        if self._done is not None:
            current.wait_event(self._done)
        static = [x.clone() if isinstance(x, torch.Tensor) else x for x in flat]
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            for _ in range(_WARMUP_RUNS):
                self._run(static)
        current.wait_stream(self._stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: other threads' CUDA calls neither break this capture nor are broken by it.
        cause: Exception | None = None
        try:
            with torch.cuda.graph(
                graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"
            ):
                try:
                    outputs = self._run(static)
                except Exception as exc:
                    cause = exc
                    raise
        except Exception as exc:
            # Ending a broken capture raises its own "capture invalidated": report what broke it.
            raise (cause or exc) from None
        return _Capture(graph, static, list(outputs))


def check_capture(
    run_uncaptured: Callable[[list[torch.Tensor]], list[object]],
    graphs: CudaGraphs,
    make_inputs: Callable[[int], list[torch.Tensor]],
) -> CaptureCheck:
    """Capture at one input set, replay another, and compare with an uncaptured run of it."""
    start = time.perf_counter()
    first, second = make_inputs(0), make_inputs(1)
    shapes = tuple(tuple(x.shape) for x in first)
    with torch.no_grad():
        graphs(first)
        if graphs.enabled and graphs.captured_shapes == 0:
            reason = graphs.last_failure or "the capture did not complete"
        elif not graphs.enabled:
            reason = graphs.reason
        else:
            replayed = graphs(second)
            expected = run_uncaptured(second)
            reason = _mismatch(expected, replayed)
    graphs.clear()
    return CaptureCheck(reason is None, reason, shapes, round(time.perf_counter() - start, 3))


def _mismatch(expected: Sequence[object], actual: Sequence[object]) -> str | None:
    for index, (e, a) in enumerate(zip(expected, actual, strict=True)):
        if not isinstance(e, torch.Tensor):
            if e != a:
                return f"output {index} is {a!r} replayed, {e!r} uncaptured"
            continue
        if e.shape != a.shape:
            return f"output {index} has shape {tuple(a.shape)} replayed, {tuple(e.shape)} uncaptured"
        if not e.is_floating_point():
            if not torch.equal(e, a):
                return f"output {index} differs between replay and an uncaptured run (a step capture froze)"
            continue
        e64, a64 = e.double(), a.double()
        err = float((a64 - e64).norm() / e64.norm().clamp_min(1e-12))
        if not err <= _CHECK_REL_L2:  # NaN fails too
            return (
                f"output {index} differs between replay and an uncaptured run on fresh inputs (rel L2 "
                f"{err:.3g} > {_CHECK_REL_L2}): a step the capture froze, e.g. a CPU op"
            )
    return None


def _shapes(flat: Sequence[object]) -> list:
    return [list(x.shape) if isinstance(x, torch.Tensor) else x for x in flat]


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return " ".join(line for line in text.splitlines()[:4] if line.strip())[:600]
