"""What an Inductor engine needs of the machine that loads it, and what it may run there.

Refused outright (:class:`EngineCompatibilityError`): another torch version (Inductor's kernels and
caches are version-specific), another kind of device, another CUDA device index (Inductor writes it
into its generated code).

Run, but not its stored native code (:func:`foreign_code`, warned as
:class:`~compiler.errors.ForeignEngineCodeWarning`; the engine is compiled here from its program and
this machine's own AOTInductor package is built for the loads after it): an engine built for another
CUDA GPU, whose kernels are that GPU's; and an AOTInductor package compiled against a newer libstdc++
than the loading process has, which crashes the process (two C++ runtimes in one, ``aot.py``) rather
than failing the load. The build records the libstdc++ its C++ compiler compiles against
(``aot_libstdcxx``); a load compares it with the one torch brought into the process.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
from collections.abc import Mapping
from typing import Any

import torch

from compiler.errors import EngineCompatibilityError


def check_compatible(header: Mapping[str, Any], device: torch.device, here: str) -> None:
    """EngineCompatibilityError unless an engine with this header runs on ``device`` (``here``: its
    target, ``cuda:sm_90``)."""
    if header.get("torch") != torch.__version__:
        raise EngineCompatibilityError(
            f"Inductor engine built with torch {header.get('torch')}; this is torch {torch.__version__}: "
            "recompile with this torch (Inductor's kernels and caches are version-specific)"
        )
    built_for = header.get("device")
    # Another CUDA GPU: the engine runs, compiled here from its program (foreign_code)
    if built_for != here and not (str(built_for).startswith("cuda:") and here.startswith("cuda:")):
        raise EngineCompatibilityError(
            f"Inductor engine built for {built_for}; this backend runs on {device} ({here}): "
            f"recompile for {here}, or load it on a machine with {built_for}"
        )
    index = header.get("device_index")
    if index != device_index(device):
        raise EngineCompatibilityError(
            f"Inductor engine built for cuda:{index}; this backend runs on {device}: recompile for "
            f"{device}, or load it on cuda:{index}"
        )


def foreign_code(header: Mapping[str, Any], has_aot: bool, device: torch.device, here: str) -> str | None:
    """Why the engine's stored native code must not run on ``device`` although the engine may: it is
    another GPU's, or its AOTInductor package (``has_aot``) needs a newer libstdc++ than this process
    loaded. None where nothing stands in the way."""
    built_for = header["device"]
    if built_for != here:
        gpu = torch.cuda.get_device_name(device)
        return f"its compiled code is for {built_for}, and this GPU is {here} ({gpu})"
    needs, has = header.get("aot_libstdcxx"), process_cxx_runtime()
    if has_aot and newer_runtime(needs, has):
        return (
            f"its AOTInductor package was compiled against libstdc++ {needs} (by {header.get('aot')}), "
            f"newer than the libstdc++ {has} this process loaded (a process that loads it may crash)"
        )
    return None


def device_index(device: torch.device) -> int | None:
    return (device.index or 0) if device.type == "cuda" else None


@functools.cache
def cxx_runtime(compiler: str) -> str | None:
    """The version of the libstdc++ ``compiler`` compiles against (``"6.0.33"``: the library its
    ``-print-file-name`` resolves to); None where it does not say."""
    try:
        done = subprocess.run(
            [compiler, "-print-file-name=libstdc++.so.6"], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    found = done.stdout.strip()
    return _libstdcxx_version(found) if done.returncode == 0 and os.path.isabs(found) else None


def process_cxx_runtime() -> str | None:
    """The version of the libstdc++ this process has loaded (torch loads one); None where it cannot tell."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                name = line.rsplit(None, 1)[-1]
                if "/libstdc++.so" in name:
                    return _libstdcxx_version(name)
    except OSError:
        return None
    return None


def newer_runtime(needs: str | None, has: str | None) -> bool:
    """Whether a package compiled against libstdc++ ``needs`` may crash a process that loaded ``has``:
    libstdc++ runs code compiled against itself or older, not newer (unknown on either side: no)."""
    if not needs or not has:
        return False
    return tuple(map(int, needs.split("."))) > tuple(map(int, has.split(".")))


def _libstdcxx_version(path: str) -> str | None:
    match = re.fullmatch(r"libstdc\+\+\.so\.(\d+\.\d+\.\d+)", os.path.basename(os.path.realpath(path)))
    return match.group(1) if match else None
