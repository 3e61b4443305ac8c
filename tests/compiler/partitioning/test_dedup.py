import onnx
import torch

import compiler
from compiler.engine_build.lower import lower
from compiler.options import CompileOptions
from zoo.models import bert_encoder, repeated_fallback


def _plan(case, **options):
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    return compiler.partition(program, CompileOptions(**options))


def test_repeated_blocks_share_one_fingerprint_and_canonical_weight_names():
    plan = _plan(bert_encoder(3, hidden=64), split_modules="auto")
    unique = compiler.dedup(plan)
    layers = [unique.instance(p.name) for p in plan.partitions if p.block]
    assert len(layers) == 3 and len({i.fingerprint for i in layers}) == 1
    assert len(unique.unique) == len(plan.partitions) - 2
    # Same canonical names, each instance pointing at its own layer's tensors.
    assert list(layers[0].weights) == list(layers[2].weights)
    assert layers[0].weights["w0"].startswith("encoder.layer.0.")
    assert layers[2].weights["w0"].startswith("encoder.layer.2.")


def test_fingerprint_ignores_weight_values_but_not_structure_or_precision():
    fp = lambda case, **o: set(compiler.dedup(_plan(case, **o)).unique)  # noqa: E731
    base = fp(repeated_fallback(depth=2, seed=0))
    assert fp(repeated_fallback(depth=2, seed=1)) == base  # other weights, same structure
    assert fp(repeated_fallback(depth=2, width=32)) != base  # other shapes
    assert fp(repeated_fallback(depth=2), precision="fp16") != base


def test_equal_structures_lower_to_identical_graphs_apart_from_weights():
    plan = _plan(repeated_fallback(depth=3), split_modules="auto")
    unique = compiler.dedup(plan)
    fp = next(f for f in unique.unique if len(unique.instances_of(f)) > 1)
    first = onnx.load_from_string(lower(plan, unique, fp).onnx)
    names = sorted(i.name for i in first.graph.initializer if i.name.startswith("w"))
    assert names == sorted(f"w{i}" for i in range(len(names)))
    other_plan = _plan(repeated_fallback(depth=3, seed=5), split_modules="auto")
    second = onnx.load_from_string(lower(other_plan, compiler.dedup(other_plan), fp).onnx)
    for model in (first, second):
        for init in model.graph.initializer:
            if init.name.startswith("w"):
                init.ClearField("raw_data")
    assert first.graph.SerializeToString() == second.graph.SerializeToString()


def test_dedup_builds_once_and_refits_the_rest(tmp_path):
    case = repeated_fallback(depth=6)
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    compiled = compiler.compile(program, cache=tmp_path)
    report = compiled.report
    assert len(report.partitions) == 7 and report.unique_fingerprints == 3
    assert report.engines_built == 3 and report.refits == 4
    x = torch.randn(5, 64)
    torch.testing.assert_close(compiled(x), case.model(x), rtol=1e-5, atol=1e-5)


def test_split_compile_matches_the_unsplit_one(tmp_path):
    case = bert_encoder(3, hidden=64)
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    split = compiler.compile(program, cache=tmp_path, split_modules=("BertLayer",))
    whole = compiler.compile(program, cache=tmp_path)
    assert split.report.unique_fingerprints == 3 and len(split.report.partitions) == 5
    assert len(whole.report.partitions) == 1
    ids = torch.randint(0, 500, (3, 40))
    mask = torch.ones_like(ids)
    a = split(input_ids=ids, attention_mask=mask).last_hidden_state
    b = whole(input_ids=ids, attention_mask=mask).last_hidden_state
    assert float((a - b).norm() / b.norm()) < 1e-5


def test_a_dedup_plan_read_back_from_sorted_json_builds_the_same_engine(tmp_path):
    import json

    from zoo.models import tiny_resnet

    case = tiny_resnet()
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    plan = compiler.partition(program)
    unique = compiler.dedup(plan)
    assert len(unique.instances[0].weights) > 10  # w10 sorts before w2 as text
    again = compiler.DedupPlan.from_dict(json.loads(json.dumps(unique.to_dict(), sort_keys=True)))
    engines = {fp: compiler.build_engine(plan, again, fp) for fp in again.fingerprints}
    x = torch.randn(3, 3, 64, 64)
    expected = case.model(pixel_values=x).last_hidden_state
    got = compiler.assemble(plan, again, engines)(pixel_values=x).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_quantized_graph_that_inflates_far_past_its_size_is_hashed_as_it_is_never_inflated():
    """graph_digest reads a saved program's zip (its records less torch.export.save's random id); a plan
    read back from a package is outside bytes, so a zip bomb there is digested raw, and so is a PK-headed
    blob that is no zip."""
    import hashlib
    import io
    import zipfile

    from compiler.partitioning.dedup import graph_digest

    def archive(**members: bytes) -> bytes:
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as out:
            for name, data in members.items():
                out.writestr(name, data)
        return buffer.getvalue()

    bomb = archive(**{"model/data/0": bytes(256 << 20)})  # 256 MiB of zeros in ~250 KB
    assert len(bomb) < 1 << 20
    assert graph_digest(bomb) == hashlib.sha256(bomb).hexdigest()
    broken = b"PK\x03\x04 not a zip"
    assert graph_digest(broken) == hashlib.sha256(broken).hexdigest()
    # a real program's records: the random id left out, the rest counted
    one = archive(**{"m/.data/serialization_id": b"a", "m/data/0": b"weights"})
    two = archive(**{"m/.data/serialization_id": b"b", "m/data/0": b"weights"})
    other = archive(**{"m/.data/serialization_id": b"a", "m/data/0": b"other"})
    assert graph_digest(one) == graph_digest(two) != graph_digest(other)
