"""A cache fuzzer in CI (cache_fuzz_probe.py beside it, bounded): records and entries mutated as an attacker
who can rewrite the cache (and recompute its hashes) would, field by field and file by file, read back
the original engine bytes or are refused with a typed error, never crash or hang, and nothing outside
the cache folder is opened, listed, written or deleted (an audit hook in a fresh process)."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SECONDS = 8  # random rounds stop here (the sweep of single mutations always completes, within 12 s)


def test_fuzzed_cache_entries_read_back_or_are_refused_and_touch_nothing_outside(
    tmp_path: Path, bounded_python
) -> None:
    config = {
        "scratch": str(tmp_path),
        "root": str(ROOT),
        "seed": int(os.environ.get("KILN_FUZZ_SEED", "0")),
        "seconds": SECONDS,
        "max_rounds": 10**6,
    }
    (tmp_path / "config.json").write_text(json.dumps(config))
    # a runaway read fails at 2 GiB in the child instead of taking the machine
    done = bounded_python(
        [
            str(Path(__file__).with_name("cache_fuzz_probe.py")),
            str(tmp_path / "config.json"),
            str(tmp_path / "r.json"),
        ],
        limit_bytes=2 << 30,
        timeout=SECONDS + 60,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    rounds = report["rounds"]
    outcomes = Counter(r["outcome"] for r in rounds)
    bad = [r for r in rounds if r["outcome"] not in ("same", "refused") or r["violations"]]
    assert not bad, json.dumps([{k: r.get(k) for k in ("outcome", "layer", "mutations", "error", "violations",
                                                       "trace")} for r in bad[:6]], indent=1)  # fmt: skip
    # The fuzzer really ran: every single mutation on both layers, then combinations.
    assert len(rounds) >= 2 * report["sweep"], (len(rounds), outcomes)
    assert outcomes["refused"] >= 50 and outcomes["same"] >= 10, outcomes
    assert report["control"], "the audit hook saw nothing of the positive control"
