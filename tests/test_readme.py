"""The README's serving-options table is generated from the code, and its links resolve."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_options_tables_are_the_codes() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "readme_options.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_readme_is_short_and_its_links_resolve() -> None:
    readme = ROOT / "README.md"
    assert len(readme.read_text().splitlines()) <= 260
    for page in [readme, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            assert (page.parent / target).exists(), f"{page.name} links to missing {target}"
