"""Mistral and Qwen2 served through MAX for real, float32 on the CPU, against numpy.

Each tiny checkpoint (the tiny Llama's shape and weights; Qwen2 with q/k/v biases:
:func:`attnquant_max.testing.write_tiny_family`) is loaded through attnquant's architectures on
the stock graph, and the log-probabilities MAX gives a greedy continuation, teacher-forced, are
compared with attnquant-core's numpy reference (float64) of the same checkpoint. Mistral is the
tiny Llama's own stock graph under another name (the "stock" group: a cache hit); Qwen2 is MAX's
own graph, one compile (the "qwen2" group). A banded fit of Qwen2, rebuilt at load, is served by
the same graph. Qwen3's MAX graph crashes on a CPU and is refused there (test_families.py).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from attnquant_core import ThetaCheckpoint, decompose_checkpoint, open_checkpoint
from attnquant_core.llama_reference import llama_logits
from attnquant_max import greedy_generate, greedy_logprobs
from attnquant_max.testing import write_tiny_family

from .conftest import load_tiny

PROMPT = "hello world"


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def _reference(
    dense: Path, ids: list[int], continuation: list[int], theta: Path | None = None
) -> np.ndarray:
    """log p of each continuation token, teacher-forced, in the numpy reference (float64) of
    ``dense``, its projections replaced by ``theta``'s rebuilt ``W_eff`` where given."""
    ckpt = open_checkpoint(dense)
    state = {k: ckpt.get(k).astype(np.float64) for k in ckpt.keys()}
    if theta is not None:
        fit = ThetaCheckpoint.open(theta)
        for family in fit.families:
            for layer in range(fit.num_layers):
                key = f"model.layers.{layer}.{family}.weight"
                state[key] = fit.rebuild(family, layer).astype(np.float64)
    full = ids + continuation
    logp = _log_softmax(llama_logits(ckpt.config, state, full))
    return np.array([logp[len(ids) - 1 + i, t] for i, t in enumerate(continuation)])


def _check(dense: Path, theta: Path | None = None) -> None:
    """Serve ``theta`` (else ``dense``) and compare with the reference of what it holds."""
    with load_tiny(theta or dense) as model:
        ids = model.encode(PROMPT)
        continuation = greedy_generate(model, ids, 8)
        served = greedy_logprobs(model, ids, continuation).logprobs
    expected = _reference(dense, ids, continuation, theta)
    np.testing.assert_allclose(served, expected, rtol=0, atol=2e-4)


@pytest.mark.xdist_group("stock")
def test_mistral_is_the_llama_graph_under_its_name(tmp_path: Path) -> None:
    _check(write_tiny_family(tmp_path / "mistral", "MistralForCausalLM"))


@pytest.mark.xdist_group("qwen2")
def test_qwen2_dense_and_a_fit_rebuilt_at_load_match_the_numpy_reference(tmp_path: Path) -> None:
    dense = write_tiny_family(tmp_path / "qwen2", "Qwen2ForCausalLM")
    _check(dense)
    theta = tmp_path / "qwen2-g1"  # one W0 for both layers, a rank-4 correction each
    decompose_checkpoint(dense, theta, blocks=1, rank=4)
    _check(dense, theta)
