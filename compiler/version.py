"""kiln's own version, recorded in every package and registry entry."""

from __future__ import annotations

from functools import cache
from importlib import metadata


@cache
def kiln_version() -> str:
    try:
        return metadata.version("kiln")
    except metadata.PackageNotFoundError:
        return "0+unknown"
