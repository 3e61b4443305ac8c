"""Load tampered packages untrusted, in this (fresh) process, under an audit hook; report what happened.

Run by tests/compiler/package/test_untrusted_load.py as ``python untrusted_probe.py CONFIG
RESULTS``. CONFIG names clean packages (an ONNX Runtime one and an Inductor one), the input and the
outputs their compiled modules gave, and the attacks to stage. Phase 1 stages every tampered package as an
attacker with write access and no signing key would: edit a field of the manifest or of an engine header,
then recompute the engine's checksum and the manifest's content hash
(``compiler.package.digest.content_hash``). Phase 2 installs ``sys.addaudithook`` and loads each
(``trust_engine_code=False``), recording for each: refused (the error's type, whether it is a KilnError)
or the outputs (same as the original or not), and every audited event that breaks the rule "an untrusted
load reads nothing outside its package and starts no process": a process started (``subprocess.Popen``,
``os.system``, ``os.exec``, ``os.spawn``, ``os.posix_spawn``, ``os.fork``) other than the host C++
compiler or this interpreter (Inductor's own compile, whose command line must carry nothing of the
package's: no argument containing the attack token), a file opened outside the package, Python's own
directories and Inductor's cache, or a library loaded from anywhere but those directories (never from the
package itself). The one library load by bare name allowed is torch's own probe of the system's NVIDIA
driver (NVML, the driver API, NVRTC), made by torch's code: the CUDA build of torch counts devices through
NVML on every call where no GPU is up. Last, a positive control does what the rule forbids, to prove the
hook sees it.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

TOKEN = "kilnpwn"  # in every hostile string: a process whose command line carries it ran package text
HOSTILE = f"../../secrets.env;touch {TOKEN}-a`touch {TOKEN}-b`$(touch {TOKEN}-c)|sh -c {TOKEN}"
HUGE = 10**30
KINDS = ("onnxruntime", "inductor")


# ---------------------------------------------------------------- phase 1: staging (no hook yet)


def _reseal(path: Path) -> None:
    _reseal_data(path, json.loads((path / "manifest.json").read_text()))


def _reseal_data(path: Path, data: Any, *, checksums: bool = True) -> None:
    """Recompute the files' checksums (unless the edit is to them) and the content hash."""
    from compiler.package.digest import content_hash
    from compiler.package.manifest import FileRecord

    files = data.get("files") if isinstance(data, dict) and checksums else None
    for rel, record in (files or {}).items() if isinstance(files, dict) else ():
        file = path / rel if isinstance(rel, str) and ".." not in rel else None
        if file is not None and file.is_file() and isinstance(record, dict):
            record.clear()
            record.update(FileRecord.of(file.read_bytes()).to_json())
    if isinstance(data, dict):
        # A mutation the hash function itself cannot read: the load must refuse it.
        with contextlib.suppress(Exception):
            data["content_hash"] = content_hash(data)
    (path / "manifest.json").write_text(json.dumps(data))


def _paths(value: Any, prefix: tuple = (), depth: int = 0, limit: int = 3):
    """Every field path down to ``limit`` levels (a list's first element stands for its elements); the
    compile report's fields, not the entries of its tables (stage timings, fallback counts)."""
    if prefix:
        yield prefix
    if prefix[:1] == ("engines",):
        limit = 6  # the engine records' io reaches shapes the backends allocate from
    if depth >= limit or (prefix[:1] == ("report",) and depth >= 2):
        return
    if isinstance(value, dict):
        for key in sorted(value):
            yield from _paths(value[key], (*prefix, key), depth + 1, limit)
    elif isinstance(value, list) and value:
        yield from _paths(value[0], (*prefix, 0), depth + 1, limit)


def _retyped(value: Any) -> Any:
    if isinstance(value, bool):
        return "true"
    if isinstance(value, int | float):
        return str(value)
    if isinstance(value, str):
        return 12345
    if isinstance(value, list):
        return {"0": value[0] if value else None}
    if isinstance(value, dict):
        return list(value.values())
    return {"x": 1}


MUTATIONS = ("type", "hostile", "drop", "huge")


def _mutate(data: Any, path: tuple, how: str) -> bool:
    """Apply one mutation in place; False where it does not apply (nothing to drop, say)."""
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    key = path[-1]
    if how == "drop":
        del parent[key]
    elif how == "type":
        parent[key] = _retyped(parent[key])
    elif how == "hostile":
        if parent[key] == HOSTILE:
            return False
        parent[key] = HOSTILE
    elif how == "huge":
        parent[key] = HUGE
    return True


def _engine_files(engine: bytes) -> dict[str, bytes]:
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(engine)) as archive:
        return {name: archive.read(name) for name in archive.namelist()}


def _zip(files: dict[str, bytes]) -> bytes:
    import io
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name, data in files.items():
            archive.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), data)
    return out.getvalue()


def _inductor_engine(path: Path) -> Path:
    manifest = json.loads((path / "manifest.json").read_text())
    return path / next(r["file"] for r in manifest["engines"].values() if r["backend"] == "inductor")


def stage(config: dict, scratch: Path) -> list[dict]:
    """Every case: {name, package, kind, extra} with the tampered package written under ``scratch``."""
    cases: list[dict] = []

    def new(name: str, source: str, kind: str) -> Path:
        target = scratch / f"case{len(cases):04d}"
        shutil.copytree(source, target)
        cases.append({"name": name, "package": str(target), "kind": kind})
        return target

    # Defect 23.1 first, in a process that has compiled nothing yet: the header asks for a -wrapper.
    payload = f'native -wrapper \'/bin/sh,-c,touch {config["marker"]}-{TOKEN}; exec "$0" "$@"\''
    target = new("inductor header: cpp.march wrapper", config["inductor"], "inductor")
    engine = _inductor_engine(target)
    files = _engine_files(engine.read_bytes())
    header = json.loads(files["kiln_inductor_engine.json"])
    header["options"]["compile_options"] = {"cpp.march": payload}
    files["kiln_inductor_engine.json"] = json.dumps(header).encode()
    engine.write_bytes(_zip(files))
    _reseal(target)

    # Defect 23.3: an initializer stored as external data at a relative path (the loader's cwd).
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper

    target = new("onnx engine: external data initializer", config["onnxruntime"], "onnxruntime")
    manifest = json.loads((target / "manifest.json").read_text())
    for record in manifest["engines"].values():
        if record["file"] is None:
            continue
        model = onnx.load_from_string((target / record["file"]).read_bytes())
        width = config["secret_bytes"] // 4
        tensor = numpy_helper.from_array(np.zeros(width, dtype=np.float32), "kiln_secret")
        tensor.ClearField("raw_data")
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", "secrets.env"), ("offset", "0"), ("length", str(width * 4))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
        model.graph.initializer.append(tensor)
        out = model.graph.output[0].name
        model.graph.node.append(helper.make_node("Add", [out, "kiln_secret"], [out + "_leak"]))
        model.graph.output[0].name = out + "_leak"
        (target / record["file"]).write_bytes(model.SerializeToString())
        break
    _reseal(target)

    # Every manifest field, every mutation; on the Inductor package its engine records (the rest of its
    # manifest has the same fields as the ONNX Runtime package's).
    for kind in ("onnxruntime", "inductor"):
        source = Path(config[kind])
        clean = json.loads((source / "manifest.json").read_text())
        for path in _paths(clean):
            if path == ("content_hash",) or (kind == "inductor" and path[0] != "engines"):
                continue  # recomputed after every edit
            # The compile report's fields are shown, never acted on: the mutations that could crash.
            for how in ("type", "drop") if path[0] == "report" and len(path) > 1 else MUTATIONS:
                data = copy.deepcopy(clean)
                if not _mutate(data, path, how):
                    continue
                target = new(f"{kind} manifest {'.'.join(map(str, path))}: {how}", str(source), kind)
                _reseal_data(target, data, checksums=path[0] != "files")

    # Every field of the Inductor engine header, every mutation.
    source = Path(config["inductor"])
    files = _engine_files(_inductor_engine(source).read_bytes())
    clean = json.loads(files["kiln_inductor_engine.json"])
    # Fields the source engine (a CPU standalone graph) does not carry, added so their mutations are
    # tried too: the libstdc++ an AOTInductor package was compiled against (compat.foreign_code).
    clean.setdefault("aot_libstdcxx", "6.0.30")
    for path in _paths(clean):
        for how in MUTATIONS:
            header = copy.deepcopy(clean)
            if not _mutate(header, path, how):
                continue
            target = new(f"inductor header {'.'.join(map(str, path))}: {how}", str(source), "inductor")
            engine = _inductor_engine(target)
            engine.write_bytes(_zip({**files, "kiln_inductor_engine.json": json.dumps(header).encode()}))
            _reseal(target)
    return cases


# ---------------------------------------------------------------- phase 2: loading under the hook


# The NVIDIA driver's libraries, which torch's CUDA build opens by bare name (the system's dynamic
# linker finds them, never in a package): NVML (torch.cuda.device_count, on every call while no GPU is
# up), the driver API and NVRTC (torch.cuda._utils).
TORCH_DRIVER_PROBES = re.compile(r"lib(nvidia-ml|cuda|nvrtc)\.so(\.\d+)*")


def _package_dir(name: str) -> str | None:
    """An installed package's directory, found without importing it."""
    spec = importlib.util.find_spec(name)
    locations = spec.submodule_search_locations if spec else None
    return os.path.realpath(locations[0]) if locations else None


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip("/") + "/")


class Watch:
    """The audit hook's rule: what an untrusted load may open, load and start."""

    PROCESS_EVENTS = ("subprocess.Popen", "os.system", "os.exec", "os.spawn", "os.posix_spawn", "os.fork")

    def __init__(self, roots: list[str], toolchain: set[str]):
        self.roots = [os.path.realpath(r) for r in roots]
        self.toolchain = toolchain
        self.package: str | None = None
        self.violations: list[str] = []
        self.processes: list[str] = []
        self.torch_dir = _package_dir("torch")
        self.ctypes_dir = _package_dir("ctypes")

    def allowed(self, path: Any, *, package: bool = True) -> bool:
        """Whether ``path`` lies in a trusted root (or the package, unless ``package`` is False)."""
        if isinstance(path, int):
            return True  # an already open descriptor
        if isinstance(path, bytes):
            path = path.decode(errors="replace")
        if not isinstance(path, str):
            return True
        real = os.path.realpath(path)
        if self.package and _inside(real, os.path.realpath(self.package)):
            return package
        return any(_inside(real, r) for r in self.roots)

    def library_allowed(self, name: Any) -> bool:
        """A library load: from a trusted root but never from the package (what it brings is not run),
        or by bare name one of the driver libraries torch's own code probes."""
        if isinstance(name, bytes):
            name = name.decode(errors="replace")
        if isinstance(name, str) and "/" not in name:
            return bool(TORCH_DRIVER_PROBES.fullmatch(name)) and self._called_by_torch()
        return self.allowed(name, package=False)

    def _called_by_torch(self) -> bool:
        """Whether the code that asked ctypes for the library is torch's own."""

        def in_ctypes(frame: Any) -> bool:
            return bool(self.ctypes_dir) and _inside(
                os.path.realpath(frame.f_code.co_filename), self.ctypes_dir
            )

        # Up the stack to ctypes' own frames (CDLL.__init__), then past them: the frame beyond asked.
        frame = sys._getframe(1)
        while frame is not None and not in_ctypes(frame):
            frame = frame.f_back
        while frame is not None and in_ctypes(frame):
            frame = frame.f_back
        if frame is None or not self.torch_dir:
            return False
        return _inside(os.path.realpath(frame.f_code.co_filename), self.torch_dir)

    def __call__(self, event: str, args: tuple) -> None:
        if self.package is None:
            return
        if event in ("open", "ctypes.dlopen") and args:
            allowed = self.allowed if event == "open" else self.library_allowed
            if not allowed(args[0]):
                self.violations.append(f"{event} {args[0]!r}")
        elif event in self.PROCESS_EVENTS:
            words = [str(a) for a in args if a is not None]
            text = " ".join(words)
            program = _program(event, args)
            self.processes.append(f"{event} {text[:300]}")
            if TOKEN in text or os.path.basename(program) not in self.toolchain:
                self.violations.append(f"{event} {text[:300]}")


def _program(event: str, args: tuple) -> str:
    if event == "os.system":
        return "/bin/sh"
    if event == "os.fork":
        return "fork"
    if event == "subprocess.Popen":
        executable, argv = args[0], args[1]
        if executable:
            return str(executable)
        if isinstance(argv, list | tuple) and argv:
            return str(argv[0])
        return str(argv).split()[0] if argv else ""
    return str(args[0]) if args else ""


def _toolchain() -> set[str]:
    """Executables an Inductor CPU compile starts on its own: the host C++ compiler, this interpreter."""
    import shutil as which

    from torch._inductor import config

    configured = config.cpp.cxx if isinstance(config.cpp.cxx, list | tuple) else (config.cpp.cxx,)
    cxx = next((found for c in configured if c and (found := which.which(c))), "g++")
    names = {os.path.basename(cxx), os.path.basename(os.path.realpath(cxx)), "g++", "c++", "gcc", "cc"}
    # openssl: Inductor hashes its precompiled header with ``openssl sha512``.
    names |= {"openssl"}
    return names | {os.path.basename(sys.executable), os.path.basename(os.path.realpath(sys.executable))}


def run(config: dict, results_path: Path) -> None:
    import safetensors.torch
    import torch

    import compiler
    from compiler.errors import KilnError

    torch.set_num_threads(1)
    inputs = safetensors.torch.load_file(config["input"])["x"]
    expected = {
        k: safetensors.torch.load_file(config[f"expected_{k}"])["y"] for k in ("onnxruntime", "inductor")
    }
    scratch = Path(tempfile.mkdtemp(prefix="kiln-probe-", dir=config["scratch"]))
    started = time.perf_counter()
    cases = stage(config, scratch)
    staged = time.perf_counter() - started

    import torch._inductor.runtime.cache_dir_utils as inductor_dirs

    roots = [
        tempfile.gettempdir(),  # the test gives this process its own TMPDIR (Inductor's scratch and cache)
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        config["root"],  # kiln's own code
        inductor_dirs.cache_dir(),  # Inductor's cache: its own compiled kernels
        str(compiler.EngineCache().directory),  # kiln's engine cache: this machine's compiles of programs
        os.path.join(tempfile.gettempdir(), "kiln-inductor-"),  # kiln's scratch for Inductor artifacts
        "/dev/null",
        "/dev/urandom",
        "/proc/self",
        "/sys/devices/system/cpu",  # CPU feature probes (Inductor's vector ISA, torch's thread count)
        "/sys/fs/cgroup",
        "/proc/cpuinfo",
    ]
    # What the first load of any package does once per process (imports, library probes) is not the
    # package's doing: a clean ONNX Runtime package is loaded before the hook. (Not an Inductor one: the
    # header attack must be the first Inductor compile of this process.)
    compiler.load(config["onnxruntime"], trust_engine_code=False)(inputs)
    # `import compiler` is lazy: import what it used to import eagerly (torch.compile's front end, whose
    # import probes /proc/stat), so only the packages' own doing is watched.
    import compiler.dynamo

    watch = Watch(roots, _toolchain())
    sys.addaudithook(watch)
    for case in cases:
        watch.package, watch.violations, watch.processes = case["package"], [], []
        result: dict[str, Any] = {}
        began = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                module = compiler.load(case["package"], trust_engine_code=False)
                with torch.no_grad():
                    output = module(inputs)
                output = output[0] if isinstance(output, tuple | list) else output
                same = isinstance(output, torch.Tensor) and torch.allclose(
                    output, expected[case["kind"]], rtol=1e-5, atol=1e-6
                )
                result["outcome"] = "same" if same else "different"
            except KilnError as exc:
                result.update(outcome="refused", error=type(exc).__name__, message=str(exc)[:300])
            except Exception as exc:  # an untyped failure: the test reports it
                result.update(outcome="crashed", error=type(exc).__name__, message=str(exc)[:300])
        watch.package = None
        result.update(
            name=case["name"],
            violations=list(watch.violations),
            processes=list(watch.processes),
            warnings=[str(w.message)[:300] for w in caught],
            seconds=round(time.perf_counter() - began, 4),
        )
        case.update(result)

    # The positive control: what the rule forbids, done on purpose, must be seen.
    watch.package, watch.violations, watch.processes = str(scratch), [], []
    os.system(f"true {TOKEN}")
    try:
        with open(os.path.join(os.getcwd(), "secrets.env"), "rb") as file:
            file.read()
    except OSError:
        pass
    import subprocess

    subprocess.run(["/bin/echo", TOKEN], capture_output=True, check=False)
    import ctypes

    with contextlib.suppress(OSError):  # a library the package brings: the event comes before the load
        ctypes.CDLL(os.path.join(str(scratch), f"lib{TOKEN}.so"))
    control = {"name": "positive control", "violations": list(watch.violations)}
    watch.package = None
    results_path.write_text(
        json.dumps(
            {"cases": cases, "control": control, "staged_s": staged, "total_s": time.perf_counter() - started}
        )
    )


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
