import pytest
import torch

import compiler
from compiler.errors import RefitError
from zoo.models import repeated_fallback


@pytest.fixture(scope="module")
def program_and_case():
    case = repeated_fallback(depth=4, width=128)
    program = compiler.export(case.model, case.args, case.kwargs, dynamic_shapes=case.dynamic_shapes)
    return case, program


def _dir_bytes(path):
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def test_stripped_engines_are_exact_and_packages_hold_the_weights_once(program_and_case, tmp_path):
    _case, program = program_and_case
    full = compiler.compile(program, cache=tmp_path / "c")
    stripped = compiler.compile(program, cache=tmp_path / "c", strip_weights=True)
    full_pkg = compiler.save(full, tmp_path / "full.kiln").path
    strip_pkg = compiler.save(stripped, tmp_path / "strip.kiln").path
    x = torch.randn(9, 128)
    assert torch.equal(compiler.load(strip_pkg)(x), compiler.load(full_pkg)(x))
    assert torch.equal(stripped(x), full(x))
    # Built engines lose their weights (a few bytes of per-initializer markers remain) ...
    assert stripped.report.engine_bytes <= 0.05 * full.report.engine_bytes
    # ... and a package holds each weight once, in weights.safetensors, whatever strip_weights built:
    # its ONNX Runtime engines are stored stripped either way (a package load passes them their weights).
    unique_weight_bytes = sum(
        sum(full.weights[key].numel() * 4 for key in full.dedup.instance(part).weights.values())
        for part in full.dedup.unique.values()
    )
    assert abs(_dir_bytes(full_pkg) - _dir_bytes(strip_pkg)) < 0.01 * unique_weight_bytes
    assert _dir_bytes(full_pkg / "engines") <= 0.05 * full.report.engine_bytes


def test_refit_package_with_a_fine_tuned_checkpoint_needs_no_build(program_and_case, tmp_path):
    case, program = program_and_case
    compiled = compiler.compile(program, cache=tmp_path / "c", strip_weights=True)
    path = compiler.save(compiled, tmp_path / "m.kiln").path
    engines_before = {p.name: p.read_bytes() for p in (path / "engines").iterdir()}
    tuned = repeated_fallback(depth=4, width=128, seed=7).model
    compiler.refit_package(path, tuned.state_dict())
    assert {p.name: p.read_bytes() for p in (path / "engines").iterdir()} == engines_before
    x = torch.randn(3, 128)
    torch.testing.assert_close(compiler.load(path)(x), tuned(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(tuned(x), case.model(x))


def test_refit_of_full_engines_updates_them_in_place(program_and_case, tmp_path):
    _, program = program_and_case
    compiled = compiler.compile(program, cache=tmp_path / "c")
    tuned = repeated_fallback(depth=4, width=128, seed=3).model
    x = torch.randn(3, 128)
    torch.testing.assert_close(compiled.refit(tuned.state_dict())(x), tuned(x), rtol=1e-5, atol=1e-5)


def test_refit_in_place_keeps_the_module_and_a_save_carries_the_new_weights(program_and_case, tmp_path):
    _, program = program_and_case
    path = compiler.save(compiler.compile(program, cache=tmp_path / "c"), tmp_path / "m.kiln").path
    loaded = compiler.load(path)  # owns its weights (an in-process compile shares the model's)
    stages = loaded.load_seconds  # where the load's seconds went, for cold-start work
    assert {"manifest", "imports", "weights", "plan", "engines", "warmup", "total"} <= set(stages)
    assert stages["total"] >= sum(v for k, v in stages.items() if k != "total") - 1e-3
    tuned = repeated_fallback(depth=4, width=128, seed=5).model
    x = torch.randn(3, 128)
    before = loaded(x)
    state = tuned.state_dict()
    with pytest.raises(RefitError, match="expected shape"):
        loaded.refit({**state, "blocks.0.fc1.weight": torch.zeros(64, 128)}, in_place=True)
    torch.testing.assert_close(loaded(x), before)  # a refused refit changed nothing
    assert loaded.refit(state, in_place=True) is loaded
    torch.testing.assert_close(loaded(x), tuned(x), rtol=1e-5, atol=1e-5)
    again = compiler.load(compiler.save(loaded, tmp_path / "again.kiln").path)
    torch.testing.assert_close(again(x), tuned(x), rtol=1e-5, atol=1e-5)


def test_refit_with_wrong_weights_is_refused(program_and_case, tmp_path):
    _, program = program_and_case
    compiled = compiler.compile(program, cache=tmp_path / "c")
    state = repeated_fallback(depth=4, width=128).model.state_dict()
    key = "blocks.0.fc1.weight"
    with pytest.raises(RefitError, match=r"blocks.0.fc1.weight.*expected shape \(128, 128\)"):
        compiled.refit({**state, key: torch.zeros(64, 128)})
    with pytest.raises(RefitError, match="dtype"):
        compiled.refit({**state, key: state[key].double()})
    with pytest.raises(RefitError, match="lacks"):
        compiled.refit({**state, "blocks.9.fc1.weight": state[key]})
