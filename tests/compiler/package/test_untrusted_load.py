"""An untrusted package runs nothing it brought and reads nothing outside itself (issue 23, items 1-3 and
the field-by-field tamper pass).

One fresh process (untrusted_probe.py) loads, untrusted and under an audit hook, every tampered
variant of two tiny packages (ONNX Runtime and Inductor on the CPU): the issue's attacks first, then
every manifest field and every Inductor header field changed in turn (type, hostile string, dropped,
huge), with checksums and content hash recomputed as an attacker would. The tests below read its report.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import zipfile
from collections import defaultdict
from pathlib import Path

import onnx
import pytest
import safetensors.torch
import torch
from onnx import helper, numpy_helper

import compiler
from compiler.backends.inductor.options import untrusted_options
from compiler.backends.onnx_inline import check_self_contained
from compiler.errors import (
    OpModuleNotAllowedError,
    PackageCorruptError,
    UnsafeEngineError,
    UnsafeProgramError,
)
from compiler.package.digest import content_hash
from zoo.errors import UntrustedCodeError
from zoo.sources.pt2 import Pt2Source

ROOT = Path(__file__).resolve().parents[3]
SECRET = b"API_KEY=kilnpwn!"  # 16 bytes: the 4 float32 outputs an external initializer would add


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()


@pytest.fixture(scope="module")
def packages(tmp_path_factory) -> dict:
    """Two unsigned packages of one tiny MLP (ONNX Runtime, Inductor), its input and their outputs."""
    root = tmp_path_factory.mktemp("untrusted")
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1))
    program = compiler.export(_model(), (x,))
    config = {
        "root": str(ROOT),
        "scratch": str(root),
        "secret_bytes": len(SECRET),
        "marker": str(root / "ran"),
    }
    safetensors.torch.save_file({"x": x}, root / "x.safetensors")
    config["input"] = str(root / "x.safetensors")
    old = os.environ.pop("KILN_SIGNING_KEY", None)
    try:
        for backend in ("onnxruntime", "inductor"):
            module = compiler.compile(program, backend=backend, cache=False)
            config[backend] = str(compiler.save(module, root / f"{backend}.kiln").path)
            safetensors.torch.save_file({"y": module(x)}, root / f"{backend}.out.safetensors")
            config[f"expected_{backend}"] = str(root / f"{backend}.out.safetensors")
    finally:
        if old is not None:
            os.environ["KILN_SIGNING_KEY"] = old
    return {"root": root, "config": config, "program": program, "x": x}


@pytest.fixture(scope="module")
def probe(packages) -> dict:
    """The probe's report: {"cases": [...], "control": {...}} (see untrusted_probe.py)."""
    root, config = packages["root"], packages["config"]
    cwd = root / "cwd"  # the loading process's working directory, with a secret beside it
    cwd.mkdir()
    (cwd / "secrets.env").write_bytes(SECRET)
    (root / "secrets.env").write_bytes(SECRET)
    (root / "config.json").write_text(json.dumps(config))
    env = {k: v for k, v in os.environ.items() if k not in ("KILN_SIGNING_KEY", "KILN_ALLOWED_OP_MODULES")}
    env["PYTHONPATH"] = str(ROOT)
    (root / "tmp").mkdir()
    env["TMPDIR"] = str(root / "tmp")  # the probe's own: what Inductor writes there is allowed, cwd is not
    # Inductor's kernel cache is this process's (the machine's own, trusted): the probe's recompile of the
    # clean program finds it; a compile with other settings (the attack's, before the fix) would not.
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    env["TORCHINDUCTOR_CACHE_DIR"] = cache_dir()
    done = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).with_name("untrusted_probe.py")),
            str(root / "config.json"),
            "results.json",
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((cwd / "results.json").read_text())
    report["by_name"] = {case["name"]: case for case in report["cases"]}
    report["ran"] = sorted(str(p) for p in root.rglob("*kilnpwn*")) + sorted(
        str(p) for p in root.glob("ran*")
    )
    return report


# ---------------------------------------------------------------- the audit hook is a real check


def test_the_audit_hook_sees_a_process_and_a_file_outside_the_package(probe):
    """Positive control: os.system, subprocess and reading the secret beside the package are caught."""
    seen = " | ".join(probe["control"]["violations"])
    assert "os.system" in seen and "subprocess.Popen" in seen and "secrets.env" in seen, seen
    assert "ctypes.dlopen" in seen and "libkilnpwn.so" in seen, seen


def test_the_hook_tells_torch_probing_the_driver_from_a_library_a_package_brings(tmp_path):
    """The CUDA build of torch asks NVML for the device count (ctypes, 'libnvidia-ml.so.1') on every
    device query of a machine without a GPU: torch's own doing, as is its driver API probe. A library
    inside the package, any other bare name, a driver library at a path elsewhere, or the driver's name
    asked for by code that is not torch's, are violations."""
    package = tmp_path / "pkg.kiln"
    package.mkdir()
    code = """
import contextlib, ctypes, json, sys
import torch
import torch.cuda._utils
from tests.compiler.package.untrusted_probe import Watch

loaded = []
sys.addaudithook(lambda event, args: event == "ctypes.dlopen" and loaded.append(args[0]))
watch = Watch([sys.prefix, sys.base_prefix], set())
sys.addaudithook(watch)

def attempt(call, *args):
    loaded.clear()
    watch.package, watch.violations = sys.argv[1], []
    with contextlib.suppress(Exception):
        call(*args)
    watch.package = None
    return {"loaded": list(loaded), "violations": list(watch.violations)}

print(json.dumps({
    "torch: NVML": attempt(torch.cuda._raw_device_count_nvml),
    "torch: driver": attempt(torch.cuda._utils._get_cuda_library),
    "in the package": attempt(ctypes.CDLL, sys.argv[1] + "/libengine.so"),
    "another bare name": attempt(ctypes.CDLL, "libkilnpwn.so"),
    "the driver's name, not by torch": attempt(ctypes.CDLL, "libnvidia-ml.so.1"),
    "the driver's name elsewhere": attempt(ctypes.CDLL, sys.argv[2] + "/libnvidia-ml.so.1"),
}))
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", code, str(package), str(tmp_path / "elsewhere")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout)
    assert seen["torch: NVML"] == {"loaded": ["libnvidia-ml.so.1"], "violations": []}, seen
    assert seen["torch: driver"] == {"loaded": ["libcuda.so.1"], "violations": []}, seen
    for name in ("in the package", "another bare name", "the driver's name, not by torch"):
        assert len(seen[name]["loaded"]) == 1, (name, seen[name])
        assert seen[name]["violations"] == [f"ctypes.dlopen {seen[name]['loaded'][0]!r}"], (name, seen[name])
    assert seen["the driver's name elsewhere"]["violations"], seen


# ---------------------------------------------------------------- defect 23.1


def test_inductor_header_options_never_reach_the_compiler(probe):
    """The header's cpp.march put a -wrapper (running a shell) on g++'s command line on an untrusted
    load; now the engine is compiled with kiln's own settings, says which it left out, answers the same."""
    case = probe["by_name"]["inductor header: cpp.march wrapper"]
    assert case["outcome"] == "same", case
    assert not case["violations"], case["violations"]
    assert any("cpp.march" in p for p in case["processes"]) is False, case["processes"]
    assert any("cpp.march" in w and "not used" in w for w in case["warnings"]), case["warnings"]
    assert not probe["ran"], f"the payload ran: {probe['ran']}"


def test_untrusted_options_keep_only_checked_tuning_switches():
    options = {
        "mode": "max-autotune-no-cudagraphs",
        "compile_options": {
            "max_autotune": True,
            "max_fusion_size": 32,
            "cpp.march": "native -wrapper x",
            "cpp.cxx": ["/bin/sh"],
            "epilogue_fusion": "yes",  # a safe switch with the wrong type
            "cpp.threads": 10**30,
            "debug_dir": "/tmp/x",
        },
    }
    kept, dropped = untrusted_options(options)
    assert kept == {
        "mode": "max-autotune-no-cudagraphs",
        "compile_options": {"max_autotune": True, "max_fusion_size": 32},
    }
    assert sorted(d.split("=")[0] for d in dropped) == sorted(
        ["'cpp.march'", "'cpp.cxx'", "'epilogue_fusion'", "'cpp.threads'", "'debug_dir'"]
    )
    assert untrusted_options({"mode": "reduce-overhead", "compile_options": "x"})[0] == {
        "mode": "default",
        "compile_options": {},
    }


def test_an_inductor_header_weight_dtype_that_is_a_list_is_a_typed_refusal():
    """The probe's mutations never turn a string into a list; a dtype ["float32"] raised TypeError
    (unhashable) from the dtype lookup instead of the header's typed refusal."""
    from compiler.backends.inductor.options import check_header

    header = {
        "torch": torch.__version__, "library": "inductor", "device": "cpu", "compiler": "g++",
        "precision": "fp32", "stripped": False, "options": {}, "constants": [],
        "weights": {"w0": [[16, 8], "float32"]},
    }  # fmt: skip
    check_header(header)
    header["weights"]["w0"][1] = ["float32"]
    with pytest.raises(UnsafeEngineError, match="'weights'"):
        check_header(header)


# ---------------------------------------------------------------- defect 23.2


def _factory_program(program_pt2: bytes, module: str, escaped: bool) -> bytes:
    """The program with its input spec wrapped in a defaultdict whose factory lives in ``module``: what
    torch's pytree decoder imports at load. ``escaped``: the key written with a JSON escape."""
    from torch.utils._pytree import treespec_dumps, treespec_loads

    source = zipfile.ZipFile(__import__("io").BytesIO(program_pt2))
    root = source.namelist()[0].split("/")[0]
    model = json.loads(source.read(f"{root}/models/model.json"))

    def factory() -> None: ...

    factory.__module__, factory.__qualname__ = module, "factory"
    signature = model["graph_module"]["module_call_graph"][0]["signature"]
    inner = treespec_loads(signature["in_spec"])
    spec = torch.utils._pytree.TreeSpec(defaultdict, [factory, ["a"]], [inner])
    text = treespec_dumps(spec)
    if escaped:
        text = text.replace('"default_factory_module"', '"\\u0064efault_factory_module"')
    signature["in_spec"] = text
    out = __import__("io").BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name in source.namelist():
            data = json.dumps(model).encode() if name.endswith("models/model.json") else source.read(name)
            archive.writestr(name, data)
    return out.getvalue()


@pytest.mark.parametrize("escaped", [True, False], ids=["json-escaped", "plain"])
def test_module_names_in_the_program_are_checked_as_torch_decodes_them(
    packages, tmp_path, monkeypatch, escaped
):
    """A defaultdict factory module written as \\u0064efault_factory_module got past a check on the raw
    text, and torch imported it at compiler.load and at a pt2: source's load (kiln zoo --check)."""
    site, marker = tmp_path / "site", tmp_path / "imported"
    site.mkdir()
    name = f"kiln_factory_probe_{'esc' if escaped else 'plain'}"
    (site / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\nfactory = list\n")
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("KILN_ALLOWED_OP_MODULES", raising=False)
    monkeypatch.delenv("KILN_SIGNING_KEY", raising=False)
    package = Path(packages["config"]["onnxruntime"])
    evil = _factory_program((package / "program.pt2").read_bytes(), name, escaped)
    (tmp_path / "p.pt2").write_bytes(evil)
    # Refused before any module rule: a defaultdict factory is a builtin container or number, never a
    # name looked up in a module (it runs whenever a missing key is read).
    with pytest.raises(UnsafeProgramError, match=f"defaultdict factory {name}"):
        compiler.load_program(tmp_path / "p.pt2")
    with pytest.raises((UntrustedCodeError, UnsafeProgramError), match=name):
        Pt2Source(str(tmp_path / "p.pt2")).load()
    copy = Path(__import__("shutil").copytree(package, tmp_path / "p.kiln"))
    (copy / "program.pt2").write_bytes(evil)
    data = json.loads((copy / "manifest.json").read_text())
    data["files"]["program.pt2"].update(
        sha256=__import__("hashlib").sha256(evil).hexdigest(), bytes=len(evil)
    )
    data["content_hash"] = content_hash(data)
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(UnsafeProgramError, match=name):
        compiler.load(copy)
    assert not marker.exists() and name not in sys.modules


def test_a_graph_call_that_imports_by_name_follows_the_module_rule(packages, monkeypatch):
    """torch's verifier lets a graph call _call_custom_autograd_function_in_pre_dispatch("module.Class"),
    which imports that module when the graph runs (and when Inductor traces it): refused at load."""
    import io

    from torch.export.custom_ops import _call_custom_autograd_function_in_pre_dispatch as by_name

    from compiler.program.export import load_program_bytes

    monkeypatch.delenv("KILN_ALLOWED_OP_MODULES", raising=False)
    program = compiler.export(torch.nn.Sequential(torch.nn.Linear(4, 4)), (torch.randn(2, 4),))
    graph = program.graph_module.graph
    x = next(n for n in graph.nodes if n.op == "placeholder" and n.name == "input")
    with graph.inserting_before(next(n for n in graph.nodes if n.op == "output")):
        call = graph.call_function(by_name, ("kiln_no_such_probe.Fn", x))
    call.meta["val"] = x.meta["val"]
    program.graph_module.recompile()
    buffer = io.BytesIO()
    torch.export.save(program, buffer)
    with pytest.raises(OpModuleNotAllowedError, match="kiln_no_such_probe"):
        load_program_bytes(buffer.getvalue(), "p.pt2")


def _rewrite_model_json(program_pt2: bytes, edit) -> bytes:
    import io

    source = zipfile.ZipFile(io.BytesIO(program_pt2))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for name in source.namelist():
            data = source.read(name)
            if name.endswith("models/model.json"):
                model = json.loads(data)
                edit(model)
                data = json.dumps(model).encode()
            archive.writestr(name, data)
    return out.getvalue()


def _rename_values(model: dict, payload: str) -> None:
    """Every graph value named like the program's user input gets the payload as its name."""
    first = model["graph_module"]["graph"]["inputs"][-1]["as_tensor"]["name"]  # the user input, last

    def walk(value):
        if isinstance(value, dict):
            if first in value:  # a table keyed by value name (the graph's tensor_values)
                value[payload] = value.pop(first)
            for key, item in value.items():
                if key == "name" and item == first and "arg" not in value:  # not an op's argument name
                    value[key] = payload
                else:
                    walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(model)


def _set_expressions(model: dict, payload: str) -> None:
    def walk(value):
        if isinstance(value, dict):
            for key in value:
                if key == "expr_str":
                    value[key] = payload
                else:
                    walk(value[key])
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(model)


@pytest.mark.parametrize("where", ["value name", "symbolic expression", "guard"])
def test_program_text_torch_would_run_as_code_is_refused(tmp_path, monkeypatch, where):
    """torch.export.load writes value names into the code FX generates and runs (a name
    ``x=__import__('os').system(...)`` ran at load), evaluates expressions with sympy.sympify, and
    ExportedProgram.module() runs guards: each is refused before torch reads the archive."""
    import io

    marker = tmp_path / "ran"
    payload = f"__import__('os').system('touch {marker}')"
    batch = torch.export.Dim("batch", min=1, max=8)
    program = compiler.export(_model(), (torch.randn(2, 8),), dynamic_shapes={"input": {0: batch}})
    edit = {
        "value name": lambda m: _rename_values(m, f"x={payload}"),
        "symbolic expression": lambda m: _set_expressions(m, payload),
        "guard": lambda m: m.update(guards_code=[f"{payload} == 0"]),
    }[where]
    plain = io.BytesIO()
    torch.export.save(program, plain)  # with its sample inputs (weights-only tensors): guards then run
    evil = _rewrite_model_json(plain.getvalue(), edit)
    (tmp_path / "p.pt2").write_bytes(evil)
    with pytest.raises(UnsafeProgramError, match=r"value is named|symbolic expression|guard"):
        compiler.load_program(tmp_path / "p.pt2")
    with pytest.raises(UntrustedCodeError):
        Pt2Source(str(tmp_path / "p.pt2")).load()
    assert not marker.exists()
    # The same archive with torch's own reader: the attack is real (so the refusal above is not vacuous).
    with contextlib.suppress(Exception):  # torch may fail after running the payload
        torch.export.load(io.BytesIO(evil)).module()(torch.randn(2, 8))
    assert marker.exists()


def test_unreadable_or_too_deep_program_text_is_refused():
    from compiler.program.text import check_program_text as named_modules

    assert named_modules(json.dumps({"a": json.dumps({"__enum__": 1, "fqn": "m.x:E"})}).encode(), "p") == [
        "m.x"
    ]
    with pytest.raises(UnsafeProgramError, match="defaultdict factory 3"):
        named_modules(json.dumps({"default_factory_module": 3}).encode(), "p")
    with pytest.raises(UnsafeProgramError, match="not a module"):
        named_modules(json.dumps({"__enum__": True, "fqn": 3}).encode(), "p")
    deep = "1"
    for _ in range(20):
        deep = json.dumps([deep])
    with pytest.raises(UnsafeProgramError, match="nests JSON"):
        named_modules(deep.encode(), "p")
    with pytest.raises(UnsafeProgramError, match="not JSON"):
        named_modules(b"\xff{", "p")


# ---------------------------------------------------------------- defect 23.3


def test_onnx_external_data_is_refused_and_the_secret_never_read(probe):
    case = probe["by_name"]["onnx engine: external data initializer"]
    assert case["outcome"] == "refused" and case["error"] == "UnsafeEngineError", case
    assert "secrets.env" in case["message"], case


def _external(name: str, location: str = "secrets.env") -> onnx.TensorProto:
    tensor = numpy_helper.from_array(__import__("numpy").zeros(4, dtype="float32"), name)
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    entry = tensor.external_data.add()
    entry.key, entry.value = "location", location
    return tensor


def _model_with(nodes=(), initializers=(), functions=(), metadata=None) -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])
    graph = helper.make_graph(
        list(nodes) or [helper.make_node("Identity", ["x"], ["y"])],
        "g",
        [x],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])],
        initializer=list(initializers),
    )
    model = helper.make_model(graph, functions=list(functions))
    for key, value in (metadata or {}).items():
        helper.set_model_props(model, {key: value})
    return model


def _if_with_external() -> onnx.NodeProto:
    branch = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["o"])],
        "b",
        [],
        [helper.make_tensor_value_info("o", onnx.TensorProto.FLOAT, [4])],
        initializer=[_external("c", "/etc/passwd")],
    )
    return helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch)


@pytest.mark.parametrize(
    "model",
    [
        _model_with(initializers=[_external("c")]),
        _model_with(nodes=[helper.make_node("Constant", [], ["y"], value=_external("v", "../x"))]),
        _model_with(nodes=[_if_with_external()]),
        _model_with(
            functions=[
                helper.make_function(
                    "d",
                    "f",
                    ["a"],
                    ["b"],
                    [helper.make_node("Constant", [], ["b"], value=_external("v"))],
                    [helper.make_opsetid("", 17)],
                )
            ]
        ),
        _model_with(
            nodes=[
                helper.make_node(
                    "EPContext",
                    ["x"],
                    ["y"],
                    domain="com.microsoft",
                    ep_cache_context="/etc/passwd",
                    embed_mode=0,
                )
            ]
        ),
        _model_with(metadata={"ort_config": '{"session_options": {}}'}),
    ],
    ids=["initializer", "constant-attribute", "subgraph", "function", "epcontext", "session-config"],
)
def test_every_place_an_onnx_model_can_name_a_file_is_refused(model):
    with pytest.raises(UnsafeEngineError) as refused:
        check_self_contained(model)
    assert isinstance(refused.value, PackageCorruptError)
    check_self_contained(_model_with())  # the same model without it is fine


# ---------------------------------------------------------------- every field, tampered


def test_every_tampered_field_is_refused_or_answers_as_the_original(probe):
    cases = [
        c for c in probe["cases"] if " manifest " in c["name"] or c["name"].startswith("inductor header ")
    ]
    kinds = {c["name"].split()[0] for c in cases}
    assert kinds == {"onnxruntime", "inductor"} and len(cases) > 200, len(cases)
    added = [c for c in cases if c["name"].startswith("inductor header aot_libstdcxx:")]
    assert len(added) == 4, [c["name"] for c in added]  # the field a CPU engine lacks, tampered too
    wrong = [c for c in cases if c["outcome"] not in ("refused", "same")]
    assert not wrong, json.dumps(wrong[:10], indent=1)
    assert {c["outcome"] for c in cases} == {"refused", "same"}  # both happen: the check is not vacuous


def test_no_tampered_load_reads_outside_its_package_or_starts_a_process(probe):
    broken = [(c["name"], c["violations"]) for c in probe["cases"] if c["violations"]]
    assert not broken, json.dumps(broken[:10], indent=1)
    onnx_processes = [c for c in probe["cases"] if c["name"].startswith("onnx") and c["processes"]]
    assert not onnx_processes, onnx_processes[:3]
    assert not probe["ran"], probe["ran"]


def test_a_tensorrt_plan_that_expands_without_bound_is_refused():
    """An xz bomb in a TensorRT engine's plan is refused before it is expanded (no GPU needed)."""
    import lzma

    from compiler.backends.tensorrt.engine_format import decode_engine, encode_engine
    from compiler.errors import EngineCompatibilityError

    empty = lzma.compress(b"", format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64)
    prefix = encode_engine({"format": 1}, b"", compress=True)
    assert prefix.endswith(empty)
    engine = prefix[: -len(empty)] + lzma.compress(bytes(65 << 20), format=lzma.FORMAT_XZ, preset=0)
    with pytest.raises(EngineCompatibilityError, match="expands beyond"):
        decode_engine(engine)
    small = encode_engine({"format": 1}, b"plan" * 1000, compress=True)
    assert bytes(decode_engine(small)[1]) == b"plan" * 1000
    with pytest.raises(EngineCompatibilityError, match=r"truncated|corrupt"):
        decode_engine(small[:-20])
