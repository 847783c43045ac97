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

__all__ = ["EvalResult", "EvalTally", "evaluate"]


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


@dataclass
class EvalTally:
    """Running sums of one checkpoint's figures, window by window, from any forward.

    :func:`evaluate` feeds it the numpy forward's log-probabilities; ``attnquant_max`` feeds
    it MAX's. ``add`` takes one window's ``[T - 1, vocab]`` next-token log-probabilities.
    """

    checkpoint: str
    nll: float = 0.0
    kl: float = 0.0
    agree: float = 0.0
    count: int = 0

    def add(self, lp: np.ndarray, targets: np.ndarray, lp_base: np.ndarray | None) -> None:
        """One window: ``lp[t]`` predicts ``targets[t]``; ``lp_base`` is the base model's
        (None: this checkpoint is the base, ``top1 = 1`` and ``kl = 0`` by definition)."""
        n = len(targets)
        self.nll -= float(lp[np.arange(n), targets].sum())
        self.count += n
        if lp_base is None:
            self.agree += n
            return
        self.kl += float(np.sum(np.exp(lp_base) * (lp_base - lp)))
        self.agree += float(np.count_nonzero(lp.argmax(-1) == lp_base.argmax(-1)))

    def result(self) -> EvalResult:
        count = max(self.count, 1)
        return EvalResult(
            checkpoint=self.checkpoint,
            perplexity=math.exp(self.nll / count),
            nll=self.nll / count,
            top1=self.agree / count,
            kl=self.kl / count,
            tokens=self.count,
        )


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
        tally = EvalTally(name)
        for i in range(n):
            lp = _logprobs(hidden[i, :-1], head)
            is_base = source is sources[0]
            lp_base = None if is_base else _logprobs(base_hidden[i, :-1], base_head)
            tally.add(lp, windows[i, 1:], lp_base)
        results.append(tally.result())
        if source is not sources[0]:
            del hidden
    return results
