"""The other forms of the one identity: per-layer low rank, and a shared basis per band.

Both are ``y = s * (W0 x) + U (V^T x)`` with parts absent or shared:

* ``"lowrank"``: no ``s``, no ``W0``; per layer ``U_l [out, r_l]``, ``V_l [in, r_l]``, so
  ``W_l ~ U_l V_l^T`` (plain truncated SVD of each weight).
* ``"shared_basis"``, ``side="in"``: per band ``b`` a basis ``B_b [in, k_b]`` shared by the
  band's layers, per layer ``U_l [out, k_b]``: ``W_l ~ U_l B_b^T`` (``V = B_b``).
* ``"shared_basis"``, ``side="out"``: per band ``B_b [out, k_b]``, per layer ``V_l [in, k_b]``:
  ``W_l ~ B_b V_l^T`` (``U = B_b``).

Every family type offers the same duck-typed protocol as :class:`~attnquant_core.FamilyTheta`:
``name, form, num_layers, shape, rank, ranks, factors(layer), reconstruct(layer),
apply(layer, x), stored_parameters(), dense_parameters()``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import ClassVar, Literal

import numpy as np

from .._errors import ThetaFormatError
from ._identity import apply, reconstruct

__all__ = ["SIDES", "LowRankFamily", "SharedBasisFamily", "check_bands"]

#: The sides a shared basis may sit on.
SIDES: tuple[str, ...] = ("in", "out")


def check_bands(name: str, bands: Sequence[int], num_bands: int, num_layers: int) -> None:
    """Refuse a band map that is not contiguous, in order and covering ``0..num_bands-1``."""
    if len(bands) != num_layers or not num_layers:
        raise ThetaFormatError(f"{name}: {len(bands)} band entries for {num_layers} layers")
    if list(bands) != sorted(bands) or set(bands) != set(range(num_bands)):
        raise ThetaFormatError(
            f"{name}: bands {list(bands)} are not contiguous bands covering 0..{num_bands - 1}"
        )


def _bad_2d(arrays: Sequence[np.ndarray]) -> list[int]:
    return [i for i, a in enumerate(arrays) if a.ndim != 2]


@dataclass(frozen=True, kw_only=True)
class LowRankFamily:
    """A family stored as per-layer ``U_l [out, r_l]``, ``V_l [in, r_l]``: ``W_l ~ U_l V_l^T``.

    The identity with ``s`` and ``W0`` absent; ranks may differ per layer.
    """

    form: ClassVar[str] = "lowrank"
    side: ClassVar[None] = None
    bands: ClassVar[None] = None
    blocks: ClassVar[None] = None

    name: str
    U: tuple[np.ndarray, ...]
    V: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "U", tuple(self.U))
        object.__setattr__(self, "V", tuple(self.V))
        if not self.U or len(self.U) != len(self.V):
            raise ThetaFormatError(
                f"{self.name}: a low-rank family needs one U and one V per layer; got "
                f"{len(self.U)} U and {len(self.V)} V"
            )
        bad = sorted(set(_bad_2d(self.U)) | set(_bad_2d(self.V)))
        if bad:
            raise ThetaFormatError(f"{self.name}: layers {bad} have U or V that is not 2-D")
        out_dim, in_dim = self.U[0].shape[0], self.V[0].shape[0]
        bad = [
            i
            for i, (U, V) in enumerate(zip(self.U, self.V, strict=True))
            if U.shape[0] != out_dim or V.shape[0] != in_dim or U.shape[1] != V.shape[1]
        ]
        if bad:
            raise ThetaFormatError(
                f"{self.name}: layers {bad} do not fit U [{out_dim}, r], V [{in_dim}, r] "
                f"(layer 0's shape); got "
                + ", ".join(f"U{list(self.U[i].shape)} V{list(self.V[i].shape)}" for i in bad)
            )

    @property
    def num_layers(self) -> int:
        return len(self.U)

    @property
    def shape(self) -> tuple[int, int]:
        """``(out, in)`` of every weight of the family."""
        return int(self.U[0].shape[0]), int(self.V[0].shape[0])

    @property
    def ranks(self) -> tuple[int, ...]:
        """The rank ``r_l`` of every layer."""
        return tuple(int(U.shape[1]) for U in self.U)

    @property
    def rank(self) -> int:
        """The largest rank over the layers."""
        return max(self.ranks)

    @property
    def dtype(self) -> np.dtype:
        return self.U[0].dtype

    def arrays(self) -> Iterator[np.ndarray]:
        """Every stored array: ``U``, ``V`` of each layer."""
        for U, V in zip(self.U, self.V, strict=True):
            yield from (U, V)

    def factors(
        self, layer: int
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray, np.ndarray]:
        """The identity's parts ``(s, W0, U, V)`` of one layer: ``(None, None, U_l, V_l)``."""
        return None, None, self.U[layer], self.V[layer]

    def reconstruct(self, layer: int) -> np.ndarray:
        """``W_eff = U_l V_l^T``, float32 (float64 for float64 bundles)."""
        return reconstruct(*self.factors(layer))

    def apply(self, layer: int, x: np.ndarray) -> np.ndarray:
        """``y = U_l (V_l^T x)`` for ``x`` of shape ``[..., in]``."""
        return apply(x, *self.factors(layer))

    def stored_parameters(self) -> int:
        """Numbers stored: ``U`` and ``V`` of every layer."""
        return sum(int(U.size + V.size) for U, V in zip(self.U, self.V, strict=True))

    def stored_bytes(self) -> int:
        """Bytes of every stored array."""
        return sum(int(a.nbytes) for a in self.arrays())

    def dense_parameters(self) -> int:
        """Numbers the dense family stores (``L * out * in``)."""
        out_dim, in_dim = self.shape
        return self.num_layers * out_dim * in_dim


@dataclass(frozen=True, kw_only=True)
class SharedBasisFamily:
    """A family stored as one basis per band and per-layer coefficients.

    ``side="in"``: ``bases[b]`` is ``[in, k_b]``, ``coefs[l]`` is ``U_l [out, k_b]`` and
    ``W_l ~ U_l B_b^T``. ``side="out"``: ``bases[b]`` is ``[out, k_b]``, ``coefs[l]`` is
    ``V_l [in, k_b]`` and ``W_l ~ B_b V_l^T``. ``bands[l]`` is the band of layer ``l``
    (contiguous, covering ``0..G-1``); ``k_b`` may differ per band.
    """

    form: ClassVar[str] = "shared_basis"

    name: str
    side: Literal["in", "out"]
    bases: tuple[np.ndarray, ...]
    bands: tuple[int, ...]
    coefs: tuple[np.ndarray, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "bases", tuple(self.bases))
        object.__setattr__(self, "bands", tuple(int(b) for b in self.bands))
        object.__setattr__(self, "coefs", tuple(self.coefs))
        if self.side not in SIDES:
            raise ThetaFormatError(f"{self.name}: side must be 'in' or 'out', got {self.side!r}")
        if not self.bases:
            raise ThetaFormatError(f"{self.name}: a shared-basis family needs at least one basis")
        check_bands(self.name, self.bands, len(self.bases), len(self.coefs))
        bad = _bad_2d(self.bases)
        if bad:
            raise ThetaFormatError(f"{self.name}: the bases of bands {bad} are not 2-D")
        dim = self.bases[0].shape[0]
        bad = [b for b, B in enumerate(self.bases) if B.shape[0] != dim]
        if bad:
            raise ThetaFormatError(
                f"{self.name}: the bases of bands {bad} do not have {dim} rows like band 0's"
            )
        bad = _bad_2d(self.coefs)
        if bad:
            raise ThetaFormatError(f"{self.name}: layers {bad} have coefficients that are not 2-D")
        rows = self.coefs[0].shape[0]
        bad = [
            i
            for i, (C, b) in enumerate(zip(self.coefs, self.bands, strict=True))
            if C.shape[0] != rows or C.shape[1] != self.bases[b].shape[1]
        ]
        if bad:
            part = "U" if self.side == "in" else "V"
            raise ThetaFormatError(
                f"{self.name}: layers {bad} have {part} of shapes "
                + ", ".join(str(list(self.coefs[i].shape)) for i in bad)
                + f"; expected [{rows}, k_b] with k_b the width of their band's basis"
            )

    @property
    def num_layers(self) -> int:
        return len(self.coefs)

    @property
    def blocks(self) -> int:
        """``G``, the number of bands (bases)."""
        return len(self.bases)

    @property
    def shape(self) -> tuple[int, int]:
        """``(out, in)`` of every weight of the family."""
        basis, coef = int(self.bases[0].shape[0]), int(self.coefs[0].shape[0])
        return (coef, basis) if self.side == "in" else (basis, coef)

    @property
    def ranks(self) -> tuple[int, ...]:
        """The basis width ``k_b`` each layer uses."""
        return tuple(int(self.bases[b].shape[1]) for b in self.bands)

    @property
    def rank(self) -> int:
        """The widest basis."""
        return max(self.ranks)

    @property
    def dtype(self) -> np.dtype:
        return self.bases[0].dtype

    def basis(self, layer: int) -> np.ndarray:
        """The basis that ``layer`` uses."""
        return self.bases[self.bands[layer]]

    def arrays(self) -> Iterator[np.ndarray]:
        """Every stored array: the bases, then each layer's coefficients."""
        yield from self.bases
        yield from self.coefs

    def factors(
        self, layer: int
    ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray, np.ndarray]:
        """The identity's parts ``(s, W0, U, V)``: ``(None, None, U_l, B_b)`` or ``(None, None, B_b, V_l)``."""
        if self.side == "in":
            return None, None, self.coefs[layer], self.basis(layer)
        return None, None, self.basis(layer), self.coefs[layer]

    def reconstruct(self, layer: int) -> np.ndarray:
        """``W_eff`` of one layer, float32 (float64 for float64 bundles)."""
        return reconstruct(*self.factors(layer))

    def apply(self, layer: int, x: np.ndarray) -> np.ndarray:
        """``y = U (V^T x)`` with the band's basis on its side, ``x`` of shape ``[..., in]``."""
        return apply(x, *self.factors(layer))

    def stored_parameters(self) -> int:
        """Numbers stored: every basis once, plus each layer's coefficients."""
        return sum(int(B.size) for B in self.bases) + sum(int(C.size) for C in self.coefs)

    def stored_bytes(self) -> int:
        """Bytes of every stored array."""
        return sum(int(a.nbytes) for a in self.arrays())

    def dense_parameters(self) -> int:
        """Numbers the dense family stores (``L * out * in``)."""
        out_dim, in_dim = self.shape
        return self.num_layers * out_dim * in_dim
