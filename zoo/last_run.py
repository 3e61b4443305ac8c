"""The zoo file of the last ``kiln zoo`` run in a directory, so that ``kiln release MODEL`` rebuilds the
original model from the entry that compiled it, as ``kiln zoo`` read it.

``kiln zoo FILE`` records FILE's absolute path in ``.kiln/last-zoo.json`` below the directory it runs
in (where ``.kiln/workspace``, ``.kiln/engine-cache`` and the default ``mlflow.db`` live too), written
atomically: a reader sees the old record or the new one. ``kiln release`` without ``--zoo`` reads it; no
record, or a recorded file that is gone, is a :class:`ZooConfigError` naming ``--zoo``, never a guess.
Not in the zoo file's own ``workspace`` setting: ``kiln release`` would need the zoo file to find it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from compiler import json_reader
from compiler.atomic import write_bytes_atomic
from zoo.errors import ZooConfigError

RECORD = Path(".kiln") / "last-zoo.json"


def record_zoo_file(zoo_file: str | os.PathLike, root: str | os.PathLike = ".") -> Path:
    """Record ``zoo_file`` as this directory's last ``kiln zoo`` run; the record's path."""
    record = Path(root) / RECORD
    record.parent.mkdir(parents=True, exist_ok=True)
    data = {"zoo_file": str(Path(zoo_file).resolve()), "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    write_bytes_atomic(record, json.dumps(data, indent=2).encode())
    return record


def last_zoo_file(root: str | os.PathLike = ".") -> Path | None:
    """The zoo file the last ``kiln zoo`` here ran, or None when none has run here."""
    record = Path(root) / RECORD
    try:
        data = json_reader.read_file(record)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ZooConfigError(
            f"{record} (the zoo file of the last kiln zoo run here) is unreadable: {exc}; name the zoo file "
            "with --zoo (the next kiln zoo run rewrites the record)"
        ) from None
    path = data.get("zoo_file") if isinstance(data, dict) else None
    if not isinstance(path, str) or not path:
        raise ZooConfigError(f"{record} names no zoo_file; name the zoo file with --zoo")
    return Path(path)


def zoo_file_for(model: str, zoo_file: str | os.PathLike | None, root: str | os.PathLike = ".") -> str:
    """The zoo file whose entry builds ``model``: ``zoo_file`` (``--zoo``) when given, else the last
    ``kiln zoo`` run's; a ZooConfigError naming ``--zoo`` when there is neither, or it is gone."""
    if zoo_file is not None:
        return str(zoo_file)
    last = last_zoo_file(root)
    if last is None:
        raise ZooConfigError(
            f"no --zoo given and no kiln zoo has run in {Path(root).resolve()} ({RECORD} is missing): name "
            f"the zoo file whose entry builds {model!r}, e.g. kiln release {model} --zoo deploy/zoo.yaml"
        )
    if not last.is_file():
        raise ZooConfigError(
            f"the last kiln zoo run here read {last}, which is gone; name the zoo file whose entry builds "
            f"{model!r} with --zoo"
        )
    return str(last)
