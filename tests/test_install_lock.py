"""The README's install is locked: constraints.txt pins every package kiln[dev] needs, each pin within
pyproject's specifiers, and both README commands and .ci/run install from it (issue 32: without a
lock, the pip of a fresh Python 3.11 venv backtracked for over 30 minutes)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[1]
REGENERATE = "regenerate it with the command at the top of constraints.txt"


def _pins() -> dict[str, Version]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = Version(version.strip())
    return pins


def _requirements(extra: str, project: dict, seen: set[str]) -> list[Requirement]:
    """kiln[extra]'s requirements, following kiln[...] self-references."""
    found = []
    for text in project["optional-dependencies"][extra]:
        requirement = Requirement(text)
        if canonicalize_name(requirement.name) == "kiln":
            for inner in requirement.extras - seen:
                seen.add(inner)
                found += _requirements(inner, project, seen)
        else:
            found.append(requirement)
    return found


def test_the_lock_pins_every_dependency_of_the_install_within_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(r) for r in project["dependencies"]] + _requirements("dev", project, {"dev"})
    pins = _pins()
    missing = [r.name for r in requirements if canonicalize_name(r.name) not in pins]
    assert not missing, f"constraints.txt lacks {missing}: {REGENERATE}"
    outside = [
        f"{r.name}=={pins[canonicalize_name(r.name)]} (pyproject: {r.specifier})"
        for r in requirements
        if not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)
    ]
    assert not outside, f"constraints.txt pins outside pyproject's ranges: {outside}; {REGENERATE}"
    assert pins["torch"] == Version("2.13.0")  # the README's torch, the CPU file on this disk


def test_the_readme_commands_and_ci_install_from_the_lock_in_a_fresh_environment():
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^(?:python3 -m pip install|\{ command -v chromium).*$", readme, re.M)
    assert len(commands) == 2 and all("-c constraints.txt" in c for c in commands), commands
    ci = (ROOT / ".ci" / "run").read_text()
    assert commands[1] in ci  # exactly the README's test command
    assert re.search(r"python3 -m venv \.venv-ci && \. \.venv-ci/bin/activate", ci)
