"""One version for all four packages, and each pins the others to that minor version.

Reads the four ``pyproject.toml`` files (``tomllib``; ``packaging`` comes with pytest): every
``version`` must be equal, and every ``attnquant-*`` requirement (dependencies, optional
dependencies, dependency groups) must admit that version and no other minor version.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "kernels", "max", "cli")
NAMES = {f"attnquant-{pkg}" for pkg in PACKAGES}


def pyproject(pkg: str) -> dict[str, Any]:
    """The parsed ``packages/attnquant-<pkg>/pyproject.toml``."""
    with (REPO / "packages" / f"attnquant-{pkg}" / "pyproject.toml").open("rb") as f:
        return tomllib.load(f)


def requirements(data: dict[str, Any]) -> Iterator[tuple[str, Requirement]]:
    """``(where, requirement)`` of every requirement string of one ``pyproject.toml``."""
    project = data["project"]
    for req in project.get("dependencies", []):
        yield "dependencies", Requirement(req)
    for extra, reqs in project.get("optional-dependencies", {}).items():
        for req in reqs:
            yield f"optional-dependencies.{extra}", Requirement(req)
    for group, reqs in data.get("dependency-groups", {}).items():
        for req in reqs:
            if isinstance(req, str):  # not an {include-group = ...} table
                yield f"dependency-groups.{group}", Requirement(req)


def other_minors(version: Version) -> list[Version]:
    """Versions just outside ``version``'s minor series: the previous and the next minor."""
    major, minor = version.major, version.minor
    below = [Version(f"{major}.{minor - 1}.999")] if minor else []
    if major:
        below.append(Version(f"{major - 1}.999.999"))
    return [*below, Version(f"{major}.{minor + 1}.0"), Version(f"{major + 1}.0.0")]


def test_all_four_packages_share_one_version() -> None:
    versions = {f"attnquant-{pkg}": pyproject(pkg)["project"]["version"] for pkg in PACKAGES}
    assert len(set(versions.values())) == 1, f"the packages' versions differ: {versions}"


def test_inter_package_requirements_admit_exactly_that_minor_version() -> None:
    """``attnquant-core>=0.8.0,<0.9`` in a package at 0.8.0: 0.8.0 and later 0.8.x, nothing else."""
    version = Version(pyproject("core")["project"]["version"])
    same_minor = [version, Version(f"{version.major}.{version.minor}.999")]
    bad, seen = [], 0
    for pkg in PACKAGES:
        for where, req in requirements(pyproject(pkg)):
            if not req.name.startswith("attnquant"):
                continue
            seen += 1
            label = f"attnquant-{pkg} {where}: {req}"
            if req.name not in NAMES:
                bad.append(f"{label} names no package of this repository")
                continue
            rejected = [str(v) for v in same_minor if not req.specifier.contains(v)]
            admitted = [str(v) for v in other_minors(version) if req.specifier.contains(v)]
            if rejected:
                bad.append(f"{label} rejects {rejected}")
            if admitted:
                bad.append(f"{label} admits other minor versions {admitted}")
    assert seen, "no attnquant-* requirement found: the packages no longer depend on each other?"
    assert not bad, "\n".join(bad)
