"""Generation: a Llama-style decoder compiled into prefill and decode programs over one copy of the
weights, saved, loaded in a fresh process, and its greedy tokens held to transformers' eager generate;
every limit a typed error naming the zoo field."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

import compiler
from compiler.errors import GenerationError, PackageCorruptError
from compiler.generation.decoding import greedy_pick
from compiler.generation.module import GenerationModule
from compiler.generation.package import save_generation
from compiler.generation.step import check_causal_lm, generation_spec, program_case, write_slot
from compiler.generation.validate import check_agreement, random_prompts
from compiler.package.manifest import WEIGHTS
from zoo.models import tiny_gpt2_lm, tiny_llama_lm, tiny_qwen2_lm

ROOT = Path(__file__).resolve().parents[2]


def _compile(lm: torch.nn.Module, **limits: int) -> GenerationModule:
    spec = generation_spec(lm, **limits)
    programs = {}
    for program in ("prefill", "decode"):
        module, kwargs, shapes = program_case(lm, spec, program)
        exported = compiler.export(module, (), kwargs, dynamic_shapes=shapes)
        programs[program] = compiler.compile(exported, backend="onnxruntime", strip_weights=True)
    return GenerationModule(programs["prefill"], programs["decode"], spec)


@pytest.fixture(scope="module")
def llama() -> torch.nn.Module:
    return tiny_llama_lm(seed=3).model


@pytest.fixture(scope="module")
def package(llama: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> Path:
    module = _compile(llama, max_batch=4, max_cache_len=40, prompt_min=1, prompt_max=16)
    path = tmp_path_factory.mktemp("gen") / "llama.kiln"
    save_generation(module, path)
    return path


@pytest.fixture(scope="module")
def loaded(package: Path) -> GenerationModule:
    return compiler.load(package)


def _padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(3, 512, (3, 9), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4], mask[2, :8] = 0, 0  # left padding: 5 and 1 real tokens
    return ids.masked_fill(mask == 0, 0), mask


def test_fresh_process_generate_matches_eager_greedy(package: Path, llama: torch.nn.Module) -> None:
    ids, mask = _padded_batch()
    script = (
        "import json, sys, torch, compiler\n"
        "m = compiler.load(sys.argv[1])\n"
        "ids, mask = (torch.tensor(json.loads(a)) for a in sys.argv[2:4])\n"
        "out = m.generate(ids, mask, max_new_tokens=20, eos_token_id=[])\n"
        "print(json.dumps({'type': type(m).__name__, 'tokens': out.tolist(),\n"
        "  'shared': m.prefill.weights['lm.lm_head.weight'].data_ptr()\n"
        "            == m.decode.weights['lm.lm_head.weight'].data_ptr()}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", script, str(package), json.dumps(ids.tolist()), json.dumps(mask.tolist())],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    got = json.loads(result.stdout.strip().splitlines()[-1])
    with torch.no_grad():
        want = llama.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert got["type"] == "GenerationModule"
    assert got["tokens"] == want.tolist()
    assert got["shared"]  # the decode program runs on the prefill's weight tensors


def test_one_weights_file_and_decode_bound_to_it(package: Path) -> None:
    outer = compiler.read_manifest(package)
    inner = json.loads((package / "decode" / "manifest.json").read_text())
    assert [p for p in package.rglob("*.safetensors")] == [package / WEIGHTS]
    assert inner["files"][WEIGHTS]["sha256"] == outer.files[WEIGHTS].sha256
    assert "decode/manifest.json" in outer.files and "generation.json" in outer.files
    # Both programs load from their runtime graphs (the decode program's KV-cache update, index_copy,
    # once kept it from its own: every load deserialized it).
    assert "runtime_graph.json" in outer.files and "decode/runtime_graph.json" in outer.files
    spec = json.loads((package / "generation.json").read_text())
    assert spec["decode_content_hash"] == inner["content_hash"]
    assert (spec["max_batch"], spec["max_cache_len"], spec["kv_heads"]) == (4, 40, 2)


def test_the_package_holds_each_layers_q_k_v_as_one_weight_and_the_model_is_untouched(
    package: Path, llama: torch.nn.Module
) -> None:
    from safetensors import safe_open

    with safe_open(package / WEIGHTS, "pt") as weights:
        names = list(weights.keys())
        layer = "self_attn.qkv_proj.weight"
        fused = sorted(n for n in names if n.endswith(layer))
        assert len(fused) == llama.config.num_hidden_layers, names
        attention = llama.model.layers[0].self_attn
        want = torch.cat([attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight])
        torch.testing.assert_close(weights.get_tensor(fused[0]), want, rtol=0, atol=0)
    assert not [n for n in names if any(f".{p}." in n for p in ("q_proj", "k_proj", "v_proj"))]
    assert type(attention.q_proj) is torch.nn.Linear  # validation's eager model keeps its own layers


def test_changed_decode_program_is_refused(package: Path, tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "copy.kiln"
    shutil.copytree(package, copy)
    program = copy / "decode" / "program.pt2"
    data = bytearray(program.read_bytes())
    data[-100] ^= 1
    program.write_bytes(bytes(data))
    with pytest.raises(PackageCorruptError, match=r"decode: file program\.pt2 does not match its checksum"):
        compiler.load(copy)


def test_validation_agrees_and_reports(loaded: GenerationModule, llama: torch.nn.Module) -> None:
    report = check_agreement(
        llama,
        loaded,
        random_prompts(loaded.spec, 4, low=3),
        max_new_tokens=8,
        perplexity_rel_tol=1e-4,
        exact_tokens=True,
    )
    assert report["passed"], report["failures"]
    assert report["token_agreement"] == 1.0 and report["first_divergence"] is None
    assert report["perplexity_rel_error"] <= 1e-4
    assert len(report["step_logits_error"]) == 8


class _WholeCaches(torch.nn.Module):
    """A decode program as kiln wrote it before decode steps returned their slot alone: the updated
    caches, whole (packages already in registries hold such programs)."""

    def __init__(self, decode: Any):
        super().__init__()
        self.decode = decode

    def forward(self, *, keys: list, values: list, cache_position: torch.Tensor, **kwargs: Any) -> tuple:
        logits, new = self.decode(keys=keys, values=values, cache_position=cache_position, **kwargs)
        return (logits, *write_slot(keys, values, new, cache_position))


def test_static_cache_steps_match_the_functional_loop_and_write_in_place(loaded: GenerationModule) -> None:
    """Decode on the preallocated cache (the step's slot written in place, what CUDA graphs capture)
    gives the tokens and logits of the functional loop (a new cache each step), padded into a batch
    bucket too, and so does an earlier kiln's decode program that returns whole caches; the buffers
    are never replaced and end up holding every position's keys."""
    ids, mask = _padded_batch()
    runs = {}
    program = loaded.decode
    cases = (("functional", False, False, 0), ("slot", True, False, 0), ("bucket", True, True, 0))
    old = (
        ("old-slot", True, False, 0),
        ("old-whole", True, False, 1 << 40),
        ("old-functional", False, False, 0),
    )
    for name, static, pad, full_copy in (*cases, *old):
        loaded.decode = _WholeCaches(program) if name.startswith("old") else program
        loaded.static_cache = static
        if static:
            # on CUDA: padded with graphs; an old program's whole cache copied back where it is small
            loaded.static_decode().pad_to_buckets = pad
            loaded.static_decode().full_copy_max_bytes = full_copy
        tokens = loaded.generate(ids, mask, max_new_tokens=6, eos_token_id=[], output_logits=True)
        runs[name] = tokens, [t.clone() for t in loaded.last_logits]
    loaded.decode = program
    loaded.static_cache, loaded.static_decode().pad_to_buckets = True, False
    for name in ("slot", "bucket", "old-slot", "old-whole", "old-functional"):
        assert torch.equal(runs[name][0], runs["functional"][0]), name
        for got, want in zip(runs[name][1], runs["functional"][1], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    static = loaded.static_decode()
    assert static.bucket_rows(3) == 3 and not static.graphed and static.reason == "the model runs on cpu"
    keys = static._keys[0]
    pointer = keys.data_ptr()
    tokens = loaded.generate(ids, mask, max_new_tokens=6, eos_token_id=[])
    assert static._keys[0].data_ptr() == pointer  # the same buffer, written in place
    # the greedy tokens after the first were picked inside the steps (no launch between steps)
    assert torch.equal(static._history[:3, 10:15], tokens[:, 10:15])
    # a prefill of the whole sequence computes the keys the steps wrote (positions 0..13; 14 is unread)
    full_mask = torch.cat([mask, torch.ones(3, 5, dtype=mask.dtype)], dim=1)
    _, want, _ = loaded.prefill(input_ids=tokens[:, :14], attention_mask=full_mask)
    torch.testing.assert_close(keys[:3, :, :14], want[0][:, :, :14], rtol=1e-4, atol=1e-4)
    assert not keys[:3, :, 14:].any()


def test_sampling_is_seeded_and_in_vocabulary(loaded: GenerationModule) -> None:
    ids = torch.tensor([[5, 6, 7, 8]])
    kwargs = {"max_new_tokens": 12, "do_sample": True, "top_k": 50, "top_p": 0.9, "temperature": 0.8}
    first = loaded.generate(ids, seed=7, eos_token_id=[], **kwargs)
    again = loaded.generate(ids, seed=7, eos_token_id=[], **kwargs)
    other = loaded.generate(ids, seed=8, eos_token_id=[], **kwargs)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    assert first.shape == (1, 16) and int(first.max()) < 512


def test_eos_ends_rows_and_pads_them(loaded: GenerationModule) -> None:
    ids, mask = _padded_batch()
    free = loaded.generate(ids, mask, max_new_tokens=10, eos_token_id=[])
    stop = int(free[0, 10])  # row 0's second new token: make it the end of sequence
    out = loaded.generate(ids, mask, max_new_tokens=10, eos_token_id=stop)
    row = out[0, 9:].tolist()
    assert row[: row.index(stop) + 1] == free[0, 9 : 9 + row.index(stop) + 1].tolist()
    assert all(t == 0 for t in row[row.index(stop) + 1 :])


def test_on_token_sees_each_step_as_generate_returns_it(loaded: GenerationModule) -> None:
    """What streaming sends: each step's tokens, in order, the last call flagged, whether the run ends
    at max_new_tokens or when every row has met eos (then the ended rows' pad tokens are included)."""
    ids, mask = _padded_batch()
    free = loaded.generate(ids, mask, max_new_tokens=7, eos_token_id=[])
    stop = int(free[1, 10])  # row 1's second new token: with it as eos, the rows end at other steps
    for eos, new in (([], 7), (stop, 40 - 9), (free[:, 9].tolist(), 7)):
        calls: list[tuple[list[int], bool]] = []
        record = calls.append
        out = loaded.generate(
            ids,
            mask,
            max_new_tokens=new,
            eos_token_id=eos,
            on_token=lambda t, last, record=record: record((t.tolist(), last)),
        )
        assert [c[1] for c in calls] == [False] * (len(calls) - 1) + [True]
        assert torch.tensor([c[0] for c in calls]).T.tolist() == out[:, 9:].tolist()
    assert len(calls) == 1  # every row's first token is an eos: one call, the last


@pytest.mark.parametrize(
    ("shape", "new", "field"),
    [
        ((5, 4), 4, "generation.max_batch"),
        ((1, 17), 4, "generation.prompt_length.max"),
        ((1, 16), 30, "generation.max_cache_len"),
    ],
)
def test_limits_are_typed_errors_naming_the_field(
    loaded: GenerationModule, shape: tuple[int, int], new: int, field: str
) -> None:
    with pytest.raises(GenerationError, match=field.replace(".", r"\.")):
        loaded.generate(torch.ones(shape, dtype=torch.long), max_new_tokens=new)


def test_model_without_lm_head_is_refused() -> None:
    from transformers import GPT2Model

    body = GPT2Model(tiny_gpt2_lm().model.config)
    with pytest.raises(GenerationError, match="no causal LM head"):
        check_causal_lm(body)


def test_padding_without_a_pad_token_names_the_field(llama: torch.nn.Module) -> None:
    lm = tiny_llama_lm(pad=False).model
    spec = generation_spec(lm, max_batch=2, max_cache_len=24, prompt_min=1, prompt_max=8)
    assert spec.pad_token_id is None
    eager = GenerationModule(*(program_case(lm, spec, p)[0] for p in ("prefill", "decode")), spec)
    ids, mask = torch.ones(2, 4, dtype=torch.long), torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    with pytest.raises(GenerationError, match=r"generation\.pad_token_id"):
        eager.generate(ids, mask, max_new_tokens=2, eos_token_id=[])
    assert eager.generate(ids, mask, max_new_tokens=2, eos_token_id=[], pad_token_id=0).shape == (2, 6)


def test_a_third_family_qwen2_generates_eager_greedy_tokens(tmp_path: Path) -> None:
    """Qwen2 (biases on the attention projections) compiled, saved, loaded: the same greedy tokens as
    transformers' eager generate on a left-padded batch."""
    lm = tiny_qwen2_lm(seed=4).model
    path = tmp_path / "qwen2.kiln"
    save_generation(_compile(lm, max_batch=3, max_cache_len=32, prompt_min=1, prompt_max=12), path)
    loaded = compiler.load(path)
    assert loaded.spec.model_type == "qwen2"
    ids, mask = _padded_batch()
    got = loaded.generate(ids, mask, max_new_tokens=12, eos_token_id=[])
    with torch.no_grad():
        want = lm.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    assert got.tolist() == want.tolist()


class _CrossAttention(torch.nn.Module):
    """q from the decoder's states, k and v from another input; one projection of another dtype."""

    def __init__(self, odd_dtype: bool = False) -> None:
        super().__init__()
        self.q_proj, self.k_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)
        self.v_proj = torch.nn.Linear(8, 4).to(torch.float64 if odd_dtype else torch.float32)

    def forward(self, x: torch.Tensor, memory: torch.Tensor) -> torch.Tensor:
        k, v = self.k_proj(memory), self.v_proj(memory.to(self.v_proj.weight.dtype)).float()
        return self.q_proj(x).sum(-1, keepdim=True) * k + v


def test_fused_projections_answer_as_the_three_did_for_any_inputs_and_leave_the_model_alone() -> None:
    from compiler.generation.fuse import FusedProjections, fused_projections

    torch.manual_seed(0)
    model = _CrossAttention()
    x, memory = torch.randn(2, 3, 8), torch.randn(2, 3, 8)
    fused = fused_projections(model)
    assert fused is not model and fused_projections(model) is fused  # one copy per model
    assert isinstance(fused.qkv_proj, FusedProjections) and type(model.q_proj) is torch.nn.Linear
    assert sorted(n for n, _ in fused.named_parameters()) == ["qkv_proj.bias", "qkv_proj.weight"]
    for _ in range(2):  # q on one input, k and v on another; then q on k's input changed in place
        # one GEMM of 16 columns, not three: equal up to fp32 rounding (MKL blocks them differently)
        torch.testing.assert_close(fused(x, memory), model(x, memory), rtol=1e-5, atol=1e-6)
        x, memory = memory.add_(1.0), torch.randn(2, 3, 8)  # the same tensor, changed in place
    odd = _CrossAttention(odd_dtype=True)
    assert fused_projections(odd) is odd  # not one dtype: left as it is


def test_a_padded_position_of_the_prefill_attends_to_itself(llama: torch.nn.Module) -> None:
    """Padding is read by no real token, but the prefill still computes its rows and writes its cache:
    each attends to itself, so the row is the one-token prompt of that token (position 0), defined in
    every precision and kernel (a softmax over nothing gave fp16 on CUDA 0.41 relative L2 on a GPT-2's
    cache, failing validation), and real rows are unchanged."""
    from compiler.generation.step import Prefill

    prefill = Prefill(llama, 16).eval()
    ids, mask = _padded_batch()
    with torch.no_grad():
        logits, keys, _ = prefill(ids, mask)
        alone, alone_keys, _ = prefill(ids[2:, :1], torch.ones(1, 1, dtype=torch.long))
        real, _, _ = prefill(ids[1:2, 4:], mask[1:2, 4:])
    torch.testing.assert_close(logits[2, 0], alone[0, 0], rtol=1e-4, atol=1e-5)  # padded, position 0
    torch.testing.assert_close(keys[0][2, :, 0], alone_keys[0][0, :, 0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(logits[1, 4:], real[0], rtol=1e-4, atol=1e-5)  # real rows as unpadded


@pytest.mark.parametrize(("rows", "vocab"), [(1, 128256), (3, 50257), (2, 1000), (4, 2048)])
def test_greedy_pick_is_argmax_and_takes_the_first_of_equal_maxima(rows: int, vocab: int) -> None:
    """The in-step pick (two passes over chunks of the vocabulary) is ``argmax``, ties included."""
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(vocab)).half()
    assert torch.equal(greedy_pick(logits)[:, 0], logits.argmax(-1))
    logits[:, vocab // 3] = logits[:, -7] = 100.0  # two equal maxima, in different chunks
    assert greedy_pick(logits)[:, 0].tolist() == [vocab // 3] * rows
    flat = torch.zeros(rows, vocab)
    assert greedy_pick(flat)[:, 0].tolist() == [0] * rows
