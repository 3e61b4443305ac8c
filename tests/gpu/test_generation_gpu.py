"""Generation on the GPU through the CLI (issue 44): ``kiln zoo`` compiles a Llama-style and a GPT-2
decoder for ``task: text-generation`` on CUDA in fp16 with Inductor (the default package: AOTInductor
engines), validates them against eager ``generate`` and writes their packages; a fresh process loads
each and generates. The decode programs call ``kiln::decode_attention`` (its split-KV Triton kernels),
so the packages name its module and load it by the policy's own rule. Skips elsewhere with the reason.

On the H100 (torch 2.11, transformers 5.17, 2026-11-27, session 16): passes (both packages fp16,
max relative L2 6.7e-4 / 1.2e-3, greedy gap 0 in a fresh process). It first found five bugs: fp16
repair cast a size (new_zeros) and missed positional casts, repair's kept-share count ran host
activations against CUDA weights, a padded prefill row was a softmax over nothing (0.41 relative L2 on
GPT-2's cache in fp16 on CUDA), perplexity's tolerance was fp32's for every precision, and the zoo
traced the decode attention without kiln's op (an fp32 trace).

    python3 -m pytest -q tests/gpu/test_generation_gpu.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]

ZOO = """
settings:
  out_dir: out
  workspace: .kiln/workspace
models:
  - name: llama-gen
    factory: zoo.models:tiny_llama_lm
    task: text-generation
    generation: {max_batch: 4, max_cache_len: 96, prompt_length: {min: 1, max: 32}}
    backend: inductor
    devices: [cuda]
    precision: fp16
  - name: gpt2-gen
    factory: zoo.models:tiny_gpt2_lm
    task: text-generation
    generation: {max_batch: 4, max_cache_len: 64, prompt_length: {min: 1, max: 32}}
    backend: inductor
    devices: [cuda]
    precision: fp16
"""


def test_zoo_compiles_decoders_on_cuda_and_a_fresh_process_generates_eager_greedy_tokens(tmp_path):
    (tmp_path / "gen.yaml").write_text(ZOO)
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_API_URL", "MLFLOW_TRACKING_URI")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env.update({"COLUMNS": "200", "HF_HUB_OFFLINE": "1"})
    command = [sys.executable, "-m", "flows.cli", "zoo", "gen.yaml", "--out", "out"]
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
    print(done.stdout[-3000:])  # the zoo's table: rel L2, latency ratio, seconds
    packages = sorted((tmp_path / "out").glob("*-gen*.kiln"))
    assert len(packages) == 2, sorted(p.name for p in (tmp_path / "out").iterdir())
    for package in packages:  # each decode program's manifest names the op's module
        manifests = [json.loads(p.read_text()) for p in package.rglob("manifest.json")]
        assert any("compiler.generation.attention" in m.get("op_modules", []) for m in manifests), package
        # Both programs load from their runtime graphs: the decode graph holds kiln::decode_attention
        # and the KV cache's index_copy (without either, every load deserialized the program).
        files = json.loads((package / "manifest.json").read_text())["files"]
        assert {"runtime_graph.json", "decode/runtime_graph.json"} <= set(files), sorted(files)

    code = textwrap.dedent(
        f"""
        import sys, torch, compiler, zoo.models
        factories = {{"llama": zoo.models.tiny_llama_lm, "gpt2": zoo.models.tiny_gpt2_lm}}
        for path in {[str(p) for p in packages]!r}:
            module = compiler.load(path, trust_engine_code=True)  # packages this test wrote
            assert "compiler.generation.attention" in sys.modules
            ids = torch.randint(3, 90, (2, 7), generator=torch.Generator().manual_seed(0)).cuda()
            out = module.generate(ids, max_new_tokens=12)
            new = out[:, ids.shape[1]:]
            assert new.shape == (2, 12), new.shape
            # Greedy agreement with eager, allowing fp16 near-ties: each chosen token's eager logit
            # (teacher-forced over the same sequence) is within 2e-2 of that step's best.
            family = "llama" if "llama" in path else "gpt2"
            eager = factories[family]().model.cuda().half().eval()
            with torch.no_grad():
                logits = eager(out).logits[:, ids.shape[1] - 1 : -1].float()
            chosen = logits.gather(-1, new[..., None])[..., 0]
            gap = (logits.max(-1).values - chosen).max().item()
            assert gap <= 2e-2, (path, gap)
            print(path, "gap", gap)
        """
    )
    ran = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr[-4000:]
    print(ran.stdout)


def test_the_speed_measure_records_peak_gpu_memory() -> None:
    """Item 4: the speed a zoo compile measures for a generation version holds the peak GPU memory of
    each side it measured (at least the weights and the static cache), the figure registry/generation.py
    logs as the run's ``peak_gpu_memory_bytes``."""
    from compiler.generation.module import GenerationModule
    from compiler.generation.step import Decode, Prefill, generation_spec
    from compiler.generation.validate import measure_speed
    from zoo.models import tiny_llama_lm

    lm = tiny_llama_lm(seed=0, hidden=64).model.eval().cuda()
    spec = generation_spec(lm, max_batch=2, max_cache_len=32, prompt_min=1, prompt_max=8)
    module = GenerationModule(Prefill(lm, spec.max_cache_len), Decode(lm, spec.max_cache_len), spec)
    speed = measure_speed(module, runs=1, new_tokens=4)
    weights = sum(p.numel() * p.element_size() for p in lm.parameters())
    assert speed["compiled_peak_gpu_memory_bytes"] >= weights + spec.cache_bytes(2), speed
    assert "eager_peak_gpu_memory_bytes" not in speed  # no eager side measured
