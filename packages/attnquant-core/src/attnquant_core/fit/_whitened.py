"""Fitting for the output error: the whitened fits behind ``decompose --calibration``.

With a projection's input gram ``G = sum x x^T`` (:mod:`attnquant_core.calib`) and
``S S^T = G + delta I``, every fit minimises ``||(W - W_hat) S||_F`` (the error on the inputs
the projection really sees) instead of ``||W - W_hat||_F``:

* per-layer low rank: the truncated SVD of ``W S``, then ``V = S^{-T} V~`` (SVD-LLM);
* banded theta: ``W0`` the band mean as before, ``s`` by whitened least squares, the residual's
  truncated SVD whitened the same way;
* a shared basis on the output side: the band's basis from ``[W_1 S_1, ..., W_n S_n]``, each
  layer's coefficients ``B^T W_l`` (exact under each layer's own gram, Basis Sharing).

A projection the statistics do not cover is fit unwhitened. For the budget allocator, whose
objective sums squared errors over every layer of every family, each layer's whitened matrix
is scaled to carry its weight's energy (``c = ||W|| / ||W S||``): the split of the budget
between layers and families stays the weight-error one, while within a layer every rank unit
is spent where the inputs make it count.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..forms._banded import LayerTheta
from ..forms._identity import compute_dtype
from ..io._calibration import CalibrationError, CalibrationStats, gram_key, read_stats
from ._decompose import DEFAULT_SVD, LayerFit, SVDOptions
from ._svd import EXACT_MAX_DIM, truncated_svd
from ._whiten import (
    DEFAULT_DAMPING,
    Whitening,
    row_scale_whitened,
    whitened_row_scale,
    whitening,
)

__all__ = [
    "Calibration",
    "WhiteningStore",
    "as_calibration",
    "fit_layer_whitened",
    "scaled_whitening",
    "whitened_residual",
]


#: Bytes of whitening factors a :class:`WhiteningStore` keeps in memory between uses.
STORE_MEMORY_BYTES = 64 << 20


class WhiteningStore:
    """Every distinct gram's whitening factor, computed once, with memory bounded.

    The budget fit asks for a layer's whitening once per candidate form (the low-rank spectra,
    every banded ``G``, the shared-basis passes), then again when it fits the chosen form, one
    family at a time; q/k/v of a layer share one input gram (stored under each key), and so do
    gate/up. Holding every factor would cost a model's worth of ``[in, in]`` float64 arrays
    (512 MiB each at ``in = 8192``), and a small cache would miss on every pass over a family's
    layers. So each factor is computed once, at its first use, keyed by the gram's key and the
    sha256 of its stored bytes (equal grams under other keys share the factor): factors of
    together at most ``memory_bytes`` stay in memory (least recently used first out), and any
    other is written, the first time it leaves memory, to a private temporary directory (in
    ``directory``, default the system's), from which a later use reads it back: a file read of
    ``8 n^2`` bytes instead of reading, checking and factoring the gram again. Peak memory is
    thus the factor in use (and its making, :func:`attnquant_core.calib.whitening`) plus
    ``memory_bytes``; the disk holds at most every distinct factor (float64: twice a float32
    statistics file less its duplicates), removed when the store is closed or collected.
    A factor read back is the very array computed (bit for bit), read-only like every factor
    the store hands out.
    """

    def __init__(
        self, memory_bytes: int = STORE_MEMORY_BYTES, directory: str | Path | None = None
    ) -> None:
        self.memory_bytes = int(memory_bytes)
        self.directory = directory
        self._digest: dict[str, str] = {}  # gram key -> content digest
        self._held: OrderedDict[str, Whitening] = OrderedDict()  # digest -> factor, LRU
        self._held_bytes = 0
        self._spilled: dict[str, tuple[int, float, bool]] = {}  # digest -> (file, delta, eigen?)
        self._dir: Path | None = None
        self._finalizer: weakref.finalize | None = None
        #: Factorisations made and factors read back from disk (what the tests count).
        self.computed = 0
        self.loaded = 0

    def get(
        self,
        key: str,
        read: Callable[[], tuple[np.ndarray, str]],
        *,
        damping: float,
        where: str,
    ) -> Whitening:
        """The whitening of gram ``key``; ``read()`` gives the gram and its digest (called only
        the first time ``key`` is asked for)."""
        digest = self._digest.get(key)
        if digest is None:
            G, digest = read()
            self._digest[key] = digest
            if not self._has(digest):
                white = whitening(G, damping=damping, where=where, overwrite=True)
                del G
                self.computed += 1
                _read_only(white)
                self._keep(digest, white)
                return white
            del G
        white = self._held.get(digest)
        if white is not None:
            self._held.move_to_end(digest)
            return white
        white = self._load(digest)
        self._keep(digest, white)
        return white

    def close(self) -> None:
        """Drop every factor and remove the directory of spilled ones."""
        self._held.clear()
        self._held_bytes = 0
        self._spilled.clear()
        self._digest.clear()
        if self._finalizer is not None:
            self._finalizer()
        self._dir = None

    def _has(self, digest: str) -> bool:
        return digest in self._held or digest in self._spilled

    def _keep(self, digest: str, white: Whitening) -> None:
        """Hold ``white`` in memory if it fits, evicting (spilling) the least recent first."""
        size = _nbytes(white)
        if size > self.memory_bytes:
            self._spill(digest, white)
            return
        while self._held and self._held_bytes + size > self.memory_bytes:
            old, held = self._held.popitem(last=False)
            self._held_bytes -= _nbytes(held)
            self._spill(old, held)
        self._held[digest] = white
        self._held_bytes += size

    def _path(self, index: int, part: str) -> Path:
        assert self._dir is not None
        return self._dir / f"{index}.{part}.npy"

    def _spill(self, digest: str, white: Whitening) -> None:
        if digest in self._spilled:
            return
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="attnquant-whitening-", dir=self.directory))
            self._finalizer = weakref.finalize(self, shutil.rmtree, self._dir, True)
        index = len(self._spilled)
        if white.eigen is None:
            np.save(self._path(index, "factor"), white.factor)
        else:  # factor = basis * eigen, recomputed on reading (the same products, bit for bit)
            assert white.basis is not None
            np.save(self._path(index, "basis"), white.basis)
            np.save(self._path(index, "eigen"), white.eigen)
        self._spilled[digest] = (index, white.delta, white.eigen is not None)

    def _load(self, digest: str) -> Whitening:
        index, delta, eigen = self._spilled[digest]
        self.loaded += 1
        if not eigen:
            white = Whitening(factor=np.load(self._path(index, "factor")), delta=delta)
        else:
            basis = np.load(self._path(index, "basis"))
            values = np.load(self._path(index, "eigen"))
            white = Whitening(factor=basis * values, delta=delta, eigen=values, basis=basis)
        _read_only(white)
        return white


def _nbytes(white: Whitening) -> int:
    return sum(a.nbytes for a in (white.factor, white.eigen, white.basis) if a is not None)


def _read_only(white: Whitening) -> None:
    for a in (white.factor, white.eigen, white.basis):
        if a is not None:
            a.flags.writeable = False


@dataclass(frozen=True, kw_only=True)
class Calibration:
    """Calibration statistics as the fits use them: a whitening per projection, on demand.

    Each distinct gram is factored once for the life of the object (one decomposition, when
    made from a path by :func:`as_calibration`), in a :class:`WhiteningStore`.
    """

    stats: CalibrationStats
    damping: float = DEFAULT_DAMPING
    #: Recorded over the statistics' own fields (e.g. the text a same-pass calibration read).
    data: Mapping[str, object] | None = None
    #: Per weight key, what a unit of its squared output error weighs in a budget's allocation
    #: (``alpha`` of :mod:`attnquant_core.calib._sensitivity`); None: the ``global`` allocation.
    error_weights: Mapping[str, float] | None = None
    store: WhiteningStore = field(
        default_factory=WhiteningStore, init=False, repr=False, compare=False
    )

    def whitening(self, key: str, in_features: int) -> Whitening | None:
        """The whitening of weight ``key``'s input, or None when the statistics lack it."""
        if key not in self.stats:
            return None
        if self.stats.shape(key) != (in_features, in_features):
            self.stats.gram(key, in_features=in_features)  # raises: the statistics' error
        gkey = gram_key(key)

        def read() -> tuple[np.ndarray, str]:
            got = self.stats.read_gram(key, in_features=in_features)
            assert got is not None
            return got

        white = self.store.get(
            gkey, read, damping=self.damping, where=f"{self.stats.path}: {gkey!r}"
        )
        if self.error_weights is None:
            return white
        if key not in self.error_weights:
            raise CalibrationError(
                f"{self.stats.path}: no sensitivity for {key!r}; measure them with these "
                f"statistics (`attnquant calibrate --sensitivity`)"
            )
        return dataclasses.replace(white, error_weight=float(self.error_weights[key]))

    def getter(self, keys: Sequence[str], in_features: int) -> Callable[[int], Whitening | None]:
        """``layer -> whitening`` for a family whose weight keys are ``keys``."""
        return lambda layer: self.whitening(keys[layer], in_features)

    def record(self, keys: Sequence[str]) -> dict[str, object]:
        """What the manifest says of the statistics used: digest, tokens, damping, coverage."""
        record: dict[str, object] = {
            "objective": "output error ||(W - W_hat) X|| over the calibration inputs (whitened "
            "fits; 'errors'/'error' stay the weight error, 'output_errors' and a budget's "
            "'predicted_error' are of the output)",
            "path": str(self.stats.path),
            "digest": self.stats.digest,
            "tokens": self.stats.tokens,
            "damping": self.damping,
            "whitened": sum(1 for k in keys if k in self.stats),
            "unwhitened": sum(1 for k in keys if k not in self.stats),
        }
        if self.data:
            record.update(self.data)
        return record


def as_calibration(
    calibration: str | Path | CalibrationStats | Calibration | None,
    damping: float = DEFAULT_DAMPING,
) -> Calibration | None:
    """A :class:`Calibration` from a path, opened statistics, or one already made."""
    if calibration is None or isinstance(calibration, Calibration):
        return calibration
    stats = calibration if isinstance(calibration, CalibrationStats) else read_stats(calibration)
    return Calibration(stats=stats, damping=damping)


def scaled_whitening(W: np.ndarray, white: Whitening) -> tuple[np.ndarray, float]:
    """``(c W S, c)`` with ``c = ||W|| / ||W S||``: the whitened matrix carrying ``W``'s energy;
    or ``c = sqrt(white.error_weight)`` where the whitening carries a weight (the
    ``sensitivity`` allocation: squared output errors weighed by what they cost the model)."""
    M = white.whiten(W)
    if white.error_weight is not None:
        c = math.sqrt(white.error_weight)
    else:
        norm_w = float(np.linalg.norm(np.asarray(W, np.float64)))
        norm_m = float(np.linalg.norm(M))
        c = norm_w / norm_m if norm_m > 0 else 1.0
    M *= c
    return M, c


def whitened_residual(
    W: np.ndarray, W0: np.ndarray, white: Whitening, store: np.dtype
) -> np.ndarray:
    """``c (W - diag(s) W0) S`` with ``s`` the whitened least-squares scale rounded to ``store``
    and ``c = ||W|| / ||W S||``: the banded residual the budget's spectra see."""
    Wd, W0d = np.asarray(W, np.float64), np.asarray(W0, np.float64)
    s = whitened_row_scale(Wd, W0d, white).astype(store).astype(np.float64)
    _, c = scaled_whitening(Wd, white)
    return c * white.whiten(Wd - s[:, None] * W0d)


def fit_layer_whitened(
    W: np.ndarray,
    W0: np.ndarray | None,
    rank: int,
    white: Whitening,
    *,
    dtype: np.dtype,
    svd: SVDOptions = DEFAULT_SVD,
    seed: Sequence[int] = (),
    exact_max_dim: int = EXACT_MAX_DIM,
    sketch_rank: int | None = None,
) -> tuple[LayerFit, float]:
    """:func:`fit_layer` for the output error; ``W0=None`` fits per-layer low rank (``s`` empty).

    Returns the fit (``error`` is the relative *weight* error of what is stored, as for
    :func:`fit_layer`, ``singular_values`` the whitened ones) and the relative output error
    ``||(W - W_eff) S|| / ||W S||``.
    """
    cdt = compute_dtype(np.result_type(W.dtype, dtype))
    Wd = np.asarray(W, np.float64)
    Ww = white.whiten(Wd)  # W S, made once: the scale, the output norm (and R S when W0=None)
    out_norm = float(np.linalg.norm(Ww))
    if W0 is None:
        s = np.zeros(Wd.shape[0], dtype)  # unused by the low-rank form
        R = Wd
        Rw = Ww
    else:
        W0d = np.asarray(W0, np.float64)
        s = row_scale_whitened(Ww, white.whiten(W0d)).astype(dtype)
        del Ww
        R = Wd - s.astype(np.float64)[:, None] * W0d
        Rw = white.whiten(R)
    low = truncated_svd(
        Rw.astype(cdt),
        rank if sketch_rank is None else max(sketch_rank, rank),
        n_oversamples=svd.n_oversamples,
        n_iter=svd.n_iter,
        random_state=np.random.default_rng([svd.random_state, *seed]),
        exact_max_dim=exact_max_dim,
    )
    U = low.U[:, :rank].astype(dtype)
    V = white.unwhiten(np.asarray(low.V[:, :rank], np.float64)).astype(dtype)
    diff = R - U.astype(np.float64) @ V.astype(np.float64).T if rank else R
    norm = float(np.linalg.norm(Wd))
    error = float(np.linalg.norm(diff)) / norm if norm > 0 else 0.0
    out_error = float(np.linalg.norm(white.whiten(diff))) / out_norm if out_norm > 0 else 0.0
    return LayerFit(LayerTheta(s=s, U=U, V=V), error, norm, low.S[:rank]), out_error
