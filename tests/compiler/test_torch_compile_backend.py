"""torch.compile goes through the same partition/dedup/cache/strip machinery (seeds 000, 002)."""

import pytest
import torch

import compiler
from compiler.errors import BackendError
from zoo.models import repeated_fallback


@pytest.fixture()
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_strip_weights_really_strips_on_the_torch_compile_path(fresh_dynamo, tmp_path):
    case = repeated_fallback(depth=4, width=128)
    x = torch.randn(6, 128)
    results = {}
    for strip in (False, True):
        torch._dynamo.reset()
        backend = compiler.KilnBackend(strip_weights=strip, cache=tmp_path)
        out = torch.compile(case.model, backend=backend, dynamic=False)(x)
        results[strip] = (out, backend.compiled[0].report)
    full, stripped = results[False], results[True]
    assert torch.equal(full[0], stripped[0])
    torch.testing.assert_close(stripped[0], case.model(x), rtol=1e-5, atol=1e-5)
    assert stripped[1].engine_bytes <= 0.05 * full[1].engine_bytes  # weights really left the engines
    assert stripped[1].unique_fingerprints == 3 and len(stripped[1].partitions) == 5  # dedup applies too
    assert stripped[1].fallback_ops == {"kiln_zoo.soft_sign_clip.default": 4}


def test_backend_by_name_and_recompile_on_a_new_shape_reuses_the_cache(fresh_dynamo, tmp_path):
    case = repeated_fallback(depth=2)
    fn = torch.compile(case.model, backend="kiln", options={"cache": str(tmp_path)}, dynamic=False)
    for batch in (3, 5):
        x = torch.randn(batch, 64)
        torch.testing.assert_close(fn(x), case.model(x), rtol=1e-5, atol=1e-5)
    torch._dynamo.reset()
    backend = compiler.KilnBackend(cache=tmp_path)
    torch.compile(case.model, backend=backend, dynamic=False)(torch.randn(5, 64))
    report = backend.compiled[0].report
    assert report.engines_built == 0 and report.cache_hits == report.unique_fingerprints


def test_symbolic_shapes_get_a_clear_error(fresh_dynamo):
    case = repeated_fallback(depth=1)
    fn = torch.compile(case.model, backend=compiler.KilnBackend(cache=False), dynamic=True)
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="dynamic=False") as failure:
        fn(torch.randn(4, 64))
    assert isinstance(failure.value.inner_exception, BackendError)
