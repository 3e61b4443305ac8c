"""Runtime: the compiled module, a PyTorch fallback graph that calls engines (hybrid execution).

``assemble`` loads every engine instance with its own weights (refit: a shared or stripped engine gets
the instance's tensors put in) and swaps each partition submodule of the split graph for an
:class:`EngineCall`; each engine is loaded by the backend that built it (an ONNX Runtime fallback in a
TensorRT compile runs on ONNX Runtime), and a partition whose build fell back to PyTorch keeps its
submodule, which the graph feeds the current weights like any fallback op. The compiled module takes
the model's own call signature, checks inputs against the specs captured at export, and returns the
model's own output structure. On CUDA it replays its whole call as CUDA graphs where
``CompileOptions.cuda_graphs`` allows (:mod:`compiler.runtime.cudagraphs`; ``module.cuda_graphs`` shows the
captures, their pool and why graphs are off where they are).
"""

from __future__ import annotations

import copy
import dataclasses
import time
import warnings
from collections import Counter
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils import _pytree as pytree

from compiler.backends import get_backend
from compiler.backends.base import Engine, EngineIO
from compiler.cache.local import CacheSetting
from compiler.device import resolve, same
from compiler.engine_build.engine import EngineArtifact
from compiler.engine_build.weights import engine_weights
from compiler.errors import CudaGraphError, InputSpecError, RefitError
from compiler.inputs.profiles import fixed_profiles, is_fixed, profile_inputs, profile_shapes
from compiler.inputs.specs import InputSpec, check_inputs
from compiler.partitioning import treespec
from compiler.partitioning.dedup import DedupPlan
from compiler.partitioning.partition import PartitionPlan
from compiler.program.tracing import custom_op_lock
from compiler.runtime.compile_report import CompileReport, report_of
from compiler.runtime.cudagraph_policy import CaptureCheck, decide
from compiler.runtime.cudagraphs import DEFAULT_MAX_SHAPES, CudaGraphs, check_capture
from compiler.runtime.padding import check_padding, pad_call, pad_targets


class EngineCall(torch.nn.Module):
    """Stands in for one partition: picks the activations out of the partition's inputs, runs the engine.

    Weight inputs are ignored here: the engine holds them (built in, or put in by refit).
    """

    def __init__(self, engine: Engine, io: EngineIO, activation_positions: tuple[int, ...], fingerprint: str):
        super().__init__()
        self.engine, self.io, self.positions, self.fingerprint = engine, io, activation_positions, fingerprint

    def forward(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.engine(*(inputs[i] for i in self.positions))


class CompiledModule(torch.nn.Module):
    """A compiled model: same call signature and outputs as the original; engines inside."""

    def __init__(
        self,
        plan: PartitionPlan,
        dedup: DedupPlan,
        engines: Mapping[str, EngineArtifact],
        graph: torch.fx.GraphModule,
        report: CompileReport,
        *,
        trust_engine_code: bool = True,
        cache: CacheSetting = None,
    ):
        super().__init__()
        # Whether its engines' bytes were trusted to run as code (a package load decides), and the engine
        # cache its loads were handed (where Inductor keeps graphs it compiles at load): refit keeps both.
        self.trust_engine_code, self.cache = trust_engine_code, cache
        self.plan, self.dedup, self.engines, self.graph, self.report = (
            plan,
            dedup,
            dict(engines),
            graph,
            report,
        )
        self.validation: dict | None = None  # set by package.load from the manifest
        self.manifest: Any = None  # set by package.load: the package's Manifest, as verified
        self.load_seconds: dict[str, float] = {}  # set by package.load: where its seconds went
        # Where inputs, engines, fallback ops and outputs live (CompileOptions.device).
        self.device = resolve(plan.options.device)
        signature = plan.signature
        # The output spec may be deferred (a package's output types' modules imported on first forward).
        self._in_spec, self._out_source = signature.in_spec, signature.out_spec
        self._leaf_call = _leaf_call(self._in_spec)
        # The weight tensors are fixed for the module's life (refit in place copies into them): resolved once.
        weights = plan.weights()
        self._feed_template = [None if key is None else weights[key] for key in signature.inputs]
        self._user_outputs = list(signature.user_outputs)
        # What its calls hold (the tracing lock where its graph calls custom ops); compiler.validate
        # runs the user's eager model, which calls the same ops, under it too.
        self.trace_lock = custom_op_lock(graph)
        check = CaptureCheck.from_dict(report.cuda_graphs) if report.cuda_graphs else None
        mode = plan.options.cuda_graphs
        decision = decide(mode, self.device, (a.backend for a in self.engines.values() if a.is_engine), check)
        self.cuda_graphs = CudaGraphs(
            self._run_uncaptured,
            self.device,
            decision,
            mode=mode,
            max_shapes=max(DEFAULT_MAX_SHAPES, len(plan.options.profiles) + 2),
        )
        # Profiles a call may be padded up to (pad_to_profile "auto", as the compile-time check allowed).
        self._pad_targets = pad_targets(plan.specs, plan.options.profiles, report.profiles)

    @property
    def _out_spec(self) -> pytree.TreeSpec:
        return treespec.resolved(self._out_source)

    @property
    def input_specs(self) -> tuple[InputSpec, ...]:
        return self.plan.specs

    @property
    def weights(self) -> dict[str, torch.Tensor]:
        return self.plan.weights()

    def forward(self, *args: object, **kwargs: object) -> object:
        flat = self._flatten(args, kwargs)
        return pytree.tree_unflatten(self.run_flat(flat), self._out_spec)

    def run_flat(self, flat: list[torch.Tensor], *, capture: bool = True) -> list[torch.Tensor]:
        """Run on the flat user inputs (the program's order); returns the flat user outputs.
        ``capture=False`` runs the graph's modules as they are, never a CUDA-graph replay: forward hooks
        on its partitions (``compare_partitions``) see every call only then."""
        self._check_placement(flat)
        check_inputs(self.plan.specs, flat)
        run = self.cuda_graphs if capture else self._run_uncaptured
        if self._pad_targets:
            padded = pad_call(flat, self.plan.specs, self._pad_targets)
            if padded is not None:
                inputs, rows = padded
                return [y[:rows] for y in run(inputs)]
        return run(flat)

    def native_builds(self) -> list[Any]:
        """Handles (``wait(timeout)``) of this machine's own native packages a load started building for
        the loads after it (``compiler.backends.inductor.native``); empty where none was started."""
        calls = [c for c in self.graph.children() if isinstance(c, EngineCall)]
        return list({b.key: b for c in calls if (b := getattr(c.engine, "native_build", None))}.values())

    def last_dispatch(self) -> dict[str, str]:
        """Partition -> what served its last call in an Inductor engine with static specializations
        (profiles): ``"static"`` (the profile's specialization) or ``"dynamic"``; ``"aot"`` for one
        loaded as its AOTInductor package, which serves every shape; ``"blocks"`` for one compiled at
        this load one repeated block at a time (an untrusted first load: inductor/blocks.py)."""
        return {
            name: call.engine.last_dispatch
            for name, call in self.graph.named_children()
            if isinstance(call, EngineCall) and getattr(call.engine, "last_dispatch", None) is not None
        }

    def _run_uncaptured(self, flat: list[torch.Tensor]) -> list[torch.Tensor]:
        user = iter(flat)
        feed = [next(user) if value is None else value for value in self._feed_template]
        with self.trace_lock, torch.no_grad():
            outputs = self.graph(*feed)
        return [outputs[i] for i in self._user_outputs]

    def check_cuda_graphs(self) -> CaptureCheck | None:
        """The compile-time capture check (see :func:`compiler.runtime.cudagraphs.check_capture`) at the opt
        shapes; None where graphs are off anyway. Turns graphs off for this module when it fails."""
        if not self.cuda_graphs.enabled:
            return None
        from compiler.inputs.data import sample_inputs

        def inputs(seed: int) -> list[torch.Tensor]:
            generator = torch.Generator().manual_seed(seed)
            return [t.to(self.device) for t in sample_inputs(self.plan.specs, "opt", generator)]

        check = check_capture(self._run_uncaptured, self.cuda_graphs, inputs)
        if not check.capturable:
            self.cuda_graphs.enabled, self.cuda_graphs.reason = False, check.reason
            if self.cuda_graphs.mode == "on":
                raise CudaGraphError(f"cuda_graphs 'on', but this module cannot be graphed: {check.reason}")
        return check

    def warm_up_profiles(self) -> float:
        """Capture every shape profile's CUDA graph now (part of compile and load); the seconds it took.
        Nothing to do where graphs are off."""
        profiles = fixed_profiles(self.plan.options.profiles)  # a range has no one shape to capture
        if not self.cuda_graphs.enabled or not profiles:
            return 0.0
        start = time.perf_counter()
        with torch.no_grad():
            for profile in profiles:
                self.cuda_graphs(profile_inputs(self.plan.specs, profile, self.device))
        torch.cuda.synchronize(self.device)
        self.cuda_graphs.warmup_seconds = round(time.perf_counter() - start, 4)
        return self.cuda_graphs.warmup_seconds

    def measure_profiles(self, runs: int = 10) -> list[dict]:
        """Each profile's median latency and what serves it (recorded in the report at compile)."""
        from compiler.validation.validate import measure_latency

        rows = []
        for index, profile in enumerate(self.plan.options.profiles):
            flat = profile_inputs(self.plan.specs, profile, self.device, seed=index)
            with torch.no_grad():
                self._run_uncaptured(flat)  # what the engines dispatch to at this shape
                engines = self.last_dispatch()
                latency = measure_latency({"p": lambda f=flat: self.run_flat(f)}, warmup=2, runs=runs)["p"]
            static = sum(1 for d in engines.values() if d == "static")
            served = (
                f"static specializations in {static} of {len(engines)} engines"
                if static
                else "dynamic engines"
            )
            graphs = self.cuda_graphs
            rows.append(
                {
                    "profile": {k: list(v) if isinstance(v, tuple) else v for k, v in profile.items()},
                    # A range is measured at its opt point.
                    "kind": "fixed" if is_fixed(profile) else "range",
                    "shapes": [list(s) for s in profile_shapes(self.plan.specs, profile, index)],
                    "latency_ms": round(latency.median_ms, 4),
                    "dispatch": f"cuda graph over {served if static else 'the dynamic engines'}"
                    if graphs.enabled
                    else f"{served}, uncaptured ({graphs.reason})",
                    "engines": engines,
                }
            )
        return rows

    def check_padding(self) -> list[dict]:
        """pad_to_profile "auto": which profiles calls may be padded up to (see compiler.runtime.padding)."""
        return check_padding(self._run_uncaptured, self.plan.specs, self.plan.options.profiles, self.device)

    def _check_placement(self, flat: list[object]) -> None:
        """Inputs are dense tensors with data, on the module's device: anything else is a typed error
        naming the input (engines would fail with raw errors, or, like ONNX Runtime's, copy a CUDA
        tensor to the host and answer on the wrong device)."""
        for spec, value in zip(self.plan.specs, flat, strict=False):
            if not isinstance(value, torch.Tensor):
                continue  # check_inputs names the type
            if value.is_meta:
                raise InputSpecError(f"input {spec.name!r} is a meta tensor (no data); pass a real tensor")
            if value.layout != torch.strided:
                raise InputSpecError(
                    f"input {spec.name!r} has layout {value.layout}; the compiled model takes dense tensors "
                    "(call .to_dense())"
                )
            if not same(value.device, self.device):
                raise InputSpecError(
                    f"input {spec.name!r} is on {value.device}, but the model was compiled for "
                    f"{self.device}; move it there (.to({str(self.device)!r}))"
                )

    def _flatten(self, args: tuple, kwargs: dict) -> list[torch.Tensor]:
        if self._in_spec is None:
            return list(args)
        if self._leaf_call is not None:  # every input a single tensor: no pytree needed (~45 us a call)
            positional, keywords = self._leaf_call
            if (
                len(args) == positional
                and len(kwargs) == len(keywords)
                and all(k in kwargs for k in keywords)
            ):
                return [*args, *(kwargs[k] for k in keywords)]
        args, kwargs = self._positional_by_name(tuple(args), dict(kwargs))
        kwarg_spec = self._in_spec.child(1) if self._in_spec.num_children == 2 else None
        if kwarg_spec is not None and kwarg_spec.context is not None:
            expected = list(kwarg_spec.context)
            unknown = sorted(set(kwargs) - set(expected))
            if unknown:
                raise InputSpecError(
                    f"unexpected keyword inputs {unknown}; the model was exported with {expected}"
                )
            kwargs = {name: kwargs[name] for name in expected if name in kwargs}
        flat, spec = pytree.tree_flatten((tuple(args), kwargs))
        if spec != self._in_spec:
            names = [s.name for s in self.plan.specs]
            raise InputSpecError(
                f"inputs do not match the exported call structure: expected {len(names)} inputs {names} "
                f"passed as at export, got {len(args)} positional and keywords {sorted(kwargs)}"
            )
        return flat

    def _positional_by_name(self, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """``m(x=x)`` for a model exported as ``m(x)``: keywords naming positional inputs, as the eager
        model accepts them, fill their positions."""
        positional = self._in_spec.child(0) if self._in_spec.num_children == 2 else None
        if positional is None or not kwargs or len(args) >= positional.num_children:
            return args, kwargs
        # Names of the positional inputs that are single tensors (the placeholder name is the parameter's).
        names, leaf = [], 0
        for index in range(positional.num_children):
            child = positional.child(index)
            names.append(self.plan.specs[leaf].name if child.is_leaf() else None)
            leaf += child.num_leaves
        args, kwargs = list(args), dict(kwargs)
        for name in names[len(args) :]:
            if name is None or name not in kwargs:
                break
            args.append(kwargs.pop(name))
        return tuple(args), kwargs

    def refit(self, state: Mapping[str, torch.Tensor], *, in_place: bool = False) -> CompiledModule:
        """The same engines with new weights (a fine-tuned checkpoint): no lowering, no build.

        By default a new module with its own captures (the old one keeps its weights). ``in_place``:
        this module takes the new weights and is returned: they are copied into the tensors its
        fallback ops and engines already read, so captured CUDA graphs and profile warm-ups stay valid
        (no recapture); an engine that cannot take weights in place is loaded again and the captures
        are dropped. A module compiled in this process from a live model on the same device may share
        those tensors with the model's parameters: they change too."""
        if self.plan.quantized:
            raise RefitError(
                "this model has int8 partitions whose quantized weights and scales were calibrated for "
                "its weights: new weights need a new compile (quantization), not a refit"
            )
        state = self._checked_refit_state(state)
        if in_place:
            return self._refit_in_place(state)
        plan = self.plan.reweighted(state)
        # A new module with its own captures: the old module's graphs keep reading the old weights.
        refitted = assemble(
            plan,
            self.dedup,
            self._refitted_artifacts(plan),
            report=self.report,
            trust_engine_code=self.trust_engine_code,
            cache=self.cache,
        )
        refitted.cuda_graphs.max_shapes = self.cuda_graphs.max_shapes
        refitted.cuda_graphs.static_outputs = self.cuda_graphs.static_outputs
        return refitted

    def _checked_refit_state(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``state`` on the module's device, checked against the module's weights (RefitError)."""
        current = self.plan.weights()
        # New weights live where the model runs (fallback ops read them from the program).
        state = {k: v.to(self.device) for k, v in state.items()}
        unknown = sorted(set(state) - set(current))
        if unknown:
            raise RefitError(f"refit weights name keys the model lacks: {unknown[:10]}")
        for key, tensor in list(state.items()):
            if key in self.plan.reduced_weights and tensor.dtype == torch.float32:  # a checkpoint's fp32
                state[key] = tensor = tensor.to(current[key].dtype)  # as stored: its engines' precision
            if tuple(tensor.shape) != tuple(current[key].shape) or tensor.dtype != current[key].dtype:
                raise RefitError(
                    f"weight {key!r}: expected shape {tuple(current[key].shape)} dtype {current[key].dtype}, "
                    f"got shape {tuple(tensor.shape)} dtype {tensor.dtype}"
                )
        return state

    def _refitted_artifacts(self, plan: PartitionPlan) -> dict[str, EngineArtifact]:
        """Full engines carry their representative's weights: the new ones put in (no rebuild), with the
        backend that built each. Stripped engines and PyTorch fallbacks need nothing."""
        return {
            fp: a
            if a.stripped or not a.is_engine
            else dataclasses.replace(
                a,
                engine=get_backend(a.backend, device=plan.options.device).refit(
                    a.engine, engine_weights(plan, self.dedup.instance(self.dedup.unique[fp]))
                ),
            )
            for fp, a in self.engines.items()
        }

    def _refit_in_place(self, state: Mapping[str, torch.Tensor]) -> CompiledModule:
        # Serialized with calls: a replay must not read half-copied weights.
        with self.cuda_graphs.exclusive(), torch.no_grad():
            current = self.plan.weights()
            for key, tensor in state.items():
                current[key].copy_(tensor)  # what the fallback graph is fed (and the engines' source)
            reloaded = 0
            calls = [(n, c) for n, c in self.graph.named_children() if isinstance(c, EngineCall)]
            per_backend = Counter(self.engines[c.fingerprint].backend for _, c in calls)
            for name, call in calls:
                weights = engine_weights(self.plan, self.dedup.instance(name))
                if hasattr(call.engine, "refit_in_place"):
                    call.engine.refit_in_place(weights)
                    continue
                artifact = self.engines[call.fingerprint]
                siblings = per_backend[artifact.backend] - 1
                call.engine = _load(
                    self.plan, artifact, weights, siblings, self.trust_engine_code, self.cache
                )
                reloaded += 1
            if reloaded:  # captures of the old engines would replay their weights
                self.cuda_graphs.clear()
        self.engines = self._refitted_artifacts(self.plan)  # what a save of this module writes
        if reloaded:
            self.warm_up_profiles()
        return self


def _leaf_call(in_spec: pytree.TreeSpec | None) -> tuple[int, tuple[str, ...]] | None:
    """(positional count, keyword names in flat order) when the exported call takes only single tensors,
    positionally and by keyword; None for nested inputs (lists, dicts of tensors), which pytree flattens."""
    if in_spec is None or in_spec.num_children != 2:
        return None
    positional, keywords = in_spec.child(0), in_spec.child(1)
    if not all(positional.child(i).is_leaf() for i in range(positional.num_children)):
        return None
    if keywords.context is None or not all(keywords.child(i).is_leaf() for i in range(keywords.num_children)):
        return None
    return positional.num_children, tuple(keywords.context)


def assemble(
    plan: PartitionPlan,
    dedup: DedupPlan,
    engines: Mapping[str, EngineArtifact],
    *,
    report: CompileReport | None = None,
    trust_engine_code: bool = True,
    cache: CacheSetting = None,
) -> CompiledModule:
    """Load every engine instance with its weights (refit) and wire them into the fallback graph.
    ``trust_engine_code``: False for engines from an untrusted source (see ``get_backend``). ``cache``:
    the engine cache, as everywhere (None: the default), where a backend keeps what it compiles at
    load (Inductor: engines whose compiled graphs do not load here)."""
    start = time.perf_counter()
    graph = copy.copy(plan.graph_module)
    refits = 0
    per_backend = Counter(
        engines[dedup.instance(p.name).fingerprint].backend
        for p in plan.partitions
        if engines[dedup.instance(p.name).fingerprint].is_engine
    )
    for part in plan.partitions:
        instance = dedup.instance(part.name)
        artifact = engines[instance.fingerprint]
        if not artifact.is_engine:
            continue  # the build fell back to PyTorch: the partition's own submodule stays in the graph
        shared = dedup.unique[instance.fingerprint] != part.name
        weights = engine_weights(plan, instance)
        siblings = per_backend[artifact.backend] - 1
        engine = _load(plan, artifact, weights, siblings, trust_engine_code, cache)
        refits += int(shared or artifact.stripped)
        positions = tuple(i for i, src in enumerate(part.inputs) if src.kind == "activation")
        setattr(graph, part.name, EngineCall(engine, artifact.io, positions, instance.fingerprint))
    if report is None:
        backend = get_backend(plan.options.backend, device=plan.options.device)
        report = report_of(
            plan, dedup, engines, backend.name, backend.library_version(), backend.engine_target(), refits
        )
    report.stage_seconds["assemble"] = round(time.perf_counter() - start, 4)
    module = CompiledModule(
        plan, dedup, engines, graph, report, trust_engine_code=trust_engine_code, cache=cache
    )
    # A new compile (or a package from before the check, or compiled with graphs off): check the
    # capture once and record it. A recorded check is trusted: loads and refits skip it.
    if module.cuda_graphs.enabled and report.cuda_graphs is None:
        check = module.check_cuda_graphs()
        report.cuda_graphs = check.to_dict() if check is not None else None
        report.stage_seconds["cuda_graphs_check"] = check.seconds if check is not None else 0.0
    warmup = module.warm_up_profiles()  # captured at compile, load and refit: first calls replay
    if plan.options.profiles and report.profiles is None:
        report.profiles = module.measure_profiles()
        report.stage_seconds["profiles_warmup"] = warmup
        if plan.options.pad_to_profile == "auto":
            start = time.perf_counter()
            for row, padding in zip(report.profiles, module.check_padding(), strict=True):
                row["padding"] = padding
                if not padding["allowed"] and row["kind"] == "fixed":  # a range is never a target
                    warnings.warn(f"pad_to_profile: refused for {padding['reason']}", stacklevel=2)
            report.stage_seconds["padding_check"] = round(time.perf_counter() - start, 4)
            module._pad_targets = pad_targets(plan.specs, plan.options.profiles, report.profiles)
    return module


def _load(
    plan: PartitionPlan,
    artifact: EngineArtifact,
    weights: Mapping[str, torch.Tensor],
    siblings: int,
    trust_engine_code: bool,
    cache: CacheSetting,
) -> Engine:
    """One engine instance, loaded by the backend that built it, on the model's device."""
    backend = get_backend(artifact.backend, device=plan.options.device, trust_engine_code=trust_engine_code)
    return backend.load(artifact.engine, artifact.io, weights, siblings=siblings, cache=cache)
