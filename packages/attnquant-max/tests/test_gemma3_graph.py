"""Gemma 3 text through attnquant's own MAX architecture, float32 on the CPU, one graph compiled.

A tiny Gemma 3 (one sliding-window layer, one global; window 512, shorter than the 700-token
prompt) served with echo: MAX's log-probabilities at every position against the numpy Gemma 3
reference (float64), which is exact against transformers. Past position 512 the sliding layer
sees only its window: a reference without the window differs there, so a plain causal mask
would fail this test. Cold, the graph compiles in a few minutes on two cores (the "gemma3"
xdist group); warm, from MAX's cache, in seconds.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from attnquant_core.gemma_reference import gemma3_logits
from attnquant_core.tiny_gemma import write_tiny_gemma3

pytestmark = [
    pytest.mark.xdist_group("gemma3"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

WINDOW = 512  # the CPU attention's sliding mask needs a window of at least its SIMD width
PROMPT = 700
#: Fixed sizes and seed: the compiled graph is cached across runs.
SIZES = {
    "num_hidden_layers": 2,
    "sliding_window": WINDOW,
    "sliding_window_pattern": 2,  # layer 0 sliding, layer 1 global
    "max_position_embeddings": 1024,
    "head_dim": 32,
    "query_pre_attn_scalar": 32,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
}


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(
        tmp_path_factory.mktemp("gemma3") / "dense", dtype="float32", tokenizer=True, **SIZES
    )


def test_echo_logprobs_match_the_numpy_reference_past_the_window(gemma3: Path) -> None:
    from attnquant_max._eval import load_echo_pipeline, window_logprobs

    config = json.loads((gemma3 / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    state = safetensors.numpy.load_file(str(gemma3 / "model.safetensors"))
    rng = np.random.default_rng(0)
    ids = [config["bos_token_id"], *(int(t) for t in rng.integers(3, 250, PROMPT - 1))]
    with load_echo_pipeline(gemma3, seq_len=PROMPT) as model:
        served = window_logprobs(model, ids)
    reference = _log_softmax(gemma3_logits(config, state, ids))
    delta = np.abs(served - reference).max(axis=-1)
    assert served.shape == reference.shape == (PROMPT, config["vocab_size"])
    assert delta.max() < 1e-3, (delta[:WINDOW].max(), delta[WINDOW:].max())
    assert (served.argmax(-1) == reference.argmax(-1)).all()
    unwindowed = _log_softmax(gemma3_logits({**config, "sliding_window": 0}, state, ids))
    assert np.abs(unwindowed - reference)[:WINDOW].max() < 1e-9  # the same inside the window
    assert np.abs(served - unwindowed)[WINDOW:].max() > 100 * delta.max()  # not past it
