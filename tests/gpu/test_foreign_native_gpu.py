"""An engine built for another GPU (issue 34, bad input): its native package is refused by name, the
engine compiled here from its program serves at once, and this GPU's own native package is built in
the background for the loads after it, which then run natively.

There is one kind of GPU on the device machine, so the other GPU is the header's word for it (as a
package compiled on an A100, sm_80, says); the package is saved with it, and loaded as trusted.

    python3 -m pytest -q tests/gpu/test_foreign_native_gpu.py
"""

from __future__ import annotations

import dataclasses
import io
import json
import zipfile

import pytest
import torch
from torch.export import Dim

import compiler
from compiler.backends.inductor import native
from compiler.backends.inductor.format import AOT, HEADER, pack
from compiler.errors import ForeignEngineCodeWarning

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"
    ),
]


def test_a_native_package_for_another_gpu_is_refused_by_name_and_rebuilt_here(tmp_path, monkeypatch):
    torch.manual_seed(0)
    model = (
        torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.GELU(), torch.nn.Linear(24, 6)).cuda().eval()
    )
    x = torch.randn(4, 12, device="cuda")
    program = compiler.export(model, (x,), dynamic_shapes=({0: Dim("batch", min=1, max=16)},))
    module = compiler.compile(program, backend="inductor", device="cuda", cache=False)
    (fp,) = [fp for fp, a in module.engines.items() if a.engine]
    with zipfile.ZipFile(io.BytesIO(module.engines[fp].engine)) as archive:
        files = {name: archive.read(name) for name in archive.namelist()}
    header = json.loads(files[HEADER])
    here = header["device"]
    assert AOT in files and here.startswith("cuda:sm_"), header
    other = "cuda:sm_80" if here != "cuda:sm_80" else "cuda:sm_90"
    forged = pack({**files, HEADER: json.dumps({**header, "device": other}).encode()})
    module.engines[fp] = dataclasses.replace(module.engines[fp], engine=forged)
    path = compiler.save(module, tmp_path / "other-gpu.kiln").path
    cache = tmp_path / "cache"
    monkeypatch.setenv("KILN_CACHE_DIR", str(cache))

    named = rf"compiled code is for {other}, and this GPU is {here} \({torch.cuda.get_device_name()}\)"
    with pytest.warns(ForeignEngineCodeWarning, match=named):
        first = compiler.load(path, trust_engine_code=True)
    assert "aot" not in first.last_dispatch().values()
    with torch.no_grad():
        torch.testing.assert_close(first(x), model(x), rtol=1e-4, atol=1e-4)
    (build,) = first.native_builds()
    assert build.wait(540) == 0, (build.job / "worker.log").read_text()[-2000:] if build.job.exists() else ""
    started = [e for e in native.log_events(cache) if e["state"] == "started"]
    assert started and other in started[-1]["why"], started

    # The package's own is still another GPU's (refused, named); this GPU's own, built above, serves.
    with pytest.warns(ForeignEngineCodeWarning, match=named):
        second = compiler.load(path, trust_engine_code=True)
    assert set(second.last_dispatch().values()) == {"aot"}, second.last_dispatch()
    with torch.no_grad():
        torch.testing.assert_close(second(x), model(x), rtol=1e-4, atol=1e-4)
