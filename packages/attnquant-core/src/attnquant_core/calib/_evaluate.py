"""Judged by function: perplexity, top-1 agreement and KL against a base model, in numpy.

Every checkpoint runs the same token windows through the layer-by-layer numpy forward; at
each position ``t < T - 1`` of a window the next token ``t + 1`` is predicted. Per
checkpoint:

* ``perplexity = exp(mean_t -log p(x_{t+1} | x_{<=t}))``;
* ``top1`` — the fraction of positions whose most likely next token is the base model's;
* ``kl`` — ``mean_t KL(p_base || p_model)`` in nats per token.

The base model's figures are its own (``top1 = 1``, ``kl = 0``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy.special import log_softmax

from ._forward import ModelSource, final_hidden, output_head

__all__ = ["EvalResult", "evaluate"]


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """One checkpoint's figures on the held-out windows."""

    checkpoint: str
    perplexity: float
    nll: float
    top1: float
    kl: float
    tokens: int

    @property
    def as_dict(self) -> dict[str, float | int | str]:
        return {
            "checkpoint": self.checkpoint,
            "perplexity": self.perplexity,
            "nll": self.nll,
            "top1_agreement": self.top1,
            "kl": self.kl,
            "tokens": self.tokens,
        }


def _logprobs(h: np.ndarray, head: np.ndarray) -> np.ndarray:
    """``log_softmax(h @ head.T)`` in float64, ``h`` ``[T, hidden]``."""
    return log_softmax((h @ head.T).astype(np.float64), axis=-1)


def evaluate(
    sources: Sequence[ModelSource],
    windows: np.ndarray,
    *,
    dtype: np.dtype | type = np.float32,
    batch: int = 8,
    progress: Callable[[str, int, int], None] | None = None,
) -> list[EvalResult]:
    """Perplexity, top-1 agreement with ``sources[0]`` and ``KL(sources[0] || source)`` per source.

    Parameters
    ----------
    sources : sequence of ModelSource
        The base model first, then the checkpoints to judge against it.
    windows : ndarray of shape (n, T)
        Token ids; every window contributes its ``T - 1`` next-token predictions.
    dtype : dtype, default=float32
        The forward's compute dtype (log-probabilities are taken in float64).
    progress : callable, optional
        ``progress(checkpoint, layers_done, num_layers)``.
    """
    windows = np.asarray(windows, dtype=np.int64)
    n, T = windows.shape
    if T < 2:
        raise ValueError(f"windows of {T} token(s) predict nothing; use at least 2")
    base_hidden = base_head = None
    results = []
    for source in sources:
        name = str(source.path)
        step = (lambda done, total, name=name: progress(name, done, total)) if progress else None
        hidden = final_hidden(source, windows, dtype=dtype, batch=batch, progress=step)
        head = output_head(source, dtype)
        if base_hidden is None:
            base_hidden, base_head = hidden, head
        nll = kl = agree = 0.0
        for i in range(n):
            lp = _logprobs(hidden[i, :-1], head)
            nll -= float(lp[np.arange(T - 1), windows[i, 1:]].sum())
            if source is sources[0]:
                agree += T - 1
                continue
            lp_base = _logprobs(base_hidden[i, :-1], base_head)
            kl += float(np.sum(np.exp(lp_base) * (lp_base - lp)))
            agree += float(np.count_nonzero(lp.argmax(-1) == lp_base.argmax(-1)))
        count = n * (T - 1)
        results.append(
            EvalResult(
                checkpoint=name,
                perplexity=math.exp(nll / count),
                nll=nll / count,
                top1=agree / count,
                kl=kl / count,
                tokens=count,
            )
        )
        if source is not sources[0]:
            del hidden
    return results
