"""Fuzz a package's formats as an attacker who can rewrite it (and recompute every hash) would.

Run by tests/compiler/package/test_fuzz_formats.py (bounded, in CI) and benchmarks/fuzz_formats.py (longer) as
``python fuzz_probe.py CONFIG RESULTS``. CONFIG names a clean package, its input and output, a
seed and a time budget. Each round copies the package, applies one to three structured mutations to
``runtime_graph.json`` (nodes, call targets, keyword names, constants, the call signature), its two
pytree specs (types, enum and defaultdict contexts), ``manifest.json`` (any field) or the weights file's
safetensors header (any field, hostile shapes and offsets, nesting past the bound), recomputes the
checksums and the content hash (untrusted_probe.py's reseal), loads it untrusted and calls it,
under the audit hook of untrusted_probe.py (no process, no open or library load outside the
package and Python's own directories) plus: no import of a module this process had not imported, no
code compiled that carries the attack token, nothing unpickled. Each round's outcome: ``same`` (the
original answers), ``different`` (a resealed package computes something else: what signing is for),
``refused`` (a KilnError), ``failed at call`` (loaded, then torch refused to compute the resealed
graph), or a failure: ``crashed`` (a load failing with any other exception), ``hung`` (over the
round's alarm), or audit violations.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.compiler.package.untrusted_probe import HOSTILE, TOKEN, Watch, _reseal_data

# What a mutation may put in place of a value: payloads, wrong types, sizes, names fx would paste.
PALETTE: list[Any] = [
    HOSTILE,
    f"x=__import__('os').system('touch {TOKEN}')",
    "lambda",
    "self",
    "torch",
    "__class__",
    "",
    None,
    True,
    -1,
    0,
    2**31,
    10**30,
    1.5,
    float("1e308"),
    [],
    {},
    [1, 2, 3],
    {"node": 10**6},
    {"node": -1},
    {"float": "nan"},
    {"float": HOSTILE},
    {"dtype": "float64"},
    {"dtype": HOSTILE},
    {"device": "meta"},
    {"device": HOSTILE},
    {"layout": "sparse_coo"},
    {"list": [{"node": 0}] * 3},
    {"tuple": []},
    {"eval": "1"},
]
TARGETS = [
    "aten::from_file.default",
    "aten::fill_.Scalar",
    "aten::add.out",
    "aten::as_strided.default",
    "aten::_unsafe_index.Tensor",
    "aten::empty.memory_format",
    "aten::set_.source_Storage",
    "aten::_assert_scalar.default",
    "profiler::_record_function_enter.default",
    "image::read_file.default",
    "builtins::eval.default",
    "operator.attrgetter",
    "operator.getitem",
    "aten::mul.Tensor",
    "aten::add.Tensor",
    "aten::relu.default",
    "aten::clone.default",
    "kiln_zoo::soft_sign_clip.default",
]
SPEC_TYPES = [
    "collections.defaultdict",
    "builtins.dict",
    "builtins.list",
    "builtins.tuple",
    "collections.OrderedDict",
    "collections.namedtuple",
    "torch.Size",
    "os.environ",
    None,
    HOSTILE,
]
SPEC_CONTEXTS = [
    {"default_factory_module": "os", "default_factory_name": "abort", "dict_context": []},
    {"default_factory_module": "this", "default_factory_name": "x", "dict_context": []},
    {"default_factory_module": "builtins", "default_factory_name": "eval", "dict_context": []},
    json.dumps([{"__enum__": True, "fqn": "os:environ", "name": "HOME"}]),
    json.dumps([{"__enum__": True, "fqn": "subprocess:Popen", "name": "x"}]),
    json.dumps([{"__enum__": True, "fqn": "this:x", "name": "y"}]),
    json.dumps(["x", "y"]),
    "null",
    HOSTILE,
]


def _slots(value: Any, path: tuple = ()) -> list[tuple]:
    """Every path to a value in a JSON document."""
    found = [path] if path else []
    if isinstance(value, dict):
        for key, item in value.items():
            found += _slots(item, (*path, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found += _slots(item, (*path, i))
    return found


def _parent(data: Any, path: tuple) -> Any:
    for key in path[:-1]:
        data = data[key]
    return data


def _mutate_json(data: Any, rng: random.Random) -> str:
    """One structural mutation of a JSON document, in place; returns what it did."""
    slots = _slots(data)
    if not slots:
        return "none"
    path = rng.choice(slots)
    parent, key = _parent(data, path), path[-1]
    how = rng.choice(["replace", "replace", "drop", "duplicate", "key"])
    if how == "drop":
        del parent[key]
    elif how == "duplicate" and isinstance(parent, list):
        parent.insert(key, copy.deepcopy(parent[key]))
    elif how == "key" and isinstance(parent, dict):
        parent[rng.choice([HOSTILE, "lambda", "device", "out", "self"])] = parent.pop(key)
    else:
        how = "replace"
        parent[key] = copy.deepcopy(rng.choice(PALETTE))
    return f"{how} {'/'.join(map(str, path))[:120]}"


def _mutate_graph(graph: Any, rng: random.Random) -> str:
    try:  # earlier mutations may have broken the structure this one aims at
        return _mutate_structure(graph, rng)
    except (TypeError, KeyError, AttributeError, IndexError, ValueError):
        return "json " + _mutate_json(graph, rng)


def _mutate_structure(graph: dict, rng: random.Random) -> str:
    graphs = [graph["graph"], *graph["graph"].get("submodules", {}).values()]
    nodes = [n for g in graphs if isinstance(g, dict) for n in g.get("nodes", []) if isinstance(n, dict)]
    calls = [n for n in nodes if n.get("op") == "call_function"]
    how = rng.choice(["target", "kwarg", "spec", "spec", "json", "json"])
    if how == "target" and calls:
        node = rng.choice(calls)
        node["target"] = rng.choice(TARGETS)
        return f"target {node['target']}"
    if how == "kwarg" and calls:
        node = rng.choice(calls)
        key = rng.choice(
            [f"*[__import__('os').system('touch {TOKEN}')][:0]) if 1 else dict(zz", "out", HOSTILE]
        )
        node.setdefault("kwargs", {})[key] = copy.deepcopy(rng.choice(PALETTE))
        return "kwarg name"
    if how == "spec":
        which = rng.choice(["in_spec", "out_spec"])
        try:
            protocol, schema = json.loads(graph[which])
        except (TypeError, ValueError):
            return "spec unreadable"
        nodes = [s for s in _spec_nodes(schema)]
        target = rng.choice(nodes)
        if rng.random() < 0.5:
            target["type"] = rng.choice(SPEC_TYPES)
        else:
            target["context"] = copy.deepcopy(rng.choice(SPEC_CONTEXTS))
        graph[which] = json.dumps([protocol, schema])
        return f"{which} {target.get('type')}"
    return "json " + _mutate_json(graph, rng)


# What a weights-header mutation may put in place of a value (besides PALETTE): the sizes and shapes
# the header's bounds stand against.
HEADER_PALETTE: list[Any] = [[0, 2**63], [2**62, 4], [2**64], [-1], [0, 0], "F64", "X9", [10**9, 10**9 + 4]]


def _mutate_weights(raw: bytes, rng: random.Random) -> tuple[bytes, str]:
    """One mutation of a safetensors file's header (the data left as is): a field replaced, dropped or
    renamed, a hostile shape or offsets, or the header nested past the reader's depth bound."""
    length = int.from_bytes(raw[:8], "little")
    try:
        header = json.loads(raw[8 : 8 + length])
    except (ValueError, RecursionError):  # an earlier mutation of this round nested it past reading
        return raw, "unreadable"
    how = rng.choice(["json", "json", "bound", "deep"])
    if how == "deep":
        text = ("[" * 5000 + "]" * 5000).encode()
    else:
        if how == "bound":
            items = header.items() if isinstance(header, dict) else ()
            entries = [v for k, v in items if k != "__metadata__" and isinstance(v, dict)]
            field = rng.choice(["shape", "data_offsets", "dtype"])
            if entries:
                rng.choice(entries)[field] = copy.deepcopy(rng.choice(HEADER_PALETTE))
            how = f"bound {field}"
        else:
            how = "json " + _mutate_json(header, rng)
        text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + raw[8 + length :], how


def _spec_nodes(schema: Any) -> list[dict]:
    if not isinstance(schema, dict):
        return []
    found = [schema]
    for child in schema.get("children_spec", []) or []:
        found += _spec_nodes(child)
    return found


class Hang(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise Hang()


def run(config: dict, results_path: Path) -> None:
    import safetensors.torch
    import torch

    import compiler
    from compiler.errors import KilnError

    torch.set_num_threads(1)
    package = Path(config["package"])
    inputs = safetensors.torch.load_file(config["input"])["x"]
    expected = safetensors.torch.load_file(config["expected"])["y"]
    rng = random.Random(config["seed"])
    scratch = Path(tempfile.mkdtemp(prefix="kiln-fuzz-", dir=config["scratch"]))
    allowed = config.get("allowed_modules", [])
    # The first load of a process imports and probes what every load needs: not the package's doing.
    # Both forms: from the runtime graph, and from the program (a package without a runtime graph).
    compiler.load(package, allowed_modules=allowed, trust_engine_code=False)(inputs)
    programmed = scratch / "program-form.kiln"
    shutil.copytree(package, programmed)
    (programmed / "runtime_graph.json").unlink()
    manifest = json.loads((programmed / "manifest.json").read_text())
    del manifest["files"]["runtime_graph.json"]
    _reseal_data(programmed, manifest)
    compiler.load(programmed, allowed_modules=allowed, trust_engine_code=False)(inputs)
    roots = [tempfile.gettempdir(), sys.prefix, sys.base_prefix, sys.exec_prefix, config["root"]]
    roots += ["/dev/null", "/dev/urandom", "/proc/self", "/sys/devices/system/cpu", "/sys/fs/cgroup"]
    watch = Watch(roots, set())
    imported = set(sys.modules)
    extra: list[str] = []

    def more(event: str, args: tuple) -> None:
        if watch.package is None:
            return
        # torch imports its own submodules lazily (an op's error path, say): not a package's choice.
        if event == "import" and args and args[0] not in imported and not args[0].startswith("torch."):
            extra.append(f"import {args[0]}")
        elif event == "compile" and args and TOKEN in str(args[0]):
            extra.append(f"compile {str(args[0])[:200]}")
        elif event == "pickle.find_class":
            extra.append(f"{event} {args!r:.200}")

    sys.addaudithook(watch)
    sys.addaudithook(more)
    signal.signal(signal.SIGALRM, _alarm)
    rounds: list[dict] = []
    deadline = time.monotonic() + config["seconds"]
    base_graph = json.loads((package / "runtime_graph.json").read_text())
    base_manifest = json.loads((package / "manifest.json").read_text())
    while time.monotonic() < deadline and len(rounds) < config.get("max_rounds", 10**6):
        case = scratch / f"r{len(rounds)}.kiln"
        shutil.copytree(package, case)
        graph, manifest = copy.deepcopy(base_graph), copy.deepcopy(base_manifest)
        did = []
        for _ in range(rng.randint(1, 3)):
            draw = rng.random()
            if draw < 0.6:
                did.append("graph: " + _mutate_graph(graph, rng))
            elif draw < 0.8:
                did.append("manifest: " + _mutate_json(manifest, rng))
            else:
                weights, how = _mutate_weights((case / "weights.safetensors").read_bytes(), rng)
                (case / "weights.safetensors").write_bytes(weights)
                did.append("weights header: " + how)
        (case / "runtime_graph.json").write_text(json.dumps(graph))
        _reseal_data(case, manifest)
        result: dict[str, Any] = {"mutations": did}
        watch.package, watch.violations, watch.processes = str(case), [], []
        extra.clear()
        signal.alarm(config.get("round_seconds", 30))
        module = None
        try:
            module = compiler.load(case, allowed_modules=allowed, trust_engine_code=False)
            with torch.no_grad():
                output = module(inputs)
            output = output[0] if isinstance(output, tuple | list) else output
            same = isinstance(output, torch.Tensor) and output.shape == expected.shape
            result["outcome"] = "same" if same and torch.equal(output, expected) else "different"
        except Hang:
            result["outcome"] = "hung"
        except KilnError as exc:
            result.update(outcome="refused", error=type(exc).__name__)
        except Exception as exc:
            import traceback

            # Loaded, then failed computing: a resealed graph that computes wrongly (what signing is
            # for), as long as it touched nothing. A load that fails untyped is a crash.
            outcome = "failed at call" if module is not None else "crashed"
            where = traceback.format_exc()[-1200:]
            result.update(outcome=outcome, error=f"{type(exc).__name__}: {str(exc)[:300]}", where=where)
        finally:
            signal.alarm(0)
            watch.package = None
        result["violations"] = [*watch.violations, *extra]
        rounds.append(result)
        shutil.rmtree(case, ignore_errors=True)
    # The positive control: what the rule forbids, done on purpose, is seen.
    watch.package, watch.violations = str(scratch), []
    extra.clear()
    try:
        with open(os.path.join(config["root"], "..", "kiln-fuzz-secret"), "rb"):
            pass
    except OSError:
        pass
    import importlib

    importlib.import_module("tabnanny")  # a module this process had not imported

    control = [*watch.violations, *extra]
    watch.package = None
    results_path.write_text(json.dumps({"rounds": rounds, "control": control}))


if __name__ == "__main__":
    run(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
