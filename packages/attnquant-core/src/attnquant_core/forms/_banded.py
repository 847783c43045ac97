"""The banded form: a shared ``W0`` per band of layers, a row scale and a correction per layer.

``W0`` may be stored quantized to NVFP4 (``nvfp4``): ``W ~ diag(s) Q(W0) + U V^T``, the
identity evaluated on the dequantized ``W0`` in float32 (LQER / QERA / EoRA at passthrough:
NVFP4 plus a low-rank correction of its quantization error).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from .._errors import ThetaFormatError
from ._identity import apply, reconstruct
from ._nvfp4 import NVFP4Tensor, dequantize_nvfp4

__all__ = ["QUANTS", "FamilyTheta", "LayerTheta"]

#: The quantizations a banded family's ``W0`` may be stored in (``"quant"`` in attnquant.json).
QUANTS: tuple[str, ...] = ("nvfp4",)


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

    ``nvfp4``, when given, holds each band's ``W0`` in NVFP4 (format version 4) and ``shared``
    is its dequantization (float32, what the identity uses); build such a family with
    :meth:`from_nvfp4`, which dequantizes for you.
    """

    form: ClassVar[str] = "banded"
    side: ClassVar[None] = None

    name: str
    shared: tuple[np.ndarray, ...]
    bands: tuple[int, ...]
    layers: tuple[LayerTheta, ...]
    nvfp4: tuple[NVFP4Tensor, ...] | None = None

    @classmethod
    def from_nvfp4(
        cls,
        *,
        name: str,
        nvfp4: tuple[NVFP4Tensor, ...],
        bands: tuple[int, ...],
        layers: tuple[LayerTheta, ...],
    ) -> FamilyTheta:
        """A family whose ``W0`` blocks are ``nvfp4``; ``shared`` is their float32 dequantization."""
        nvfp4 = tuple(nvfp4)
        shared = tuple(dequantize_nvfp4(q) for q in nvfp4)
        return cls(name=name, shared=shared, bands=bands, layers=layers, nvfp4=nvfp4)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shared", tuple(self.shared))
        if self.nvfp4 is not None:
            object.__setattr__(self, "nvfp4", tuple(self.nvfp4))
            if len(self.nvfp4) != len(self.shared) or any(
                q.shape != W0.shape or W0.dtype != np.float32
                for q, W0 in zip(self.nvfp4, self.shared, strict=True)
            ):
                raise ThetaFormatError(
                    f"{self.name}: nvfp4 must hold one NVFP4 W0 per band whose float32 "
                    f"dequantization is shared; got {len(self.nvfp4)} for {len(self.shared)} bands"
                )
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
    def quant(self) -> str | None:
        """How ``W0`` is stored: ``"nvfp4"``, or ``None`` (in :attr:`dtype`, like the rest)."""
        return None if self.nvfp4 is None else "nvfp4"

    @property
    def dtype(self) -> np.dtype:
        """The storage dtype (of the first shared block; of ``s`` when ``W0`` is quantized)."""
        return self.shared[0].dtype if self.nvfp4 is None else self.layers[0].s.dtype

    def arrays(self) -> Iterator[np.ndarray]:
        """Every array stored in :attr:`dtype`: the shared blocks (unless quantized), then
        ``s``, ``U``, ``V`` of each layer."""
        if self.nvfp4 is None:
            yield from self.shared
        for t in self.layers:
            yield from (t.s, t.U, t.V)

    def stored_bytes(self) -> int:
        """Bytes stored: each ``W0`` (4.5 bits a weight plus 4 when in NVFP4), ``s``, ``U``, ``V``."""
        shared = self.nvfp4 if self.nvfp4 is not None else self.shared
        return sum(int(a.nbytes) for a in shared) + sum(
            int(t.s.nbytes + t.U.nbytes + t.V.nbytes) for t in self.layers
        )

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
