"""A banded candidate's error curve, shared by the float and the NVFP4 ``W0`` (budget spectra).

Both banded candidates of a budget fit (``W0`` the band mean, :mod:`attnquant_core.fit._spectra`;
its 4-bit round trip, :mod:`attnquant_core.fit._spectra_nvfp4`) measure the same thing: per
layer, the rank gains of the residual ``W - diag(s) W0`` against the band's ``W0``, whitened
where the layer has statistics, and the total squared residual.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..forms._bands import band_of_layers
from ._decompose import residual
from ._whiten import Whitening
from ._whitened import whitened_residual

__all__ = ["band_residual_gains"]


def band_residual_gains(
    get: Callable[[int], np.ndarray],
    white: Callable[[int], Whitening | None] | None,
    num_layers: int,
    store: np.dtype,
    G: int,
    band_W0: Callable[[int, list[int]], np.ndarray],
    gains: Callable[[np.ndarray, Sequence[int]], np.ndarray],
    *,
    seed: Callable[[int, int], Sequence[int]],
    on_layer: Callable[[], None] | None = None,
) -> tuple[list[np.ndarray], float]:
    """Per layer, ``gains(R, seed(band, layer))`` of its residual ``R`` against its band's
    ``W0 = band_W0(band, layers)`` (``s`` least squares, rounded to ``store``; whitened where
    ``white(layer)`` gives a factor), in layer order, and the total ``sum ||R||^2``.

    One layer's residual and whitening are held at a time; ``on_layer()`` after each.
    """
    bands = band_of_layers(num_layers, G)
    curves: list[np.ndarray] = []
    base = 0.0
    for b in range(G):
        layers = [i for i in range(num_layers) if bands[i] == b]
        W0 = band_W0(b, layers)
        for layer in layers:
            w = None  # the last layer's factor goes before this one's is made
            w = white(layer) if white is not None else None
            if w is None:
                _, R = residual(get(layer), W0, store)
            else:
                R = whitened_residual(get(layer), W0, w, store)
            base += float(np.sum(np.square(R, dtype=np.float64)))
            curves.append(gains(R, seed(b, layer)))
            del R
            if on_layer is not None:
                on_layer()
        del W0
    return curves, base
