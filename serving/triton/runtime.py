"""What kiln's Python backend runs inside Triton's stub: load a staged version, answer batches.

``backend/model.py`` (the file Triton runs, the same bytes in every version folder) only makes kiln
importable and hands Triton's calls to :class:`ServedRuntime`.

Load: the version folder's ``kiln.json`` (:class:`serving.triton.config.ServedModel`) says which
content the registry recorded; the package is loaded with ``compiler.load``, which verifies every
checksum (and the model-signing signature where a verification key is set) before anything is used,
and its content hash must equal the recorded one. Any failure raises, so Triton marks the version
unavailable and keeps serving what it had.

Execute: Triton's dynamic batcher hands over several requests at once. Each request's inputs are
checked against the package's input specs (dtype and range, so an out-of-range shape is refused with
the reason in that request's error, not the others'); requests whose shapes agree past the batch axis
are concatenated and run as one call, and the outputs split back. Tensors cross through DLPack, not
numpy: the stub's numpy bridge is built for numpy 1 and misreads numpy 2 arrays.

Threads: each instance runs its ONNX Runtime sessions and torch ops on :func:`instance_threads`
intra-op threads (the config's ``kiln_threads``; 0: the cores left after one for Triton's own front
end, shared by the instances; cores as a container's CPU limit allows, :func:`available_cores`).
Left to their defaults, ONNX Runtime and torch each start one thread per core in every instance, and
ONNX Runtime's spin while idle: on a small CPU they take the cores from Triton's HTTP/gRPC threads
and from the other instances, which shows as a long latency tail (2 threads instead of 1 on 2
cores: p99/p50 4-6 instead of 1.7-2.8 at 16 clients, side by side, benchmarks/triton_serving.py).

Warm-up: before ``initialize`` returns, the module runs once at its smallest and largest input
shapes, so the first requests to a new version pay no first-run cost, and a version that cannot run
is refused at load (Triton keeps serving what it had). The log says what the load cost.
"""

from __future__ import annotations

import gc
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from serving.triton.config import PACKAGE_DIR, SERVED_FILE, THREADS_PARAMETER, ServedModel
from serving.triton.errors import TritonConfigError

ORT_THREADS_ENV = "KILN_ORT_THREADS"  # compiler.backends.onnxruntime reads it when a session is made

Loader = Callable[[Path, str, ServedModel], tuple[Any, Sequence[Any]]]


class ServedRuntime:
    """One Triton model instance: a loaded module and the signature it is served with."""

    def __init__(self, module: Any, served: ServedModel, specs: Sequence[Any], device: str, pb_utils: Any):
        self.module = module
        self.served = served
        self.specs = list(specs)
        self.device = device
        self.pb = pb_utils
        self.batched = served.max_batch_size > 0
        self.decoupled = False  # config.pbtxt's decoupled policy: a generation version streaming tokens

    @classmethod
    def from_triton_args(cls, args: dict, pb_utils: Any, load: Loader | None = None) -> ServedRuntime:
        """From ``initialize``'s arguments. ``load(package_dir, device, served) -> (module, input specs)``: by
        default ``compiler.load`` of the verified package (a benchmark passes an eager model instead)."""
        started = time.perf_counter()
        version_dir = Path(args["model_repository"]) / str(args["model_version"])
        served = ServedModel.from_json(
            (version_dir / SERVED_FILE).read_text(), str(version_dir / SERVED_FILE)
        )
        device = "cpu"
        if args.get("model_instance_kind") == "GPU":
            device = f"cuda:{int(args.get('model_instance_device_id', 0))}"
        threads = apply_threads(args.get("model_config"), device)
        imported = time.perf_counter()
        module, specs = (load or load_verified)(version_dir / PACKAGE_DIR, device, served)
        loaded = time.perf_counter()
        kind = cls
        if served.method == "generate":  # a generation package: token ids in, token ids out
            from serving.triton.generation import GenerationRuntime as kind
        runtime = kind(module, served, specs, device, pb_utils)
        runtime.decoupled = decoupled(args.get("model_config"), served)
        runtime.warm_up()
        # Everything imported and loaded so far lives as long as the stub: out of the collector's
        # generations, so a full collection during execute walks only what requests allocate (with
        # torch imported, hundreds of thousands of objects: milliseconds of a request's latency).
        gc.collect()
        gc.freeze()
        done = time.perf_counter()
        logger = getattr(pb_utils, "Logger", None)
        if logger is not None:
            from compiler.package.signing import trust_note  # why its engines compiled, or did not

            logger.log_info(
                f"kiln: {served.name} version {served.version} ready in {done - started:.2f} s (torch "
                f"{imported - started:.2f} s, verify and load {loaded - imported:.2f} s, warm-up "
                f"{done - loaded:.2f} s; {threads or 'default'} intra-op threads); "
                f"{load_stages(module)}"
                f"{trust_note(version_dir / PACKAGE_DIR, getattr(module, 'trust_engine_code', None))}"
            )
        return runtime

    def warm_up(self) -> None:
        """Run once at the specs' smallest and largest shapes, on the serving device (first-run costs
        paid before serving), and check that what it returns is what the version is served with."""
        import torch

        with torch.inference_mode():
            for shapes in ("min_shape", "max_shape"):
                self._outputs(self._call([t.to(self.device) for t in example_inputs(self.specs, shapes)]))

    def _call(self, inputs: list) -> list:
        """The module on flat inputs in the specs' order: one path for models exported with positional
        or keyword inputs (``run_flat``; an eager model a benchmark serves is called positionally)."""
        run_flat = getattr(self.module, "run_flat", None)
        if run_flat is not None:
            return list(run_flat(inputs))
        from torch.utils import _pytree

        return _pytree.tree_leaves(self.module(*inputs))

    def _outputs(self, flat: list) -> list[tuple[str, Any]]:
        """(served name, tensor) per output; RuntimeError when the module returns other outputs than the
        version is served with (a repository exported from another package)."""
        import torch

        from compiler.inputs.specs import dtype_name

        served = self.served.outputs
        found = [(type(v).__name__ if not isinstance(v, torch.Tensor) else dtype_name(v.dtype)) for v in flat]
        if found != [o.dtype for o in served]:
            raise RuntimeError(
                f"the module returned outputs of types {found}, but {self.served.registered_model} version "
                f"{self.served.version} is served with {[(o.name, o.dtype) for o in served]}; export the "
                "repository again"
            )
        return [(sig.name, value) for sig, value in zip(served, flat, strict=True)]

    def execute(self, requests: list) -> list:
        import torch

        responses: list[Any] = [None] * len(requests)
        ready: list[tuple[int, list[torch.Tensor]]] = []
        for index, request in enumerate(requests):
            try:
                ready.append((index, self._inputs(request)))
            except Exception as exc:  # that request's answer, not the batch's
                responses[index] = self._error(exc)
        # Requests whose shapes agree past the batch axis run as one call.
        groups: dict[tuple, list[tuple[int, list[torch.Tensor]]]] = {}
        for item in ready:
            key = tuple(tuple(t.shape[1:]) for t in item[1]) if self.batched else ("one", item[0])
            groups.setdefault(key, []).append(item)
        for items in groups.values():
            try:
                for index, outputs in self._run(items):
                    responses[index] = self.pb.InferenceResponse(output_tensors=outputs)
            except Exception as exc:
                for index, _ in items:
                    responses[index] = self._error(exc)
        return responses

    def _inputs(self, request: Any) -> list:
        import torch

        from compiler.inputs.specs import dtype_name

        tensors = []
        for spec in self.specs:
            found = self.pb.get_input_tensor_by_name(request, spec.name)
            if found is None:
                raise ValueError(f"input {spec.name!r} is missing")
            tensor = torch.from_dlpack(found.to_dlpack())
            if dtype_name(tensor.dtype) != spec.dtype:
                raise ValueError(
                    f"input {spec.name!r}: expected dtype {spec.dtype}, got {dtype_name(tensor.dtype)}"
                )
            spec.check(tensor)  # InputSpecError naming the input and its range
            spec.check_values(tensor)  # token ids past the embedding: named here, not a Gather error
            tensors.append(tensor)
        return tensors

    def _run(self, items: list[tuple[int, list]]) -> list[tuple[int, list]]:
        import torch
        from torch.utils import dlpack

        sizes = [item[1][0].shape[0] for item in items] if self.batched else [None] * len(items)
        if self.batched and len(items) > 1:
            inputs = [torch.cat([item[1][i] for item in items]) for i in range(len(self.specs))]
        else:
            inputs = items[0][1] if len(items) == 1 else None
        results = []
        if inputs is None:  # not batched: one call per request
            for item in items:
                results += self._run([item])
            return results
        with torch.inference_mode():
            named = self._outputs(self._call([t.to(self.device) for t in inputs]))
            # One device-to-host copy per output for the whole batch, then host slices per request
            # (a copy per request synchronized the device once per request).
            named = [(name, value.detach().cpu()) for name, value in named]
        start = 0
        for (index, _), size in zip(items, sizes, strict=True):
            tensors = []
            for name, value in named:
                part = value if size is None else value[start : start + size]
                tensors.append(self.pb.Tensor.from_dlpack(name, dlpack.to_dlpack(part.contiguous())))
            results.append((index, tensors))
            start += size or 0
        return results

    def _error(self, exc: BaseException) -> Any:
        """The request's error: INVALID_ARG (HTTP 400) for what the request got wrong (an input
        missing, of another dtype, outside its recorded shape or index range), INTERNAL otherwise."""
        from compiler.errors import InputSpecError

        message = f"{type(exc).__name__}: {exc}"
        error = self.pb.TritonError
        code = getattr(
            error, "INVALID_ARG" if isinstance(exc, InputSpecError | ValueError) else "INTERNAL", None
        )
        made = error(message) if code is None else error(message, code)
        return self.pb.InferenceResponse(output_tensors=[], error=made)


def instance_threads(configured: int, instances: int, cores: int | None) -> int:
    """Intra-op threads per instance: ``configured`` when > 0, else the cores left after one for
    Triton's front end, shared by the instances (at least 1: 2 cores, 1 instance -> 1)."""
    if configured > 0:
        return configured
    return max(1, ((cores or 1) - 1) // max(1, instances))


def available_cores() -> int:
    """The cores this process may use: its CPU affinity, capped by a cgroup CPU quota (a container's
    CPU limit, e.g. KServe's ``limits: {cpu: "4"}`` on a 64-core node, which ``os.cpu_count`` ignores)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    quota = None
    try:  # cgroup v2: "max 100000" or "400000 100000"
        limit, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        quota = None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        try:  # cgroup v1
            limit = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
            period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
            quota = limit / period if limit > 0 and period > 0 else None
        except (OSError, ValueError):
            quota = None
    if quota is not None:
        cores = min(cores, max(1, math.ceil(quota)))
    return max(1, cores)


def model_config_dict(model_config: Any) -> dict:
    """The model's config as Triton hands it to the stub: its JSON of the config.pbtxt kiln wrote."""
    return json.loads(model_config) if isinstance(model_config, str) else dict(model_config or {})


def decoupled(model_config: Any, served: ServedModel) -> bool:
    """Whether the config says the decoupled transaction policy (``render_config``'s ``stream``), which
    only a generation version is served with."""
    config = model_config_dict(model_config)
    policy = bool((config.get("model_transaction_policy") or {}).get("decoupled", False))
    if policy and served.method != "generate":
        raise TritonConfigError(
            f"{served.registered_model} version {served.version}: config.pbtxt sets the decoupled "
            "transaction policy, which only a generation version streams with; export the model again "
            "without --stream-tokens"
        )
    return policy


def apply_threads(model_config: Any, device: str) -> int:
    """Set this stub's intra-op threads from the model config (``kiln_threads``) before anything is
    loaded: ``$KILN_ORT_THREADS`` for ONNX Runtime's sessions (an operator's own setting of it in the
    server's environment wins over the default) and torch's. The count set, or 0 on a GPU (left alone)."""
    import torch

    config = model_config_dict(model_config)
    raw = (config.get("parameters") or {}).get(THREADS_PARAMETER, {}).get("string_value", "0")
    try:
        configured = int(raw)
    except ValueError:
        raise TritonConfigError(
            f"config.pbtxt parameter {THREADS_PARAMETER}={raw!r}: expected a thread count (0: automatic)"
        ) from None
    if device != "cpu":
        return 0
    if configured == 0 and os.environ.get(ORT_THREADS_ENV, "").strip():
        configured = int(os.environ[ORT_THREADS_ENV])
    instances = sum(int(group.get("count", 1)) for group in config.get("instance_group") or [{}])
    threads = instance_threads(configured, instances, available_cores())
    os.environ[ORT_THREADS_ENV] = str(threads)
    torch.set_num_threads(threads)
    return threads


def load_stages(module: Any) -> str:
    """``compiler.load``'s stage split (``CompiledModule.load_seconds``) as the start log shows it, the
    stages cold-start work is measured by (benchmarks/cold_start_zoo.py); empty for a module without."""
    stages = getattr(module, "load_seconds", None)
    if not isinstance(stages, dict) or not stages:
        return ""
    return "load stages " + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in stages.items()) + "; "


def load_verified(package_dir: Path, device: str, served: ServedModel) -> tuple[Any, Sequence[Any]]:
    """``compiler.load`` (every checksum, the model-signing signature where a verification key is set),
    then the content hash the registry recorded: another valid package put in its place is refused too."""
    import compiler
    from compiler.errors import PackageCorruptError

    # run_flat alone serves here: the outputs' types (transformers' for an HF model) are never imported
    module = compiler.load(package_dir, device=device, defer_output_types=True)
    manifest = compiler.read_manifest(package_dir)
    if manifest.content_hash != served.content_hash:
        raise PackageCorruptError(
            f"{package_dir} holds content {manifest.content_hash[:16]}..., but {served.registered_model} "
            f"version {served.version} is {served.content_hash[:16]}... in the registry: refused"
        )
    return module, manifest.input_specs


def example_inputs(specs: Sequence[Any], shapes: str) -> list:
    """One tensor per spec at its ``min_shape`` or ``max_shape``; integers inside the recorded range."""
    import torch

    made = []
    for spec in specs:
        shape = getattr(spec, shapes)
        if spec.dtype.startswith(("float", "bfloat")):
            made.append(torch.randn(shape).to(spec.torch_dtype))
        elif spec.dtype == "bool":
            made.append(torch.zeros(shape, dtype=torch.bool))
        else:
            lo, hi = spec.value_range or (0, 1)
            made.append(torch.randint(int(lo), int(hi) + 1, shape, dtype=spec.torch_dtype))
    return made


def probe_output_specs(module: Any, specs: Sequence[Any]) -> tuple[Any, ...]:
    """Output specs of a package written before kiln recorded them (format 2), by running it once at
    the specs' smallest and largest shapes on the device it was loaded on: an axis that changed is
    dynamic, named as the input dimension it equals at both ends."""
    import torch

    from compiler.inputs.specs import OutputSpec, dtype_name
    from compiler.program.outputs import output_names

    device = getattr(module, "device", "cpu")
    runs = []
    with torch.inference_mode():
        for shapes in ("min_shape", "max_shape"):
            runs.append(list(module.run_flat([t.to(device) for t in example_inputs(specs, shapes)])))
    names = output_names(module._out_spec)
    if len(names) != len(runs[0]):
        names = [f"output_{i}" for i in range(len(runs[0]))]
    dims = {}  # (min, max) of each named input dimension -> its name
    for spec in specs:
        for axis, dim in spec.dynamic_dims.items():
            dims.setdefault((spec.min_shape[axis], spec.max_shape[axis]), dim)
    made = []
    for name, small, large in zip(names, runs[0], runs[1], strict=True):
        if not isinstance(small, torch.Tensor):
            made.append(OutputSpec(name, type(small).__name__, (), ()))
            continue
        dynamic = {
            axis: dims.get((s, b), f"{name}_{axis}")
            for axis, (s, b) in enumerate(zip(small.shape, large.shape, strict=True))
            if s != b
        }
        made.append(
            OutputSpec(name, dtype_name(small.dtype), tuple(small.shape), tuple(large.shape), dynamic)
        )
    return tuple(made)
