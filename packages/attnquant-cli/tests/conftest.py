"""Fixtures shared by the CLI's tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from attnquant_core.testing import write_byte_llama

#: Calibration text for the byte-level tiny Llama: every byte is a token.
BYTE_TEXT = "def add(a, b):\n    return a + b\n\n\nclass Point:\n    x = 0\n    y = 0\n" * 6


@pytest.fixture(scope="session")
def byte_llama(tmp_path_factory) -> Callable[[int], tuple[Path, str]]:
    """``make(layers)``: a tiny Llama of ``layers`` layers (attnquant_core.testing's shapes)
    with a byte-level tokenizer, and a text file to calibrate it on; one per ``layers``."""
    made: dict[int, tuple[Path, str]] = {}

    def make(layers: int) -> tuple[Path, str]:
        if layers not in made:
            directory = tmp_path_factory.mktemp(f"byte-llama-{layers}") / "model"
            write_byte_llama(directory, layers)
            text = directory.parent / "text.txt"
            text.write_text(BYTE_TEXT)
            made[layers] = directory, str(text)
        return made[layers]

    return make
