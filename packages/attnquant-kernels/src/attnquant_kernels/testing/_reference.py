"""The float64 references and the comparison of :mod:`attnquant_kernels.testing` (numpy only;
:func:`round_bf16` imports ``ml_dtypes``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

__all__ = [
    "BF16_RTOL",
    "F32_RTOL",
    "Report",
    "apply",
    "close",
    "gelu_tanh",
    "max_rel_error",
    "mlp_ref",
    "rank0",
    "round_bf16",
    "silu",
    "theta",
]

F32_RTOL = 1e-4  # the bar for float32
BF16_RTOL = 2e-2  # inputs and output rounded to bfloat16 (8-bit mantissa), float32 sums

#: Called by :func:`close` with (what, max relative error, bound) before it asserts.
Report = Callable[[str, float, float], None]


# ---------------------------------------------------------------- references (float64)


def theta(rng: np.random.Generator, out_dim: int, in_dim: int, rank: int) -> list[np.ndarray]:
    """(W0, s, U, V), float32, with outputs of order one."""
    W0 = rng.standard_normal((out_dim, in_dim)) / np.sqrt(max(in_dim, 1))
    s = 1.0 + 0.2 * rng.standard_normal(out_dim)
    U = 0.3 * rng.standard_normal((out_dim, rank))
    V = rng.standard_normal((in_dim, rank)) / np.sqrt(max(in_dim, 1))
    return [np.ascontiguousarray(a, dtype=np.float32) for a in (W0, s, U, V)]


def apply(x: np.ndarray, W0: np.ndarray, s: np.ndarray, U: np.ndarray, V: np.ndarray) -> np.ndarray:
    """The identity of docs/architecture.md in float64: s * (x W0^T) + (x V) U^T."""
    f = [a.astype(np.float64) for a in (x, W0, s, U, V)]
    return f[2] * (f[0] @ f[1].T) + (f[0] @ f[4]) @ f[3].T


def silu(z: np.ndarray) -> np.ndarray:
    """SiLU, ``z * sigmoid(z)``."""
    return z / (1.0 + np.exp(-z))


def gelu_tanh(z: np.ndarray) -> np.ndarray:
    """GELU in its tanh approximation (``gelu_pytorch_tanh``)."""
    return 0.5 * z * (1.0 + np.tanh(np.sqrt(2.0 / np.pi) * (z + 0.044715 * z**3)))


def mlp_ref(
    x: np.ndarray,
    gate: Sequence[np.ndarray],
    up: Sequence[np.ndarray],
    down: Sequence[np.ndarray],
    act: Callable[[np.ndarray], np.ndarray],
) -> np.ndarray:
    """``down(act(gate(x)) * up(x))``, each projection a ``(W0, s, U, V)`` through :func:`apply`."""
    return apply(act(apply(x, *gate)) * apply(x, *up), *down)


def round_bf16(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each array rounded to bfloat16 and back to float32 (imports ``ml_dtypes``)."""
    import ml_dtypes

    return [a.astype(ml_dtypes.bfloat16).astype(np.float32) for a in arrays]


def rank0(proj: Sequence[np.ndarray]) -> list[np.ndarray]:
    """``(W0, s, U, V)`` with zero-size ``U [N, 0]``, ``V [K, 0]``: the rank-0 form."""
    W0, s, U, V = proj
    return [W0, s, U[:, :0], V[:, :0]]


def max_rel_error(got: np.ndarray, ref: np.ndarray) -> float:
    """``max |got - ref|`` relative to the reference's largest entry (0 for an empty or zero one)."""
    scale = float(np.abs(ref).max()) if ref.size else 1.0
    return float(np.abs(got - ref).max() / scale) if ref.size and scale else 0.0


def close(
    got: np.ndarray, ref: np.ndarray, rtol: float, what: str, *, report: Report | None = None
) -> None:
    """Within ``rtol`` of the reference, elementwise and relative to its largest entry.

    ``report``, when given, receives ``(what, max_rel_error, rtol)`` before the assertion.
    """
    assert got.shape == ref.shape, what
    assert np.isfinite(got).all(), f"{what}: non-finite output"
    scale = float(np.abs(ref).max()) if ref.size else 1.0
    if report is not None:
        report(what, max_rel_error(got, ref), rtol)
    np.testing.assert_allclose(got, ref, rtol=rtol, atol=rtol * scale, err_msg=what)
