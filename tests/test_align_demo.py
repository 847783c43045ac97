"""The demo model aligned (--align) is the same function: logits through the numpy reference."""

from __future__ import annotations

import numpy as np
import pytest

from attnquant_core import open_checkpoint
from attnquant_core.fit import align_checkpoint, load_align_transforms, unalign_state
from attnquant_core.llama_reference import llama_logits

# '<|bos|>def ' followed by the model card's greedy continuation, then 'import os\n' ids.
PROMPT = [0, 316, 223, 399, 10, 72, 303, 270, 363, 899, 273, 623, 725, 595, 201, 376]
# MODEL_CARD.md: prompt 'def ' (ids [0, 316, 223]), greedy tokens from plain PyTorch.
CARD_PROMPT = [0, 316, 223]
CARD_GREEDY = [399, 10, 72, 303, 270, 363, 899, 273, 623, 376, 298, 432]


@pytest.fixture(scope="module")
def demo_state(demo):
    ckpt = open_checkpoint(demo)
    return ckpt.config, {k: ckpt.get(k) for k in ckpt.keys()}


@pytest.fixture(scope="module")
def aligned_demo(demo, tmp_path_factory):
    out = tmp_path_factory.mktemp("align") / "demo-aligned"
    report = align_checkpoint(demo, out, blocks=1, rounds=3)
    ckpt = open_checkpoint(out)
    return report, {k: ckpt.get(k) for k in ckpt.keys()}


def test_reference_reproduces_the_model_card_greedy_tokens(demo_state):
    config, state = demo_state
    ids = list(CARD_PROMPT)
    for _ in CARD_GREEDY:
        ids.append(int(llama_logits(config, state, ids, dtype=np.float32)[-1].argmax()))
    assert ids[len(CARD_PROMPT) :] == CARD_GREEDY


def test_aligned_demo_has_the_same_logits(demo_state, aligned_demo):
    config, state = demo_state
    _, aligned = aligned_demo
    assert sorted(aligned) == sorted(state)
    assert all(aligned[k].dtype == np.float32 == state[k].dtype for k in state)
    moved = [k for k in state if not np.array_equal(aligned[k], state[k])]
    assert len(moved) >= 6 * 7 - 3  # every projection but perhaps the reference layer's MLP
    # float64 forward: only the float32 rounding of the rotated weights is left.
    ref = llama_logits(config, state, PROMPT)
    got = llama_logits(config, aligned, PROMPT)
    scale = float(np.abs(ref).max())
    assert np.abs(got - ref).max() <= 1e-6 * scale
    # float32 forward, as the model runs: agreement to float32 round-off.
    ref32 = llama_logits(config, state, PROMPT, dtype=np.float32)
    got32 = llama_logits(config, aligned, PROMPT, dtype=np.float32)
    assert np.abs(got32 - ref32).max() <= 1e-5 * scale
    assert np.array_equal(got32.argmax(-1), ref32.argmax(-1))


def test_aligned_demo_is_closer_to_its_band_mean_and_reversible(demo_state, aligned_demo):
    _, state = demo_state
    report, aligned = aligned_demo
    for name, (before, after) in report.distances.items():
        assert after < before, name
    restored = unalign_state(aligned, load_align_transforms(report.path))
    for key in state:
        np.testing.assert_allclose(restored[key], state[key], rtol=0, atol=1e-6)
