"""AOTInductor: an Inductor engine's program compiled once more, ahead of time, into a native package,
for loads that must answer within seconds (issue 20, cold start).

A standalone compiled graph loads through Inductor's caches: its load imports Inductor's compile stack
and Triton and then loads each kernel (about 3.6 s of BERT-base's 6.2 s cold start on the H100). An
AOTInductor package is a shared library with its kernels' binaries: ``torch._C._aoti`` loads it with
neither imported (BERT-base fp16: 0.002 s to load, 0.2 s first call). It takes the same inputs as the
standalone graph (activations, then weights: dedup, refit and stripping work as before; lifted
constants are compiled in), so an engine carries it beside its standalone graph (``backend_options:
{aot: true}``, off by default: the C++ compile of its wrapper costs a minute or more per engine, 80 s
for BERT-base on the H100 host).

Two C++ runtimes in one process crash it: a package whose wrapper was compiled with headers newer than
the libstdc++ the loading process has (the H100 image's ``/opt/gcc`` compiler beside the system's
libstdc++) segfaults at load. Hence the compiler (:func:`aot_compiler`): ``$KILN_AOT_CXX`` where set,
else the system's own ``g++``, whose headers match the system libstdc++ that Python and torch load
(or predate a newer one a conda environment brings: libstdc++ loads older code, not newer; the
header records it, ``compat.py``). Each build is then loaded in a fresh process (started while the
package compiles: its torch import runs beside the compile) and must answer like the program run
eagerly; one that crashes or differs is left out, with a warning naming the compiler and the exit
status, and the engine gets its standalone graph instead.

On a CUDA device a package is the default form of an engine (``backend_options: {aot: false}`` asks
for the standalone graph alone), and an engine that has one holds no standalone graph: the package
serves every shape. A package is native code: it runs only where engine code is trusted
(docs/security.md); an untrusted load compiles the engine from its program, serves that, and builds
this machine's own package in the background (``compiler.backends.inductor.native.LocalAot``).
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import weakref
from collections.abc import Mapping, Sequence
from typing import Any

import torch

# The check a build runs in a fresh process: load the package with torch._C._aoti alone, run it on the
# build's inputs and compare with the standalone graph's answer (saved beside it). The process starts
# (and imports torch, seconds) while the package compiles; it reads what to check from its stdin.
_CHECK = r"""
import importlib
import json
import sys
import torch
from safetensors.torch import load_file
line = sys.stdin.readline()
if not line:
    sys.exit("no package to check")
package, tensors, device, tolerance, index, op_modules = json.loads(line)
for module in op_modules:  # the package calls these ops through the dispatcher: register them
    importlib.import_module(module)
data = load_file(tensors, device=device)
inputs = [data[f"in{i}"] for i in range(sum(k.startswith("in") for k in data))]
runner = torch._C._aoti.AOTIModelPackageLoader(package, "model", True, 1, index)
with torch.no_grad():
    outputs = runner.run(inputs)
worst = 0.0
for i, out in enumerate(outputs):
    want = data[f"out{i}"]
    if out.shape != want.shape or out.dtype != want.dtype:
        sys.exit(f"output {i}: {tuple(out.shape)} {out.dtype}, expected {tuple(want.shape)} {want.dtype}")
    if want.is_floating_point():
        scale = float(want.float().abs().max()) or 1.0
        worst = max(worst, float((out.float() - want.float()).abs().max()) / scale)
    elif not torch.equal(out, want):
        worst = float("inf")
if not worst <= tolerance:
    sys.exit(f"answers differ from the standalone graph's by {worst:.3g} (relative; allowed {tolerance})")
"""


def aot_compiler() -> str | None:
    """The C++ compiler for AOTInductor's wrapper: ``$KILN_AOT_CXX``, else the system's g++, else the
    one Inductor would use (``$CXX``, ``g++``); None when there is none."""
    named = os.environ.get("KILN_AOT_CXX")
    candidates = [named] if named else ["/usr/bin/g++", "/usr/bin/c++", os.environ.get("CXX"), "g++"]
    for candidate in candidates:
        found = shutil.which(candidate) if candidate else None
        if found:
            return found
    return None


def build_aot(
    exported: torch.export.ExportedProgram,
    inputs: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    inductor_config: Mapping[str, Any],
    device: torch.device,
    precision: str,
) -> tuple[bytes | None, str]:
    """(the AOTInductor package's bytes, the compiler) or (None, why it was left out). ``inputs``: the
    program's user inputs (activations, then weights); ``expected``: the standalone graph's answer."""
    compiler = aot_compiler()
    if compiler is None:
        return None, "no C++ compiler (install g++ or set KILN_AOT_CXX)"
    with tempfile.TemporaryDirectory(prefix="kiln-aot-") as scratch, FreshChecker() as checker:
        package = os.path.join(scratch, "engine.pt2")
        exported.example_inputs = (tuple(inputs), {})
        configs = {**inductor_config, "cpp.cxx": (None, compiler)}
        # One package is one wrapper compile: a precompiled header (on by default in torch 2.11 and 2.13)
        # is built first in a fresh Inductor cache and pays off only over many compiles. Without it the
        # build of a 8-layer MLP's package on the 2-core CPU here took 40 s instead of 75 s
        # (AotCodeCompiler.compile; the header's precompile was 42 s of it); on the H100 the C++ compile
        # was 9-15 s of the default compile that the standalone form does not have (issue 45).
        configs.setdefault("aot_inductor.precompile_headers", False)
        if device.type == "cuda":
            # The wrapper of a CUDA package is host glue (its kernels are Triton's): no CPU vector ISA is
            # needed, and Inductor's ISA probes (a compile and a fresh Python process each) cost 35-40 s
            # of a 77 s GPT-2 package build on the H200 host (benchmarks/probes/probe_aot_cost.h200.json).
            configs["cpp.vec_isa_ok"] = False
            # Its C++ wrapper only launches kernels (and, under CUDA graphs, is replayed, not run): built
            # at -O0 unless the build's options say otherwise, the C++ compile the standalone form does
            # not have is a fraction of Inductor's -O1 (issue 45: the default compile at 1.8-2.4x the
            # standalone form's).
            if "aot_inductor.compile_wrapper_opt_level" in torch._inductor.config.get_config_copy():
                configs.setdefault("aot_inductor.compile_wrapper_opt_level", "O0")
        try:
            from compiler.program.tracing import TRACING

            with TRACING:
                torch._inductor.aoti_compile_and_package(
                    exported, package_path=package, inductor_configs=configs
                )
        except Exception as exc:  # Inductor raises many types; the warning needs the cause
            return None, f"AOTInductor could not compile it ({compiler}): {type(exc).__name__}: {exc}"[:600]
        from compiler.program.module_policy import custom_op_modules

        ops = sorted(custom_op_modules(exported))
        problem = _check_in_fresh_process(package, inputs, expected, device, precision, scratch, checker, ops)
        if problem is not None:
            return None, f"its AOTInductor package (C++ compiler {compiler}) {problem}"
        with open(package, "rb") as file:
            return file.read(), compiler


class FreshChecker:
    """The fresh process a build's package is checked in, started before the package compiles: its
    Python and torch import (2-5 s) run beside the compile instead of after it."""

    def __init__(self) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-c", _CHECK],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def run(self, args: list, timeout: float) -> tuple[int, str]:
        """(exit status, stderr) of the check of ``args`` (package, tensors, device, tolerance, index,
        op modules)."""
        _, stderr = self.process.communicate(json.dumps(args) + "\n", timeout=timeout)
        return self.process.returncode, stderr

    def __enter__(self) -> FreshChecker:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.process.poll() is None:  # a compile that failed leaves it waiting: it checks nothing
            self.process.kill()
            self.process.communicate()


def _check_in_fresh_process(
    package: str,
    inputs: Sequence[torch.Tensor],
    expected: Sequence[torch.Tensor],
    device: torch.device,
    precision: str,
    scratch: str,
    checker: FreshChecker | None = None,
    op_modules: Sequence[str] = (),
) -> str | None:
    """None when the package loads in a fresh process (``checker``'s, else one started now) and answers
    like the standalone graph; else why. ``op_modules``: modules defining the custom ops the program
    calls (kiln's own, or ones the build's process imported), imported there first, as a load does."""
    from safetensors.torch import save_file

    tensors = os.path.join(scratch, "check.safetensors")
    named = {f"in{i}": t for i, t in enumerate(inputs)} | {f"out{i}": t for i, t in enumerate(expected)}
    save_file({k: v.detach().cpu().contiguous() for k, v in named.items()}, tensors)
    tolerance = 1e-4 if precision == "fp32" else 2e-2
    index = (device.index or 0) if device.type == "cuda" else -1
    with checker or FreshChecker() as fresh:
        try:
            args = [package, tensors, str(device), tolerance, index, list(op_modules)]
            status, stderr = fresh.run(args, timeout=600)
        except subprocess.TimeoutExpired:
            return "did not answer within 600 s in a fresh process"
    if status == 0:
        return None
    if status < 0:
        name = signal.Signals(-status).name
        return (
            f"crashed a fresh process that loaded it ({name}): most likely two C++ runtimes in one "
            "process (its wrapper's headers newer than the libstdc++ Python loads); set KILN_AOT_CXX to "
            "the compiler of that libstdc++"
        )
    lines = [line for line in stderr.strip().splitlines() if line.strip()]
    return f"failed in a fresh process: {lines[-1][:400] if lines else f'exit {status}'}"


class AotGraph:
    """A loaded AOTInductor package, called like the standalone graph (lifted constants at their
    positions are dropped: the package holds them).

    torch's loader unpacks the package into a /tmp/aotinductor_* folder that only its destructor
    removes. One still referenced at interpreter exit (a `kiln zoo` task result held by a worker
    thread) was never destroyed: a folder left per such load. Live graphs let go of their loader at
    exit (:func:`_unload_at_exit`)."""

    def __init__(self, data: bytes, device: torch.device, constant_positions: Sequence[int]):
        index = (device.index or 0) if device.type == "cuda" else -1
        # The loader reads a file (it unpacks the library to its own directory), so the bytes, already
        # verified, go to a private file first and are removed once loaded.
        handle, path = tempfile.mkstemp(prefix="kiln-aot-", suffix=".pt2")
        try:
            with os.fdopen(handle, "wb") as file:
                file.write(data)
            # Single-threaded: no model pool, no events synchronised between calls, so a call can be
            # captured in a CUDA graph.
            self._runner = torch._C._aoti.AOTIModelPackageLoader(path, "model", True, 1, index)
        finally:
            os.unlink(path)
        self._constants = frozenset(constant_positions)
        _live.add(self)

    def __call__(self, *args: torch.Tensor) -> list[torch.Tensor]:
        if self._constants:
            args = tuple(a for i, a in enumerate(args) if i not in self._constants)
        return self._runner.run(list(args))


_live: weakref.WeakSet[AotGraph] = weakref.WeakSet()


@atexit.register
def _unload_at_exit() -> None:
    """Destroy the loaders of the graphs still alive, while the interpreter can: each removes its
    unpacked folder."""
    for graph in list(_live):
        graph._runner = None


def aot_from_program(
    program: bytes,
    io: Any,
    weights: Sequence[torch.Tensor],
    options: Mapping[str, Any],
    device: torch.device,
    precision: str,
    *,
    frozen: bool = False,
    graph: Any = None,
) -> tuple[bytes | None, str]:
    """An engine's program built by :func:`build_aot`, checked on example inputs against the program
    run eagerly: what a build and a machine's own package (``native``) both do. ``graph``: the
    program already loaded as a :class:`~compiler.backends.inductor.graph.ProgramGraph`, which the
    compile consumes (else it is loaded from ``program``)."""
    from compiler.backends.inductor.graph import ProgramGraph, example_inputs, graph_args
    from compiler.backends.inductor.options import inductor_config

    graph = graph if graph is not None else ProgramGraph.load(program, device, frozen=frozen)
    activations = example_inputs(io, device)
    with torch.no_grad():
        expected = list(graph.module(*graph_args(activations, tuple(weights), graph.constants)))
    return build_aot(
        graph.exported,
        [*activations, *weights],
        expected,
        inductor_config(options, frozen=frozen),
        device,
        precision,
    )
