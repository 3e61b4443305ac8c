"""The report page of any package (``kiln report``); a generation package's shows both programs, and how
to call it.

A generation package is its prefill program's package with ``generation.json`` and the decode
program's package under ``decode/`` (:mod:`compiler.generation.package`). Its page says first how to
call it (``generate``, from Python, the MLflow model and Triton, with the compiled limits filled in),
then the generation spec and report (cache layout, token agreement and perplexity against eager, time
to first token and decode tokens/s), then each program's own sections as any package's page has them
(map, partitions, dedup, repair, specs and profiles, validation, stage times), then the lineage.

As for every page, everything is read as data (no torch, nothing loaded): ``generation.json`` and the
decode manifest are checked against the outer manifest's checksums (so against its content hash and
signature), the decode manifest against its own content hash and the one ``generation.json`` names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from compiler import json_reader
from compiler.errors import PackageCorruptError, PackageJsonError
from compiler.generation.spec import DECODE_DIR, GENERATION_FILE, GenerationSpec
from compiler.package.check import manifest_and_signature, read_verified
from compiler.package.manifest import GENERATION, MANIFEST_FILE, SIGNATURE, Manifest
from compiler.package.report_html import Markup, h, join
from compiler.package.report_map import read_split_graph
from compiler.package.report_page import _facts as facts
from compiler.package.report_page import _num as num
from compiler.package.report_page import _table as table
from compiler.package.report_page import program_sections, render_report


def render_package_report(path: str | Path, manifest: Manifest, title: str) -> str:
    """The page of the package at ``path`` (its ``manifest`` already read and verified): for a
    generation package, how to call it, the generation spec and report and both programs; for any
    other, :func:`compiler.package.report_page.render_package_report`'s."""
    path = Path(path)
    split = read_split_graph(path, manifest)
    body = generation_body(path, manifest, title, split) if GENERATION in manifest.files else None
    return render_report(manifest, title, split, signed=(path / SIGNATURE).is_file(), body=body)


def read_generation(path: Path, manifest: Manifest) -> tuple[GenerationSpec, Manifest]:
    """The spec and the decode program's manifest of a verified generation package (see the module
    docstring for the checks); PackageCorruptError naming what does not hold."""
    where = f"{path}/{GENERATION_FILE}"
    raw = read_verified(path, GENERATION_FILE, manifest)
    try:
        spec = GenerationSpec.from_json(json_reader.loads(raw, where, error=PackageJsonError))
    except PackageCorruptError:
        raise
    except (ValueError, KeyError, TypeError) as exc:
        raise PackageCorruptError(f"{where} is not a generation spec: {exc}") from exc
    read_verified(path, f"{DECODE_DIR}/{MANIFEST_FILE}", manifest)  # the bytes the outer hash covers
    decode, _ = manifest_and_signature(path / DECODE_DIR, verify=True, signature=False)
    if decode.content_hash != spec.decode_content_hash:
        raise PackageCorruptError(f"{path / DECODE_DIR}: not the decode package {GENERATION_FILE} names")
    return spec, decode


def generation_body(path: Path, manifest: Manifest, title: str, split: Any) -> list[Markup]:
    """The sections between the overview and the lineage of a generation package's page."""
    spec, decode = read_generation(path, manifest)
    prefill = join(program_sections(manifest, split), "\n")
    decoded = join(program_sections(decode, read_split_graph(path / DECODE_DIR, decode)), "\n")
    return [
        _call_section(spec, title),
        _spec_section(spec),
        _report_section(spec),
        h(
            '<section id="prefill-program"><h2>Prefill program</h2><p>The prompt: <code>input_ids</code> and '
            "<code>attention_mask</code> [batch, prompt] → logits at every prompt position and the filled "
            "key/value cache (one key and one value tensor per layer).</p>{body}</section>",
            body=prefill,
        ),
        h(
            '<section id="decode-program"><h2>Decode program</h2><p>One token per row against the cache: '
            "<code>input_ids</code> [batch, 1], <code>attention_mask</code> [batch, cache], "
            "<code>cache_position</code> and the cache → that token's logits and the updated cache. It "
            "runs on the prefill program's weights (one <code>weights.safetensors</code>); content hash "
            "{hash}.</p>{body}</section>",
            hash=decode.content_hash[:16],
            body=_prefixed(decoded, "decode-"),
        ),
    ]


def _prefixed(markup: Markup, prefix: str) -> Markup:
    """The decode program's tables and map with ids of their own (the prefill's have the same names),
    and the map's references to them. Every value on the page is escaped, so ' id="' and 'url(#' only
    ever come from markup kiln wrote."""
    return Markup(str(markup).replace(' id="', f' id="{prefix}').replace("url(#", f"url(#{prefix}"))


def _call_section(spec: GenerationSpec, title: str) -> Markup:
    most = spec.max_cache_len - spec.prompt_min
    eos = list(spec.eos_token_id) or "none"
    python = (
        f"module = compiler.load({title!r})\n"
        f"module.generate(input_ids,            # int64 [batch 1..{spec.max_batch}, prompt "
        f"{spec.prompt_min}..{spec.prompt_max}], left-padded\n"
        "                attention_mask=None,  # 1 for a token, 0 for left padding\n"
        f"                max_new_tokens=16,    # prompt + new <= {spec.max_cache_len} (at most {most})\n"
        "                do_sample=False, temperature=1.0, top_k=None, top_p=None, seed=None,\n"
        f"                eos_token_id={eos}, pad_token_id={spec.pad_token_id})\n"
        "# -> int64 [batch, prompt + new]: the prompts, then the new tokens"
    )
    mlflow = (
        "mlflow.pyfunc.load_model(uri).predict({'input_ids': ids, 'attention_mask': mask},\n"
        "                                      params={'max_new_tokens': 16, 'do_sample': False, ...})"
    )
    return h(
        '<section id="how-to-call"><h2>How to call it</h2><p>A generation package: <code>generate</code> '
        "runs the prefill program once and the decode program once per new token against a static "
        "key/value cache. Calling the module itself runs the prefill program alone.</p><pre>{python}</pre>"
        "<p>As a registered MLflow model (its signature: inputs <code>input_ids</code>, "
        "<code>attention_mask</code>; the sampling settings as parameters; output <code>output_ids</code>):"
        "</p><pre>{mlflow}</pre><p>On Triton (<code>kiln serve triton export</code>): inputs "
        "<code>input_ids</code> and the optional <code>attention_mask</code>, <code>max_new_tokens</code>, "
        "<code>do_sample</code>, <code>temperature</code>, <code>top_k</code>, <code>top_p</code>, "
        "<code>seed</code>, <code>eos_token_id</code>, <code>pad_token_id</code>; outputs "
        "<code>output_ids</code> and <code>generated_ids</code> (the new tokens alone).</p></section>",
        python=python,
        mlflow=mlflow,
    )


def _spec_section(spec: GenerationSpec) -> Markup:
    rows = [
        ("model type", spec.model_type or "not recorded"),
        ("batch", f"1..{spec.max_batch} (generation.max_batch)"),
        ("prompt length", f"{spec.prompt_min}..{spec.prompt_max} (generation.prompt_length)"),
        ("cache positions", f"{spec.max_cache_len}: prompt + new tokens (generation.max_cache_len)"),
        ("cache layout", f"{spec.layers} layers x keys and values [batch, {spec.kv_heads}, "
         f"{spec.max_cache_len}, {spec.head_dim}] {spec.cache_dtype}"),
        ("cache at max batch", f"{num(spec.cache_bytes(spec.max_batch) / 2**20, '.3g')} MiB"),
        ("vocabulary", str(spec.vocab_size)),
        ("pad token", "none" if spec.pad_token_id is None else str(spec.pad_token_id)),
        ("end of sequence", ", ".join(map(str, spec.eos_token_id)) or "none"),
    ]  # fmt: skip
    return h(
        '<section><h2>Generation</h2><table class="facts" id="generation">{items}</table></section>',
        items=facts(rows),
    )


def _report_section(spec: GenerationSpec) -> Markup:
    report = spec.validation or {}
    if not report:
        return h(
            '<section><h2>Generated tokens</h2><p class="empty">No generation report in this package.'
            "</p></section>"
        )
    rows = [
        ("token agreement", _agreement(report)),
        ("first divergence", "none" if report.get("first_divergence") is None
         else f"new token {report.get('first_divergence')}"),
        ("max step logits error", num(report.get("max_step_logits_error"))),
        ("perplexity", _perplexity(report)),
        ("new tokens compared", str(report.get("max_new_tokens"))),
    ]  # fmt: skip
    speed = report.get("speed") or {}
    measures = [
        (f"time to first token, prompt {n} (ms)", f"ttft_ms_prompt{n}")
        for n in speed.get("prompt_lengths") or []
    ] + [(f"decode tokens/s, batch {b}", f"decode_tokens_per_s_batch{b}") for b in speed.get("batches") or []]
    if "compiled_peak_gpu_memory_bytes" in speed:  # measured on CUDA only
        measures.append(("peak GPU memory (bytes)", "peak_gpu_memory_bytes"))
    speed_rows = [
        [label, num(speed.get(f"compiled_{key}"), ".5g"), num(speed.get(f"eager_{key}"), ".5g")]
        for label, key in measures
    ]
    return h(
        '<section><h2>Generated tokens</h2><table class="facts" id="generation-report">{items}</table>'
        "<h3>Speed (measured {when})</h3>{speed}</section>",
        items=facts(rows),
        when=speed.get("measured_at", "not recorded"),
        speed=table("generation-speed", ["", "compiled", "eager"], speed_rows),
    )


def _perplexity(report: dict[str, Any]) -> str:
    compiled, eager = (num(report.get(k), ".6g") for k in ("perplexity", "eager_perplexity"))
    rel, tol = (num(report.get(k)) for k in ("perplexity_rel_error", "perplexity_rel_tol"))
    return f"{compiled} (eager {eager}, relative {rel}; tolerance {tol})"


def _agreement(report: dict[str, Any]) -> str:
    share, batches = report.get("token_agreement"), report.get("prompt_batches")
    if isinstance(share, int | float) and isinstance(batches, int) and not isinstance(batches, bool):
        return f"{round(share * batches)} of {batches} prompt batches with eager greedy generate"
    return num(share)
