"""The one formula of the project: ``W_eff = diag(s) W0 + U V^T``, ``y = s * (W0 x) + U (V^T x)``."""

from __future__ import annotations

import numpy as np

from .._errors import ThetaFormatError

__all__ = ["apply", "compute_dtype", "reconstruct"]


def compute_dtype(dtype: np.dtype | type) -> np.dtype:
    """The dtype numerics run in: float64 stays float64, every other float computes in float32."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float64) if dtype == np.float64 else np.dtype(np.float32)


def _f(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    return np.asarray(a, dtype=dtype)


def _dtype_of(*arrays: np.ndarray | None) -> np.dtype:
    return compute_dtype(np.result_type(*(a.dtype for a in arrays if a is not None)))


def reconstruct(
    s: np.ndarray | None, W0: np.ndarray | None, U: np.ndarray, V: np.ndarray
) -> np.ndarray:
    """The effective weight ``diag(s) @ W0 + U @ V.T`` (``[out, in]``), in float32 or float64.

    ``s`` and ``W0`` may both be ``None`` (the part is absent, as in the low-rank and
    shared-basis forms): then the weight is ``U @ V.T``.
    """
    if (s is None) != (W0 is None):
        raise ThetaFormatError("reconstruct needs s and W0 both given or both None")
    dtype = _dtype_of(s, W0, U, V)
    if s is None or W0 is None:
        return _f(U, dtype) @ _f(V, dtype).T
    W = _f(s, dtype)[:, np.newaxis] * _f(W0, dtype)
    if U.shape[1]:
        W += _f(U, dtype) @ _f(V, dtype).T
    return W


def apply(
    x: np.ndarray, s: np.ndarray | None, W0: np.ndarray | None, U: np.ndarray, V: np.ndarray
) -> np.ndarray:
    """The identity on activations, ``y = s * (W0 x) + U (V^T x)``, for ``x`` of shape ``[..., in]``.

    Never forms the dense ``[out, in]`` matrix; computes in float32 (float64 for float64 input).
    ``s`` and ``W0`` may both be ``None`` (absent): then ``y = U (V^T x)``.
    """
    if (s is None) != (W0 is None):
        raise ThetaFormatError("apply needs s and W0 both given or both None")
    if s is None or W0 is None:
        dtype = _dtype_of(x, U, V)
        return (_f(x, dtype) @ _f(V, dtype)) @ _f(U, dtype).T
    dtype = _dtype_of(x, s, W0)
    x = _f(x, dtype)
    y = (x @ _f(W0, dtype).T) * _f(s, dtype)
    if U.shape[1]:
        y += (x @ _f(V, dtype)) @ _f(U, dtype).T
    return y
