"""Shared fixtures: small synthetic Hugging Face checkpoints written to a temp dir."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from attnquant_core.testing import make_weights, write_checkpoint


@pytest.fixture
def checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``checkpoint(num_layers=4, dtype=..., shards=1, **kw)`` -> checkpoint directory."""
    counter = iter(range(1000))

    def make(num_layers: int = 4, *, shards: int = 1, **kwargs) -> Path:
        tensors = make_weights(num_layers, **kwargs)
        return write_checkpoint(tmp_path / f"ckpt{next(counter)}", tensors, shards=shards)

    return make
