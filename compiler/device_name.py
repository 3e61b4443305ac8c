"""The word *device*: where a model runs (``cpu``, ``cuda``, ``cuda:N``), one pattern and one check.

Torch-free, so that options, zoo files and settings check a device's spelling without importing torch;
:func:`compiler.device.resolve` turns a checked name into a device that exists here. An *engine
target* (what an engine is built for: ``cpu``, ``cuda:sm_90``) is another word (docs/architecture.md).
"""

from __future__ import annotations

import re

from compiler.errors import OptionsError

DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def check_device(name: object, field: str = "device") -> str:
    """``name`` when it spells a device; an OptionsError (a ValueError) naming ``field`` otherwise."""
    if not isinstance(name, str) or not DEVICE_RE.match(name):
        raise OptionsError(f"{field} {name!r} is not a device; use 'cpu', 'cuda' or 'cuda:N'")
    return name
