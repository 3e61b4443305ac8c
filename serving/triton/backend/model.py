"""kiln's Triton Python backend: the same file in every version folder of every kiln model.

Triton's stub embeds its own Python and ignores PYTHONPATH, so torch and kiln reach it in one of two
ways: installed into the interpreter the stub embeds (a server image: ``pip install`` there), or named
in ``KILN_TRITON_PYTHONPATH`` (``kiln serve triton run`` sets it to the site-packages and the kiln
checkout of the Python that runs it). Those folders go first on ``sys.path``, ``.pth`` files included
(an editable install). Everything else is ``serving.triton.runtime``: this file holds no model logic
and reads nothing from the repository but the version folder Triton hands it.
"""

import os
import site
import sys


def _kiln_paths() -> None:
    extra = [p for p in os.environ.get("KILN_TRITON_PYTHONPATH", "").split(os.pathsep) if p]
    before = list(sys.path)
    for path in extra:
        site.addsitedir(path)
    # The stub's own interpreter may carry other copies of numpy and friends: ours come first.
    added = [p for p in sys.path if p not in before]
    sys.path[:] = added + before


_kiln_paths()

import triton_python_backend_utils as pb_utils  # noqa: E402 - after the paths it needs

from serving.triton.runtime import ServedRuntime  # noqa: E402


class TritonPythonModel:
    def initialize(self, args: dict) -> None:
        self.runtime = ServedRuntime.from_triton_args(args, pb_utils)

    def execute(self, requests: list) -> list:
        return self.runtime.execute(requests)

    def finalize(self) -> None:
        self.runtime = None
