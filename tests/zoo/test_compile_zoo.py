"""The compiler-core models, each within fp32 tolerance 1e-4 relative L2 of eager."""

import pytest
import torch

import compiler
from compiler.errors import InputSpecError


@pytest.mark.parametrize("name", ["tiny_bert", "tiny_vit", "tiny_resnet", "tiny_gpt2", "mlp_with_fallback"])
def test_compiled_matches_eager_across_the_spec_range(compiled_zoo, name):
    case, compiled = compiled_zoo[name]
    report = compiler.validate(case.model, compiled, samples=4, warmup=1, runs=3)
    assert report.max_rel_l2 <= 1e-4, report.to_dict()
    assert report.min_cosine > 0.9999
    mins = [spec.min_shape for spec in compiled.input_specs]
    maxs = [spec.max_shape for spec in compiled.input_specs]
    assert [list(s) for s in mins] in report.shapes and [list(s) for s in maxs] in report.shapes
    assert report.eager.runs == 3 and report.compiled.median_ms > 0


def test_report_names_partitions_ops_fallbacks_and_stage_times(compiled_zoo):
    _, compiled = compiled_zoo["mlp_with_fallback"]
    report = compiled.report.to_dict()
    assert report["num_partitions"] == 2 and report["fallback_ops"] == {"kiln_zoo.soft_sign_clip.default": 1}
    assert report["partitions"][0]["ops"]["aten.linear.default"] == 2
    assert {"partition", "dedup", "lower", "build", "assemble"} <= set(report["stage_seconds"])
    assert report["engines_built"] + report["cache_hits"] == report["unique_fingerprints"] == 2


def test_outputs_keep_the_model_structure(compiled_zoo):
    case, compiled = compiled_zoo["tiny_bert"]
    out = compiled(**case.kwargs)
    assert type(out).__name__ == type(case.model(**case.kwargs)).__name__
    assert out.last_hidden_state.shape == (2, 16, 64)


def test_inputs_outside_the_specs_raise_typed_errors(compiled_zoo):
    _case, compiled = compiled_zoo["tiny_bert"]
    ids = torch.zeros(9, 16, dtype=torch.int64)
    with pytest.raises(InputSpecError, match=r"input 'input_ids': shape \(9, 16\) is outside"):
        compiled(input_ids=ids, attention_mask=torch.ones_like(ids))
    with pytest.raises(InputSpecError, match="expected dtype int64, got float32"):
        compiled(input_ids=torch.zeros(2, 16), attention_mask=torch.ones(2, 16, dtype=torch.int64))
    with pytest.raises(InputSpecError, match="unexpected keyword inputs"):
        compiled(input_ids=ids[:2], attention_mask=ids[:2], token_type_ids=ids[:2])
