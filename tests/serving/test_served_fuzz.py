"""The format fuzzer's mutations (tests/compiler/package/
fuzz_probe.py) on Triton's own files (issue 42): a mutated
``kiln.json`` or ``kiln-serving.json`` is refused with a typed error naming the file, or accepted and
rendered into a ``config.pbtxt`` with exactly the lines kiln writes, with nothing opened, imported or
run while it is read and rendered. The unmutated files are the positive control."""

from __future__ import annotations

import copy
import json
import random
import re
import sys
from pathlib import Path

import pytest

from serving.triton.config import ServedModel, TensorSig, render_config
from serving.triton.errors import RepositoryError, TritonConfigError
from serving.triton.repository import SETTINGS_FILE, ServingSettings
from tests.compiler.package.fuzz_probe import _mutate_json

ROUNDS = 1500
# Every line kiln writes starts with one of these (the comment's two lines, the keys, the tensor rows).
LINE = re.compile(
    r"^(# Written by kiln .*|# champion; .*|name: \"[A-Za-z0-9_][A-Za-z0-9_.\-]*\"|backend: \"python\"|"
    r"max_batch_size: [0-9]+|version_policy: \{ specific: \{ versions: \[ [0-9]+ \] \} \}|input \[|output \[|"
    r"  \{ name: \"[A-Za-z0-9_][A-Za-z0-9_.\-]*\" data_type: TYPE_[A-Z0-9]+ dims: \[ [-0-9, ]* \] \},?|\]|"
    r"instance_group \[ \{ kind: KIND_(CPU|GPU) count: [0-9]+ \} \]|"
    r"parameters: \{ key: \"kiln_threads\" value: \{ string_value: \"[0-9]+\" \} \}|"
    r"dynamic_batching \{ (preferred_batch_size: \[ [0-9, ]+ \] )?max_queue_delay_microseconds: [0-9]+ \})$"
)


def _served() -> ServedModel:
    return ServedModel(
        "bert", "kiln.bert.cpu", "3", "ab" * 32, "cuda:sm_90",
        (TensorSig("input_ids", "int64", (-1, -1)), TensorSig("attention_mask", "int64", (-1, -1))),
        (TensorSig("last_hidden_state", "float32", (-1, -1, 64)),), 8, (1, 8), "cd" * 32,
    )  # fmt: skip


def _rendered_lines_are_kilns(text: str) -> None:
    bad = [line for line in text.splitlines() if not LINE.match(line)]
    assert not bad, bad
    assert text.count("\nbackend:") == 1 and "default_model_filename" not in text


@pytest.fixture
def audit() -> list[str]:
    """Every open, import, exec, compile and process start while the block runs (the fuzz's own
    reads of the files it writes happen outside)."""
    seen: list[str] = []
    active = [False]

    def hook(event: str, args: tuple) -> None:
        if active[0] and event in ("open", "import", "exec", "compile", "subprocess.Popen", "os.system"):
            seen.append(f"{event} {args[0]}")

    sys.addaudithook(hook)
    yield seen, active
    active[0] = False


def test_mutated_served_records_are_refused_by_name_or_render_only_kilns_lines(audit):
    seen, active = audit
    good = json.loads(_served().to_json())
    rng = random.Random(7)
    accepted = refused = 0
    # the positive control: the unmutated record reads back equal and renders kiln's lines
    assert ServedModel.from_json(json.dumps(good), "kiln.json") == _served()
    _rendered_lines_are_kilns(render_config(_served()))
    texts = []
    for _ in range(ROUNDS):
        data = copy.deepcopy(good)
        for _ in range(rng.randint(1, 3)):
            _mutate_json(data, rng)
        texts.append(json.dumps(data))
    active[0] = True
    for text in texts:
        try:
            served = ServedModel.from_json(text, "kiln.json")
        except TritonConfigError as exc:
            assert "kiln.json" in str(exc)
            refused += 1
            continue
        _rendered_lines_are_kilns(render_config(served))
        accepted += 1
    active[0] = False
    assert seen == []
    assert refused > ROUNDS // 2 and accepted > 0  # both sides were reached


def test_mutated_serving_settings_are_a_repository_error_or_valid(tmp_path: Path, audit):
    seen, active = audit
    good = json.loads(ServingSettings("kiln.bert.cpu", "bert", "cpu", 1000, 2, 0).to_json())
    rng = random.Random(11)
    accepted = refused = 0
    assert ServingSettings.read(_write(tmp_path, good)) == ServingSettings(
        "kiln.bert.cpu", "bert", "cpu", 1000, 2, 0
    )
    for index in range(400):
        data = copy.deepcopy(good)
        for _ in range(rng.randint(1, 2)):
            _mutate_json(data, rng)
        folder = _write(tmp_path / str(index), data)
        active[0] = True
        try:
            settings = ServingSettings.read(folder)
        except RepositoryError as exc:
            assert SETTINGS_FILE in str(exc)
            refused += 1
        else:
            text = render_config(
                _served(),
                queue_delay_us=settings.queue_delay_us,
                instances=settings.instances,
                threads=settings.threads,
            )
            _rendered_lines_are_kilns(text)
            accepted += 1
        finally:
            active[0] = False
    # its own file is the one thing opened (by path, then as the descriptor the reader holds)
    assert all(e.startswith("open ") and (SETTINGS_FILE in e or e[5:].isdigit()) for e in seen), seen[:5]
    assert refused > 100 and accepted > 0


def _write(folder: Path, data: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / SETTINGS_FILE).write_text(json.dumps(data))
    return folder
