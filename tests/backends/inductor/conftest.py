"""What the Inductor tests share: a C++ compiler that fails, for builds that must fail for a real reason
(a toolchain refusing to compile) with no mock in kiln."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def failing_compiler(tmp_path: Path) -> Path:
    """A C++ compiler that names itself as g++ does (answering Inductor's ``--version`` probe) and fails
    every compile: ``failing-g++`` in the test's temporary folder."""
    failing = tmp_path / "failing-g++"
    failing.write_text(
        '#!/bin/sh\nfor a in "$@"; do [ "$a" = "--version" ] && exec g++ --version; done\nexit 1\n'
    )
    failing.chmod(0o755)
    return failing
