"""Generation through `kiln zoo`, as the README's example runs it (issue 44's done-when): the example
zoo file's two decoder families (GPT-2 and a Llama-style decoder, `deploy/zoo-generation.yaml`) compile
in one `kiln zoo` process, and a fresh process loads each package from disk and generates the eager
model's greedy tokens. Every in-process generation test passed while `kiln zoo` failed on every
text-generation entry (an UnboundLocalError in flows/compile_model.py): only this path catches that.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.fixtures import preloaded

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow  # the example generation zoo compiled in one `kiln zoo`

CHECKS = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    import torch
    import compiler
    from zoo import models

    out, results = Path(sys.argv[1]), {}
    torch.manual_seed(3)
    for name, factory in json.loads(sys.argv[2]):
        loaded = compiler.load(out / f"{name}.kiln")
        lm = getattr(models, factory)().model.eval()
        ids = torch.randint(3, lm.config.vocab_size, (2, 7))
        got = loaded.generate(ids, max_new_tokens=12, eos_token_id=[])
        want = lm.generate(ids, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0)
        results[name] = {
            "equal": bool(torch.equal(got, want[:, -got.shape[1]:])),
            "shape": list(got.shape),
        }
    print(json.dumps(results))
    """
)


def test_the_example_generation_zoo_compiles_and_its_packages_generate_eager_tokens(
    tmp_path: Path, prefect_server
) -> None:
    example = yaml.safe_load((ROOT / "deploy" / "zoo-generation.yaml").read_text())
    models = example["models"]
    assert len({entry["factory"] for entry in models}) >= 2  # two decoder families, as the README says
    for entry in models:  # the example's own entries, with fewer validation prompts (CI's 2 cores)
        entry["generation"].setdefault("validation", {})["samples"] = 2
    settings = {**example.get("settings", {}), "out_dir": "out", "workspace": "ws", "tracking": False}
    settings["validation"] = {"samples": 2, "warmup": 0, "runs": 2}
    (tmp_path / "zoo.yaml").write_text(yaml.safe_dump({"settings": settings, "models": models}))
    # The flow reports to the suite's Prefect server; both processes forked from tests/fixtures/preloaded.py.
    env = {**os.environ, "PYTHONPATH": str(ROOT), **prefect_server.env}
    done = preloaded.run(
        [sys.executable, "-m", "flows.cli", "zoo", "zoo.yaml", "--out", "out", "--json"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
    names = [(entry["name"], entry["factory"].split(":")[1]) for entry in models]
    for name, _ in names:
        assert (tmp_path / "out" / f"{name}.kiln" / "generation.json").is_file(), name
    checks = preloaded.run(
        [sys.executable, "-c", CHECKS, str(tmp_path / "out"), json.dumps(names)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert checks.returncode == 0, checks.stderr[-3000:]
    results = json.loads(checks.stdout.strip().splitlines()[-1])
    for name, _ in names:
        assert results[name]["equal"], (name, results[name])
        assert results[name]["shape"][0] == 2
