"""The banded form: a shared ``W0`` per band of layers, a row scale and a correction per layer."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .._errors import ThetaFormatError
from ._identity import apply, reconstruct

__all__ = ["FamilyTheta", "LayerTheta"]


@dataclass(frozen=True, kw_only=True)
class LayerTheta:
    """One layer's part of a family bundle: row scale ``s [out]``, correction ``U [out, r]``, ``V [in, r]``."""

    s: np.ndarray
    U: np.ndarray
    V: np.ndarray

    def __post_init__(self) -> None:
        if self.s.ndim != 1 or self.U.ndim != 2 or self.V.ndim != 2:
            raise ThetaFormatError(
                f"LayerTheta needs s 1-D, U and V 2-D; got s{list(self.s.shape)}, "
                f"U{list(self.U.shape)}, V{list(self.V.shape)}"
            )
        if self.U.shape[0] != self.s.shape[0] or self.U.shape[1] != self.V.shape[1]:
            raise ThetaFormatError(
                f"LayerTheta shapes disagree: s{list(self.s.shape)}, U{list(self.U.shape)}, "
                f"V{list(self.V.shape)} (expected s[out], U[out, r], V[in, r])"
            )

    @property
    def rank(self) -> int:
        return int(self.U.shape[1])


@dataclass(frozen=True, kw_only=True)
class FamilyTheta:
    """A projection family stored as ``G`` shared blocks plus per-layer ``s``, ``U``, ``V``.

    The ``"banded"`` form. ``bands[l]`` is the band of layer ``l``; bands are contiguous and
    cover ``0..G-1``. Layers may have different correction ranks (format version 2).
    """

    form: ClassVar[str] = "banded"
    side: ClassVar[None] = None

    name: str
    shared: tuple[np.ndarray, ...]
    bands: tuple[int, ...]
    layers: tuple[LayerTheta, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shared", tuple(self.shared))
        object.__setattr__(self, "bands", tuple(int(b) for b in self.bands))
        object.__setattr__(self, "layers", tuple(self.layers))
        if not self.shared:
            raise ThetaFormatError(f"{self.name}: a family needs at least one shared block W0")
        if len(self.bands) != len(self.layers) or not self.layers:
            raise ThetaFormatError(
                f"{self.name}: {len(self.bands)} band entries for {len(self.layers)} layers"
            )
        expected = sorted(self.bands)
        if list(self.bands) != expected or set(self.bands) != set(range(len(self.shared))):
            raise ThetaFormatError(
                f"{self.name}: bands {list(self.bands)} are not contiguous bands covering "
                f"0..{len(self.shared) - 1}"
            )
        shape = self.shared[0].shape
        for b, W0 in enumerate(self.shared):
            if W0.ndim != 2 or W0.shape != shape:
                raise ThetaFormatError(
                    f"{self.name}: W0 of band {b} is {list(W0.shape)}, expected {list(shape)}"
                )
        out_dim, in_dim = shape
        bad = [
            i
            for i, t in enumerate(self.layers)
            if t.s.shape != (out_dim,) or t.V.shape[0] != in_dim
        ]
        if bad:
            raise ThetaFormatError(
                f"{self.name}: layers {bad} do not match W0 of shape {list(shape)} "
                f"(s must be [{out_dim}], V [{in_dim}, r])"
            )

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def blocks(self) -> int:
        """``G``, the number of bands."""
        return len(self.shared)

    @property
    def shape(self) -> tuple[int, int]:
        """``(out, in)`` of every weight of the family."""
        return self.shared[0].shape  # type: ignore[return-value]

    @property
    def rank(self) -> int:
        """The largest correction rank over the layers."""
        return max(t.rank for t in self.layers)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The correction rank of every layer."""
        return tuple(t.rank for t in self.layers)

    @property
    def dtype(self) -> np.dtype:
        """The storage dtype (of the first shared block)."""
        return self.shared[0].dtype

    def arrays(self) -> Iterator[np.ndarray]:
        """Every stored array: the shared blocks, then ``s``, ``U``, ``V`` of each layer."""
        yield from self.shared
        for t in self.layers:
            yield from (t.s, t.U, t.V)

    def factors(
        self, layer: int
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray, np.ndarray]:
        """The identity's parts ``(s, W0, U, V)`` of one layer."""
        t = self.layers[layer]
        return t.s, self.W0(layer), t.U, t.V

    def W0(self, layer: int) -> np.ndarray:
        """The shared block that ``layer`` uses."""
        return self.shared[self.bands[layer]]

    def reconstruct(self, layer: int) -> np.ndarray:
        """``W_eff`` of one layer, float32 (float64 for float64 bundles)."""
        t = self.layers[layer]
        return reconstruct(t.s, self.W0(layer), t.U, t.V)

    def apply(self, layer: int, x: np.ndarray) -> np.ndarray:
        """``y = s * (W0 x) + U (V^T x)`` for one layer, ``x`` of shape ``[..., in]``."""
        t = self.layers[layer]
        return apply(x, t.s, self.W0(layer), t.U, t.V)

    def stored_parameters(self) -> int:
        """Numbers stored: every ``W0`` once, plus ``s``, ``U``, ``V`` per layer."""
        shared = sum(int(W0.size) for W0 in self.shared)
        return shared + sum(int(t.s.size + t.U.size + t.V.size) for t in self.layers)

    def dense_parameters(self) -> int:
        """Numbers the dense family stores (``L * out * in``)."""
        out_dim, in_dim = self.shape
        return self.num_layers * out_dim * in_dim
