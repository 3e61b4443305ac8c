"""A Hugging Face model on the user's path: `kiln zoo` on a zoo file naming an `hf:` folder, then the
package loaded in a fresh process (issue 32).

The model is a tiny sentence-pair BERT classifier (random weights, written with save_pretrained): its
answer depends on token_type_ids (segment B = 1), as NLI, QA and cross-encoder rerankers do, and its
validation data is recorded as a BERT tokenizer writes it. The run itself is an fp32 ONNX Runtime
compile, the plainest there is: it must stay quiet (no third-party warnings, and torchao, which only
the Inductor int8 recipe needs, never imported).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.fixtures import preloaded

ROOT = Path(__file__).resolve().parents[1]

RUN = textwrap.dedent(
    """
    import json, sys
    from flows.cli import main

    sys.argv = ["kiln", "zoo", "zoo.yaml", "--out", "out", "--json"]
    try:
        main()
        code = 0
    except SystemExit as exc:
        code = exc.code
    print(json.dumps({"exit": code, "torchao": "torchao" in sys.modules}))
    """
)

# A fresh process loads the package (no argument: hf: outputs are transformers' own dataclasses) and
# answers the inputs the test wrote; the eager answers are the test's own.
CALL = textwrap.dedent(
    """
    import json, sys
    import numpy as np, torch
    import compiler

    loaded = compiler.load(sys.argv[1])
    answers = {}
    with np.load(sys.argv[2]) as inputs, torch.no_grad():
        for case in ("pair", "one_segment"):
            feed = {k.split("/")[1]: torch.from_numpy(inputs[k]) for k in inputs.files if k.startswith(case)}
            out = loaded(**feed)
            answers[case] = (out.logits if hasattr(out, "logits") else out[0]).tolist()
    print(json.dumps(answers))
    """
)

# What a third-party library prints when it warns: Python warnings, logging's WARNING, glog (torch's
# C++ side: "W1125 12:00:00.000 ..."), and torchao's native-extension messages.
THIRD_PARTY_WARNING = re.compile(r"warn|deprecat|^[WE]\d{4} \d\d:\d\d|torchao|failed to load", re.I | re.M)


def _sentence_pair_bert(folder: Path) -> torch.nn.Module:
    """A tiny BERT classifier whose segments matter (weights drawn wider than BERT's 0.02, so that its
    answers are not all near zero), saved to ``folder``."""
    from compiler.quantization.torchao_guard import keep_torchao_out_of_transformers

    keep_torchao_out_of_transformers()  # this process too: seconds saved
    import transformers as t

    torch.manual_seed(0)
    config = t.BertConfig(
        vocab_size=100,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
        type_vocab_size=2,
        num_labels=3,
        initializer_range=0.2,
    )
    model = t.BertForSequenceClassification(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hf-user-path")
    model = _sentence_pair_bert(root / "pair-bert")
    # Recorded as a BERT tokenizer writes a sentence pair: input_ids, attention_mask, token_type_ids.
    torch.manual_seed(0)
    ids = torch.randint(0, 100, (3, 2, 12))
    types = (torch.arange(12) >= 5).long().expand(3, 2, 12)
    recorded = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": types}
    np.savez(root / "recorded.npz", **{k: v.numpy() for k, v in recorded.items()})
    settings = {
        "out_dir": "out",
        "workspace": "ws",
        "engine_cache": False,
        "tracking": False,
        "validation": {"samples": 2, "warmup": 0, "runs": 2},
    }
    entry = {
        "name": "pair",
        "source": "hf:./pair-bert",
        "task": "sequence-classification",
        "validation": {"data": "recorded.npz"},
    }
    (root / "zoo.yaml").write_text(yaml.safe_dump({"settings": settings, "models": [entry]}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", RUN], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["exit"] == 0, (done.stdout[-3000:], done.stderr[-3000:])

    # Another sentence pair (segment B from token 4 on), and the same tokens as one segment.
    ids = torch.randint(0, 100, (3, 10))
    pair = (torch.arange(10) >= 4).long().expand(3, 10).contiguous()
    feeds = {
        case: {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": types}
        for case, types in (("pair", pair), ("one_segment", torch.zeros_like(pair)))
    }
    flat = {f"{case}/{k}": v.numpy() for case, feed in feeds.items() for k, v in feed.items()}
    np.savez(root / "calls.npz", **flat)
    package = root / "out" / "pair.kiln"
    call = preloaded.run(  # RUN's process above asserts what it imports: not forked
        [sys.executable, "-c", CALL, str(package), str(root / "calls.npz")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert call.returncode == 0, call.stderr[-3000:]
    answers = {k: torch.tensor(v) for k, v in json.loads(call.stdout.strip().splitlines()[-1]).items()}
    with torch.no_grad():
        eager = {case: model(**feed).logits for case, feed in feeds.items()}
    return {"root": root, "result": result, "stderr": done.stderr, "answers": answers, "eager": eager}


def _rel_l2(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_a_sentence_pair_model_answers_as_in_pytorch_with_its_segments(zoo_run) -> None:
    answers, eager = zoo_run["answers"], zoo_run["eager"]
    assert _rel_l2(answers["pair"], eager["pair"]) < 1e-5
    assert _rel_l2(answers["one_segment"], eager["one_segment"]) < 1e-5
    # The segments change the answer: the compiled model really reads token_type_ids.
    assert _rel_l2(answers["one_segment"], eager["pair"]) > 0.1


def test_the_package_and_its_registry_signature_name_the_tokenizer_inputs(zoo_run) -> None:
    from compiler.package.check import read_manifest
    from registry.payload import signature_for

    manifest = read_manifest(zoo_run["root"] / "out" / "pair.kiln")
    specs = {s.name: s for s in manifest.input_specs}
    assert list(specs) == ["input_ids", "attention_mask", "token_type_ids"]
    types = specs["token_type_ids"]
    assert (types.value_range, types.dynamic_dims) == ((0, 1), {0: "batch", 1: "seq"})
    assert types.max_shape == specs["input_ids"].max_shape == (8, 64)
    assert [spec.name for spec in signature_for(manifest.input_specs).inputs.inputs] == list(specs)
    # Validated on the recorded data, token_type_ids included.
    validated_on = manifest.validation.data_source
    assert validated_on.startswith(f"{zoo_run['root'] / 'recorded.npz'} sha256:"), validated_on


def test_an_fp32_onnxruntime_run_imports_no_torchao_and_prints_no_third_party_warning(zoo_run) -> None:
    assert zoo_run["result"]["torchao"] is False
    warnings = [line for line in zoo_run["stderr"].splitlines() if THIRD_PARTY_WARNING.search(line)]
    assert not warnings, warnings
