"""Shared fixtures: small synthetic Hugging Face checkpoints written to a temp dir."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from attnquant_core.calib import calibrate, open_source
from attnquant_core.testing import llama_config, make_weights, write_checkpoint


@pytest.fixture
def checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``checkpoint(num_layers=4, dtype=..., shards=1, **kw)`` -> checkpoint directory."""
    counter = iter(range(1000))

    def make(num_layers: int = 4, *, shards: int = 1, **kwargs) -> Path:
        tensors = make_weights(num_layers, **kwargs)
        return write_checkpoint(tmp_path / f"ckpt{next(counter)}", tensors, shards=shards)

    return make


@pytest.fixture(scope="session")
def tiny_calibrated(tmp_path_factory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """A 2-layer Llama (the test_calib_forward model, weights scaled to O(1/sqrt(in))) and its
    calibration statistics over 8 windows of 16 tokens: ``(directory, stats path, state)``."""
    tmp = tmp_path_factory.mktemp("calibrated")
    rng = np.random.default_rng(0)
    state = {
        k: (v / np.sqrt(v.shape[-1]) if v.ndim == 2 else v) for k, v in make_weights(2).items()
    }
    for layer in range(2):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"model.layers.{layer}.{norm}.weight"] = np.ones(24, np.float32)
    state["lm_head.weight"] = (rng.standard_normal((16, 24)) / 3).astype(np.float32)
    directory = tmp / "tiny"
    directory.mkdir()
    safetensors.numpy.save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(llama_config(2)))
    windows = np.random.default_rng(0).integers(0, 16, size=(8, 16))
    report = calibrate(open_source(directory), windows, tmp / "stats.safetensors")
    return directory, report.path, state
