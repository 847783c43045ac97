"""Whole-window scoring through MAX, without a compile: the planned length, the logits capture,
and which checkpoints MAX can judge (the compiled check is tests/test_eval_max.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
from scipy.special import log_softmax

from attnquant_max import max_unavailable, planned_length, window_logprobs


def _model_dir(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_planned_length_is_the_models_own_whatever_the_window(tmp_path):
    llama = _model_dir(tmp_path, architectures=["LlamaForCausalLM"], max_position_embeddings=512)
    assert planned_length(llama, 16) == planned_length(llama, 512) == 512
    with pytest.raises(ValueError, match="exceed the model's max_position_embeddings 512"):
        planned_length(llama, 513)
    bare = tmp_path / "bare"
    bare.mkdir()
    assert planned_length(_model_dir(bare, architectures=["LlamaForCausalLM"]), 40) == 40


def test_gemma_on_a_cpu_and_unknown_architectures_are_named(tmp_path):
    text = _model_dir(tmp_path, architectures=["Gemma3ForCausalLM"], sliding_window=512)
    assert max_unavailable(text, "cpu") is None  # Gemma 3 text runs in MAX on a CPU
    short = tmp_path / "short"
    short.mkdir()
    _model_dir(short, architectures=["Gemma3ForCausalLM"], sliding_window=8)
    assert "sliding_window 8" in (max_unavailable(short, "cpu") or "")
    vision = tmp_path / "vision"
    vision.mkdir()
    _model_dir(vision, architectures=["Gemma3ForConditionalGeneration"])
    assert "needs a GPU" in (max_unavailable(vision, "cpu") or "")
    other = tmp_path / "other"
    other.mkdir()
    _model_dir(other, architectures=["MambaForCausalLM"])
    assert "MambaForCausalLM" in (max_unavailable(other, "cpu") or "")


class _Buffer:
    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def to_numpy(self) -> np.ndarray:
        return self.array


def _fake(rows_per_token: int = 1):
    """A LoadedModel stand-in whose forward returns fixed logits for every prompt position."""
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((64, 11)).astype(np.float32)

    class PipelineModel:
        def execute(self, n: int):
            return SimpleNamespace(logits=_Buffer(logits[: n * rows_per_token]))

    pm = PipelineModel()

    def generate(prompts, **kwargs):
        (prompt,) = prompts
        pm.execute(len(prompt))

    model = SimpleNamespace(model=SimpleNamespace(pipeline=SimpleNamespace(_pipeline_model=pm)))
    model.model.generate = generate
    return model, pm, logits


def test_window_logprobs_reads_every_positions_logits_and_unhooks():
    model, pm, logits = _fake()
    lp = window_logprobs(model, [5, 6, 7, 8])
    np.testing.assert_allclose(lp, log_softmax(logits[:4].astype(np.float64), axis=-1))
    assert "execute" not in vars(pm)  # the instance's hook is gone


def test_window_logprobs_refuses_a_forward_that_dropped_positions():
    model, pm, _ = _fake(rows_per_token=0)
    with pytest.raises(RuntimeError, match=r"rows \[0\] for a prompt of 3 tokens"):
        window_logprobs(model, [1, 2, 3])
    assert "execute" not in vars(pm)
