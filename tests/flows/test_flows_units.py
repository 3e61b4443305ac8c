"""Pieces of the pipeline that need no server: retry policy, build tags, naming, summaries, preflight."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prefect.states import Failed

from compiler.errors import (
    BackendError,
    BuildSettingsError,
    EngineBuildError,
    LoweringError,
    PartitionError,
)
from flows.recompile_zoo import summary_markdown, summary_rows
from flows.results import ModelResult, package_path
from tasks.refs import EngineRef, PlanRef, ProgramRef, StagedRef, retry_condition
from tasks.stages import build_key, build_tag, configured
from zoo.config import ZooEntry
from zoo.errors import ZooConfigError
from zoo.preflight import check_backend_available
from zoo.settings import ZooSettings


@pytest.mark.parametrize(
    ("exc", "retry"),
    [
        (OSError("disk busy"), True),
        (MemoryError(), True),
        (EngineBuildError("builder ran out of workspace"), True),
        (BackendError("device busy"), True),
        (BuildSettingsError("unknown backend_options ['refti']"), False),
        (LoweringError("op has no ONNX translation"), False),
        (PartitionError("unknown op"), False),
        (ValueError("bad shape"), False),
    ],
)
def test_only_transient_build_failures_are_retried(exc: BaseException, retry: bool) -> None:
    assert retry_condition(None, None, Failed(data=exc)) is retry


def test_build_tasks_carry_device_tags_retries_and_backoff() -> None:
    stages = configured("cuda:0", retries=3, backoff=1.5)
    build = stages.build_engine
    assert {"engine-build", build_tag("cuda:0")} <= set(build.tags)
    assert build.retries == 3
    assert build.retry_delay_seconds == [1.5, 3.0, 6.0]  # exponential back-off
    # No Prefect result is persisted: Prefect's records name their own deserializer (pickle), so stage
    # results live in the workspace as plain JSON (tasks.workspace).
    assert all(t.persist_result is False for t in vars(stages).values())


def test_build_limits_per_device() -> None:
    settings = ZooSettings(build_concurrency={"cpu": 3, "cuda": 1, "cuda:1": 2})
    assert settings.build_limit("cpu") == 3
    assert settings.build_limit("cuda:0") == 1  # the family's limit
    assert settings.build_limit("cuda:1") == 2
    with pytest.raises(ValueError, match="build_concurrency"):
        ZooSettings(build_concurrency={"tpu": 1})


def test_package_paths_are_per_device_when_an_entry_has_several_devices() -> None:
    one = ZooEntry(name="bert", factory="zoo.models:tiny_bert")
    two = ZooEntry(name="bert", factory="zoo.models:tiny_bert", devices=["cpu", "cuda:0"])
    assert package_path("out", one.requests()[0]) == str(Path("out") / "bert.kiln")
    assert package_path("out", two.requests()[1]) == str(Path("out") / "bert-cuda0.kiln")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_a_cuda_device_is_refused_where_there_is_none_naming_why() -> None:
    check_backend_available("onnxruntime", "cpu")
    for backend in ("onnxruntime", "inductor"):
        with pytest.raises(
            ZooConfigError, match=rf"backend: '{backend}'.*'cuda:0' needs a CUDA GPU.*GPU machine"
        ):
            check_backend_available(backend, "cuda:0")


def test_summary_lists_failures_with_their_message() -> None:
    results = [
        ModelResult("bert", "cpu", "ok", package="out/bert.kiln", partitions=3, unique_engines=2,
                    engines_built=0, engines_reused=2, max_rel_l2=1e-7, latency_ratio=0.5, seconds=1.0),
        ModelResult("gpt2", "cpu", "failed", error="ExportError: could not trace"),
    ]  # fmt: skip
    rows = summary_rows(results)
    assert rows[0]["built"] == 0 and rows[0]["reused"] == 2 and rows[0]["package_or_error"] == "out/bert.kiln"
    assert rows[1]["status"] == "failed" and rows[1]["package_or_error"] == "ExportError: could not trace"
    text = summary_markdown(results, 3.0)
    assert "1 of 2 ok, 0 engines built, 2 reused" in text
    assert "**gpt2** (cpu): ExportError: could not trace" in text


def test_engine_build_results_are_keyed_by_engine_library(monkeypatch: pytest.MonkeyPatch) -> None:
    import onnxruntime

    from compiler.options import CompileOptions

    program = ProgramRef("m", "k", "/p.pt2", "sha", ())
    plan = PlanRef(program, CompileOptions(), "/plan.json", "a", "/dedup.json", "b", ("f",), 1)
    key = build_key(plan, "f")
    assert key == build_key(plan, "f") and key != build_key(plan, "g")
    monkeypatch.setattr(onnxruntime, "__version__", "99.0.0")  # an upgraded library: build again
    assert build_key(plan, "f") != key


def test_refs_are_plain_json_and_round_trip() -> None:
    import json

    from compiler.inputs.specs import InputSpec
    from compiler.options import CompileOptions
    from compiler.runtime.compile_report import CompileReport

    spec = InputSpec("x", "float32", (1, 4), (2, 4), (8, 4), {0: "batch"})
    program = ProgramRef("m", "k", "/p.pt2", "sha", (spec,))
    plan = PlanRef(
        program, CompileOptions(precision="fp16", device="cuda:1"), "/p", "a", "/d", "b", ("f",), 1
    )
    engine = EngineRef("f", "c", "/e", "s", 10, True, False, 0.5, "process:1", "onnxruntime", None, ("w",))
    staged = StagedRef("k", "/s.kiln", "h", CompileReport("onnxruntime", "1", "cpu", "fp32", False))
    for ref in (program, plan, engine, staged):
        text = json.dumps(ref.to_json())  # nothing but JSON: no class names to import when read back
        assert type(ref).from_json(json.loads(text)) == ref
