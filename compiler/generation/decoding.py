"""The decode loop's device state: a static key/value cache updated in place, and on CUDA one captured
graph per batch bucket.

The decode program mutates nothing (every stage of the pipeline needs that): it reads the cache it is
given and returns the step's own keys and values (``compiler.generation.step``). Here the cache lives
in preallocated buffers: one tensor ``[2 * layers, max_batch, kv_heads, max_cache_len, head_dim]``
allocated once per module, each layer's keys and values a view of it; each step runs the program on
the views and writes what it returned at the step's position with one ``index_copy_`` (one kernel for
every layer). The step also picks its greedy token on the device (argmax of the last logits) and writes
it as the next step's input and into a token history: a greedy loop then launches nothing between
steps (on the H100 the pick and the token's copy outside the graph cost ~50 us a step, 4% of a 1B
model's step). A decode program written before (package from an earlier kiln) returns whole updated
caches instead: those are copied back, the slot alone (``index_copy_``, two small kernels per layer
and tensor) or, where the whole cache is small, all of it in one multi-tensor copy. The token, the
attention mask and the position are device buffers too, advanced on the device, so a step reads
nothing from the host.

On CUDA, where the decode program's own CUDA-graph policy allows it
(:func:`compiler.runtime.cudagraph_policy.decide`: its mode, its engines on PyTorch's stream, its
compile-time capture check), a whole step (mask update, program, cache write-back, position advance)
is captured once per batch bucket (powers of two up to ``max_batch``; a batch runs in the smallest
bucket holding it, its extra rows copies of its first) and replayed: one launch per token. The
program's own per-call graphs are turned off then (a capture cannot nest, and they would copy the whole
cache in and out of their buffers on every call). Elsewhere (the CPU, graphs off) a step is the same
plain calls on the same buffers.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from compiler.generation.spec import GenerationSpec

Program = Callable[..., Any]
# Uncaptured steps before a capture: Inductor's autotuning, cuBLAS handles, lazy inits happen here.
_WARMUP_STEPS = 2


def buckets(max_batch: int) -> tuple[int, ...]:
    """The batch sizes a captured step is made for: powers of two below ``max_batch``, and it."""
    sizes, size = [], 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return (*sizes, max_batch)


@dataclass
class _Bucket:
    """One bucket's views of the static buffers, and its captured graph (None: plain calls)."""

    rows: int
    ids: torch.Tensor  # [rows, 1]
    mask: torch.Tensor  # [rows, max_cache_len]
    cache: torch.Tensor  # [2 * layers, rows, kv_heads, max_cache_len, head_dim]
    keys: list[torch.Tensor]  # per layer [rows, kv_heads, max_cache_len, head_dim]: views of cache
    values: list[torch.Tensor]
    history: torch.Tensor  # [rows, max_cache_len + 1]: column p holds the greedy token for position p
    graph: Any = None
    logits: torch.Tensor | None = None  # the captured step's output: last-position logits [rows, vocab]


class StaticDecode:
    """The static cache and the step runner of one decode program (see the module docstring)."""

    def __init__(self, decode: Program, spec: GenerationSpec, device: torch.device):
        self.decode, self.spec, self.device = decode, spec, torch.device(device)
        self.lock = threading.Lock()  # one generate at a time uses the buffers
        self.graphed, self.reason = _graph_decision(decode, self.device)
        # Whether a batch runs in its bucket (padded rows); what graphs need, and what a CPU test of
        # the padding sets by hand.
        self.pad_to_buckets = self.graphed
        # Where a bucket's whole cache is at most this, a step copies all of it back in one multi-tensor
        # launch instead of 4 small kernels per layer (about 2.5 us each in a graph; at ~2 TB/s the
        # copy of 10 MiB a layer costs about the same).
        self.full_copy_max_bytes = spec.layers * 10 * 2**20
        if self.graphed:
            # The whole step is captured here: the program's own per-call graphs would nest in it.
            decode.cuda_graphs.enabled = False
            decode.cuda_graphs.reason = "generate captures whole decode steps (compiler.generation.decoding)"
        dtype = getattr(torch, spec.cache_dtype)
        shape = spec.cache_shape(spec.max_batch)
        self._cache = torch.zeros(2 * spec.layers, *shape, dtype=dtype, device=self.device)
        self._keys = list(self._cache[: spec.layers].unbind(0))
        self._values = list(self._cache[spec.layers :].unbind(0))
        self._ids = torch.zeros(spec.max_batch, 1, dtype=torch.long, device=self.device)
        self._mask = torch.zeros(spec.max_batch, spec.max_cache_len, dtype=torch.long, device=self.device)
        self._history = torch.zeros(
            spec.max_batch, spec.max_cache_len + 1, dtype=torch.long, device=self.device
        )
        self.position = torch.zeros(1, dtype=torch.long, device=self.device)
        self._at = 0  # the position the next step writes, on the host (where ``greedy_token`` reads)
        self._fed: torch.Tensor | None = None  # the last greedy token handed out: already the next input
        self._buckets: dict[int, _Bucket] = {}
        self._pool: Any = None
        self.captures = 0

    def bucket_rows(self, batch: int) -> int:
        """The rows a step of ``batch`` rows runs on: its bucket where graphed, else exactly it."""
        if not self.pad_to_buckets:
            return batch
        return next(size for size in buckets(self.spec.max_batch) if size >= batch)

    def start(
        self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor, length: int
    ) -> _Bucket:
        """Load a prefill's cache (``keys``/``values`` [batch, ...]) and prompt mask [batch, length] into
        the buffers; the next step writes position ``length``."""
        batch = mask.shape[0]
        bucket = self._bucket(self.bucket_rows(batch))
        extra = bucket.rows - batch
        for static, fresh in zip(bucket.keys + bucket.values, list(keys) + list(values), strict=True):
            static[:batch].copy_(fresh)
            if extra:  # rows past the batch repeat its first: real tokens, so their attention is defined
                static[batch:].copy_(fresh[:1].expand(extra, *fresh.shape[1:]))
        bucket.mask.zero_()
        bucket.mask[:batch, :length] = mask
        if extra:
            bucket.mask[batch:, :length] = mask[:1]
        self.position.fill_(length)
        self._at, self._fed = length, None
        return bucket

    def step(self, bucket: _Bucket, token: torch.Tensor) -> torch.Tensor:
        """Feed ``token`` [batch] at the current position; the logits [batch, vocab] of the next one. The
        tensor is the step's own buffer where graphed: read (or clone) it before the next step. A token
        that is the last ``greedy_token`` is already in place (the step wrote it): nothing is copied."""
        batch = token.shape[0]
        if token is not self._fed:
            bucket.ids[:batch, 0].copy_(token)
        self._at += 1
        if bucket.graph is None:
            return self._body(bucket)[:batch]
        bucket.graph.replay()
        return bucket.logits[:batch]

    def greedy_token(self, bucket: _Bucket, batch: int) -> torch.Tensor:
        """The last step's greedy token of each row [batch] (the argmax of its logits, picked inside the
        step): a view of the history, which later steps do not overwrite. Fed back unchanged to ``step``,
        it costs no copy."""
        self._fed = bucket.history[:batch, self._at]
        return self._fed

    # -- the step --------------------------------------------------------------------------------
    def _body(self, bucket: _Bucket) -> torch.Tensor:
        position = self.position
        bucket.mask.index_fill_(1, position, 1)
        out = self.decode(
            input_ids=bucket.ids,
            attention_mask=bucket.mask,
            cache_position=position,
            keys=bucket.keys,
            values=bucket.values,
        )
        if len(out) == 2:  # logits and the step's keys and values: written at the position, one kernel
            _, new = out
            bucket.cache.index_copy_(3, position, new)
        else:  # an earlier kiln's program returns whole updated caches: the buffers take them (or the slot)
            _, keys, values = out
            self._write_back(bucket, list(keys) + list(values))
        position.add_(1)
        last = out[0][:, -1]
        pick = greedy_pick(last)  # the greedy token: the next input, and its history column
        bucket.ids.copy_(pick)
        bucket.history.index_copy_(1, position, pick)
        return last

    def _write_back(self, bucket: _Bucket, fresh: list[torch.Tensor]) -> None:
        statics, position = bucket.keys + bucket.values, self.position
        if self.spec.cache_bytes(bucket.rows) <= self.full_copy_max_bytes:  # read when captured
            torch._foreach_copy_(statics, fresh)
        else:
            for static, new in zip(statics, fresh, strict=True):
                static.index_copy_(2, position, new.index_select(2, position))

    def _bucket(self, rows: int) -> _Bucket:
        bucket = self._buckets.get(rows)
        if bucket is None:
            bucket = _Bucket(
                rows,
                self._ids[:rows],
                self._mask[:rows],
                self._cache[:, :rows],
                [k[:rows] for k in self._keys],
                [v[:rows] for v in self._values],
                self._history[:rows],
            )
            if self.graphed:
                self._capture(bucket)
            self._buckets[rows] = bucket
        return bucket

    def _capture(self, bucket: _Bucket) -> None:
        """Capture the bucket's step on zeroed buffers (``start`` loads the real state afterwards); a
        failure leaves graphs off for this program with the reason, and steps run as plain calls."""
        try:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            stream = torch.cuda.Stream(self.device)
            current = torch.cuda.current_stream(self.device)
            stream.wait_stream(current)
            with torch.cuda.stream(stream):
                for _ in range(_WARMUP_STEPS):
                    self.position.zero_()
                    self._body(bucket)
            current.wait_stream(stream)
            self.position.zero_()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool, stream=stream, capture_error_mode="thread_local"):
                logits = self._body(bucket)
            current.wait_stream(stream)
        except Exception as exc:  # a host sync or an op off the stream: never graph it, never fail
            self.graphed = self.pad_to_buckets = False
            what = f"{type(exc).__name__}: {exc}"
            self.reason = f"capturing the decode step at batch {bucket.rows} failed: {what}"
            warnings.warn(f"CUDA graphs off for generation: {self.reason}", stacklevel=3)
            self._buckets.clear()
            return
        bucket.graph, bucket.logits = graph, logits
        self.captures += 1


def greedy_pick(logits: torch.Tensor, chunk: int = 1024) -> torch.Tensor:
    """The argmax of each row of ``logits`` [rows, vocab] as [rows, 1] (the first of equal maxima, as
    ``argmax``), in two passes: the maximum of each ``chunk`` of the vocabulary, then the best chunk.
    One row's argmax over a 128k vocabulary is a long reduction over few blocks; split into chunks it
    spreads over the GPU (captured on the H100: 26 us as one argmax, 17 us in 1k chunks;
    benchmarks/probes/probe_greedy_pick_graphed.h100.json)."""
    rows, vocab = logits.shape
    if vocab <= chunk:
        return logits.argmax(-1, keepdim=True)
    pad = (-vocab) % chunk
    padded = torch.nn.functional.pad(logits, (0, pad), value=float("-inf")) if pad else logits
    values, inner = padded.reshape(rows, -1, chunk).max(-1)
    best = values.argmax(-1, keepdim=True)
    return best * chunk + inner.gather(-1, best)


def _graph_decision(decode: Program, device: torch.device) -> tuple[bool, str | None]:
    """Whether steps are captured: on CUDA, for a compiled decode program whose CUDA-graph policy (its
    mode, engines and compile-time check: ``module.cuda_graphs``) allows it."""
    if device.type != "cuda":
        return False, f"the model runs on {device}"
    graphs = getattr(decode, "cuda_graphs", None)
    if graphs is None:
        return False, "the decode program is not a compiled module (no CUDA-graph policy)"
    if not graphs.enabled:
        return False, graphs.reason
    return True, None
