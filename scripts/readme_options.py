"""Write the README's serving-options table from the code (attnquant_core.serving.OPTIONS).

    python scripts/readme_options.py          # rewrite the table between the markers
    python scripts/readme_options.py --check  # exit 1 when the README is out of date

``tests/test_readme.py`` runs the check, so the table cannot drift from the options.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from attnquant_core.serving import options_table

BEGIN, END = "<!-- options-table:begin -->", "<!-- options-table:end -->"


def rendered(text: str) -> str:
    """``text`` with the table between the markers replaced by the generated one."""
    head, sep, rest = text.partition(BEGIN)
    _, sep2, tail = rest.partition(END)
    if not sep or not sep2:
        raise SystemExit(f"the README lacks the markers {BEGIN} ... {END}")
    return f"{head}{BEGIN}\n{options_table()}\n{END}{tail}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail when the table is stale")
    parser.add_argument(
        "readmes",
        nargs="*",
        type=Path,
        default=[
            Path(__file__).resolve().parents[1] / "README.md",
            Path(__file__).resolve().parents[1] / "packages/attnquant-max/README.md",
        ],
    )
    args = parser.parse_args()
    stale = []
    for readme in args.readmes:
        text = readme.read_text()
        new = rendered(text)
        if new != text:
            stale.append(readme)
            if not args.check:
                readme.write_text(new)
    if args.check and stale:
        print(f"stale options table in {[str(p) for p in stale]}: run scripts/readme_options.py")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
