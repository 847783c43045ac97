"""No source file of any package over :data:`MAX_LINES` lines (standard library only, no MAX).

Every ``packages/*/src/**/*.py`` of the four packages counts, except the demo model's data
directory that attnquant-cli ships (:data:`EXCLUDED`). Tests, benchmarks and scripts do not.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("core", "kernels", "max", "cli")
MAX_LINES = 500
#: Data shipped inside a package, not its source: skipped wherever it is found.
EXCLUDED = (Path("packages/attnquant-cli/src/attnquant_cli/demo_model"),)


def source_files() -> list[Path]:
    """Every ``.py`` file under the four packages' ``src``, relative to the repository."""
    files = []
    for pkg in PACKAGES:
        src = REPO / "packages" / f"attnquant-{pkg}" / "src"
        for path in sorted(src.rglob("*.py")):
            rel = path.relative_to(REPO)
            if "__pycache__" in rel.parts or any(rel.is_relative_to(d) for d in EXCLUDED):
                continue
            files.append(rel)
    return files


def line_count(path: Path) -> int:
    """The lines of ``path`` as an editor numbers them."""
    return len((REPO / path).read_text(encoding="utf-8").splitlines())


def test_every_package_has_sources() -> None:
    """The walk sees all four packages (a moved ``src`` would otherwise pass unnoticed)."""
    found = {path.parts[1] for path in source_files()}
    assert found == {f"attnquant-{pkg}" for pkg in PACKAGES}


def test_no_source_file_over_the_limit() -> None:
    """Each file over the limit is listed with its line count, longest first."""
    long = {path.as_posix(): n for path in source_files() if (n := line_count(path)) > MAX_LINES}
    listing = "\n".join(
        f"  {name}: {n} lines" for name, n in sorted(long.items(), key=lambda kv: -kv[1])
    )
    assert not long, f"{len(long)} source files over {MAX_LINES} lines:\n{listing}"
