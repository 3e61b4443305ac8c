"""A Hugging Face model on the user's path: `kiln zoo` on a zoo file naming an `hf:` folder, then the
package loaded in a fresh process (issue 32).

The model is a tiny sentence-pair BERT classifier (random weights, written with save_pretrained): its
answer depends on token_type_ids (segment B = 1), as NLI, QA and cross-encoder rerankers do. The run
itself is an fp32 ONNX Runtime compile, the plainest one there is: it must stay quiet (no third-party
warnings, torchao never imported: only the Inductor int8/fp8 recipes need it).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

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

# What a third-party library prints when it warns: Python warnings, logging's WARNING, glog (torch's
# C++ side: "W1125 12:00:00.000 ..."), and torchao's native-extension messages.
THIRD_PARTY_WARNING = re.compile(r"warn|deprecat|^[WE]\d{4} \d\d:\d\d|torchao|failed to load", re.I | re.M)


def _sentence_pair_bert(folder: Path) -> Path:
    """A tiny BERT classifier whose segment embeddings matter (scaled up from their random init)."""
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
    )
    model = t.BertForSequenceClassification(config).eval()
    with torch.no_grad():
        model.bert.embeddings.token_type_embeddings.weight.mul_(20)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def zoo_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("hf-user-path")
    _sentence_pair_bert(root / "pair-bert")
    settings = {
        "out_dir": "out",
        "workspace": "ws",
        "engine_cache": False,
        "tracking": False,
        "validation": {"samples": 2, "warmup": 0, "runs": 2},
    }
    entry = {"name": "pair", "source": "hf:./pair-bert", "task": "sequence-classification"}
    (root / "zoo.yaml").write_text(yaml.safe_dump({"settings": settings, "models": [entry]}))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [sys.executable, "-c", RUN], cwd=root, env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["exit"] == 0, (done.stdout[-3000:], done.stderr[-3000:])
    return {"root": root, "result": result, "stderr": done.stderr}


def test_an_fp32_onnxruntime_run_imports_no_torchao_and_prints_no_third_party_warning(zoo_run) -> None:
    assert zoo_run["result"]["torchao"] is False
    warnings = [line for line in zoo_run["stderr"].splitlines() if THIRD_PARTY_WARNING.search(line)]
    assert not warnings, warnings
