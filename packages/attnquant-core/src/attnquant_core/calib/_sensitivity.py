"""How much each projection's output error costs the model's predictions, measured.

A budget allocated by whitened error alone compares ``||(W - W_hat) X||^2`` across projections
whose errors matter very differently to the next-token distribution (a projection of an early
layer feeding every later one, the residual stream's scale, q/k against down_proj). This
measures, per projection ``k``, the KL cost of a unit of its squared output error on the
calibration windows: ``k`` alone is replaced by its whitened truncation (SVD-LLM's) at the rank
a uniform parameter ratio ``probe`` gives it, every other weight stays dense, and

    ``alpha_k = KL(dense || probed) / e_k``

with ``KL`` the mean over the windows' next-token predictions (nats per token) and ``e_k``
the mean squared output error per token of the truncation, ``||(W - W_hat) S||^2 / tokens``
(``S S^T`` the damped gram). ``decompose --budget --allocation sensitivity`` then weighs every
rank unit's whitened error drop by ``alpha_k`` (:class:`~attnquant_core.fit._whitened.Calibration`'s
``error_weights``): the allocation minimises the KL predicted by adding the projections' costs.

The probe does not depend on the budget (on the demo, the weights measured at ratio 0.5 and
at 0.8 gave allocations at budget 0.8 within 0.0001 nats of held-out KL of each other), so the
weights are measured once, with the
statistics (``attnquant calibrate --sensitivity`` writes them beside the statistics file, in
:func:`sensitivity_path`), or in the pass of ``decompose --calibration-data``.

Cost: one dense forward, then per projection the layers from its own to the last and the
output head over every window: about ``3.5 L`` forwards of an ``L``-layer model (7 projections
a layer, each running half the layers on average). Memory: three hidden-state arrays
``[n, T, hidden]`` and the dense log-probabilities ``[n, T - 1, vocab]`` (float32) when they
fit :data:`DENSE_LOGPROBS_BYTES`, else recomputed per projection.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from ..fit._whiten import whitened_svd
from ..fit._whitened import Calibration, as_calibration
from ..io._calibration import CalibrationError, CalibrationStats
from ..io._sensitivity import (
    PROBE_RATIO,
    SENSITIVITY_SUFFIX,
    Sensitivity,
    read_sensitivity,
    sensitivity_path,
)
from ._data import windows_digest
from ._evaluate import _logprobs
from ._forward import (
    LAYER_PROJECTIONS,
    ModelSource,
    _batches,
    _embedded,
    _layer_weights,
    final_hidden,
    output_head,
)

__all__ = [
    "PROBE_RATIO",
    "SENSITIVITY_SAMPLES",
    "SENSITIVITY_SUFFIX",
    "Sensitivity",
    "measure_sensitivity",
    "read_sensitivity",
    "sensitivity_path",
    "with_sensitivity",
]

#: Windows measured on, at most (the first of those given): on the demo, 8 windows of 512
#: gave weights within 25% of 27 windows' (log-correlation 0.999), in a third of the time.
SENSITIVITY_SAMPLES = 16
#: Largest dense log-probabilities ``[n, T - 1, vocab]`` (float32) held between projections.
DENSE_LOGPROBS_BYTES = 512 << 20


def probe_rank(shape: tuple[int, int], probe: float) -> int:
    """The rank a uniform parameter ratio ``probe`` gives an ``[out, in]`` matrix."""
    out_dim, in_dim = shape
    return min(int(probe * out_dim * in_dim / (out_dim + in_dim)), out_dim, in_dim)


def measure_sensitivity(
    source: ModelSource,
    windows: np.ndarray,
    calibration: str | Path | CalibrationStats | Calibration,
    *,
    probe: float = PROBE_RATIO,
    samples: int | None = SENSITIVITY_SAMPLES,
    dtype: np.dtype | type = np.float32,
    batch: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> Sensitivity:
    """Measure every projection's ``alpha`` on the first ``samples`` of ``windows`` ``[n, T]``
    (None: all of them; see the module docstring).

    ``calibration`` (a statistics file, opened or not) whitens the probes (each projection
    needs statistics). ``progress(done,
    total)`` after each projection. A projection whose probe leaves no output error (its rank
    is at most the probe's) gets the largest ``alpha`` measured.
    """
    calibration = as_calibration(calibration)
    assert calibration is not None
    if not 0.0 < probe < 1.0:
        raise CalibrationError(f"probe={probe!r}: a parameter ratio in (0, 1)")
    windows = np.asarray(windows, dtype=np.int64)[:samples]
    n, T = windows.shape
    if T < 2:
        raise CalibrationError(f"windows of {T} token(s) predict nothing; use at least 2")
    dt = np.dtype(dtype)
    head = output_head(source, dt)
    norm = np.asarray(source.get(f"{source.prefix}.norm.weight"), dtype=dt)
    decoder = source.decoder
    tables = decoder.tables(T, dt)
    L = source.num_layers
    tokens = n * (T - 1)

    def logprobs(h: np.ndarray, i: int) -> np.ndarray:
        return _logprobs(h[i, :-1], head)

    dense_final = final_hidden(source, windows, dtype=dt, batch=batch)
    held = n * (T - 1) * head.shape[0] * 4 <= DENSE_LOGPROBS_BYTES
    dense_lp = [logprobs(dense_final, i).astype(np.float32) for i in range(n)] if held else None

    def kl_of(h_final: np.ndarray) -> float:
        total = 0.0
        for i in range(n):
            base = dense_lp[i] if dense_lp is not None else logprobs(dense_final, i)
            base = np.asarray(base, np.float64)
            total += float(np.sum(np.exp(base) * (base - logprobs(h_final, i))))
        return total / tokens

    def run(h: np.ndarray, layer: int, weights: Mapping[str, np.ndarray]) -> np.ndarray:
        stem = f"{source.prefix}.layers.{layer}"
        out = np.empty_like(h)
        for rows in _batches(len(h), batch):
            out[rows] = decoder.layer(
                weights.__getitem__, weights.__contains__, stem, h[rows], layer, tables, None
            )
        return out

    kl: dict[str, float] = {}
    error2: dict[str, float] = {}
    h = _embedded(source, windows, dt)  # the dense input of the current layer
    total, done = L * len(LAYER_PROJECTIONS), 0
    for layer in range(L):
        dense_w = _layer_weights(source, layer, dt)
        for name in LAYER_PROJECTIONS:
            key = f"{source.prefix}.layers.{layer}.{name}.weight"
            W = np.asarray(source.get(key), np.float64)
            white = calibration.whitening(key, W.shape[1])
            if white is None:
                raise CalibrationError(f"{calibration.stats.path}: no statistics for {key!r}")
            U, V, sigma = whitened_svd(W, white, probe_rank(W.shape, probe))
            error2[key] = float(np.sum(sigma[U.shape[1] :] ** 2)) / calibration.stats.tokens
            probed = dict(dense_w)
            probed[key] = (U @ V.T).astype(dt)
            hp = run(h, layer, probed)
            del probed, U, V
            for later in range(layer + 1, L):
                hp = run(hp, later, _layer_weights(source, later, dt))
            kl[key] = kl_of(decoder.final_norm(hp, norm))
            del hp
            done += 1
            if progress is not None:
                progress(done, total)
        h = run(h, layer, dense_w)
        del dense_w
    tiny = np.finfo(np.float64).tiny
    weights_of: dict[str, float] = {k: kl[k] / error2[k] for k in kl if error2[k] > tiny}
    top = max(weights_of.values(), default=1.0)
    weights_of = {k: weights_of.get(k, top) for k in kl}
    return Sensitivity(
        weights=weights_of,
        kl=kl,
        error2=error2,
        probe=probe,
        tokens=int(windows.size),
        windows_digest=windows_digest(windows),
        stats_digest=calibration.stats.digest,
    )


def with_sensitivity(
    source: ModelSource,
    windows: np.ndarray,
    calibration: Calibration,
    batch: int = 8,
    progress: Callable[[str, int, int], None] | None = None,
    record: dict | None = None,
) -> Calibration:
    """``calibration`` with every projection's sensitivity measured on ``windows`` as its
    ``error_weights`` (``decompose --calibration-data --allocation sensitivity``); what was
    measured goes into ``record["sensitivity"]``."""
    step = None if progress is None else lambda d, t: progress("measuring sensitivity", d, t)
    sens = measure_sensitivity(source, windows, calibration, batch=batch, progress=step)
    if record is not None:
        record["sensitivity"] = sens.record()
    return dataclasses.replace(calibration, error_weights=sens.weights)
