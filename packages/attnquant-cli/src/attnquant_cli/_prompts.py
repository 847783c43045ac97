"""The fixed prompt set of ``attnquant verify``: Python openings, the demo model's domain."""

from __future__ import annotations

__all__ = ["VERIFY_PROMPTS"]

VERIFY_PROMPTS: tuple[str, ...] = (
    "def ",
    "import os\n",
    "class ",
    "    def __init__(self",
    "for i in range(",
    "if __name__ == ",
    "    return ",
    "# ",
)
