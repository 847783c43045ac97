"""Theta bundles and the one formula of the project: ``W_eff = diag(s) W0 + U V^T``."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, ClassVar, TypeAlias

import numpy as np

from ._errors import ThetaFormatError
from ._svd import compute_dtype

if TYPE_CHECKING:
    from ._forms import LowRankFamily, SharedBasisFamily

__all__ = [
    "FORMS",
    "FamilyTheta",
    "LayerTheta",
    "ThetaFamily",
    "ThetaModel",
    "apply",
    "common_blocks",
    "reconstruct",
]

#: The forms a family may be stored in (``"form"`` in ``attnquant.json``).
FORMS: tuple[str, ...] = ("banded", "lowrank", "shared_basis")
ThetaFamily: TypeAlias = "FamilyTheta | LowRankFamily | SharedBasisFamily"


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


def common_blocks(families: Iterable[object]) -> int | None:
    """The ``G`` every banded family shares; ``None`` when none is banded or they disagree."""
    Gs = {f.blocks for f in families if getattr(f, "form", None) == "banded"}  # type: ignore[attr-defined]
    return Gs.pop() if len(Gs) == 1 else None


@dataclass(frozen=True, kw_only=True)
class ThetaModel:
    """Every decomposed family of one model, in any form; all share the layer count.

    Families may be :class:`FamilyTheta` (banded), :class:`~attnquant_core.LowRankFamily` or
    :class:`~attnquant_core.SharedBasisFamily`, each with its own bands and ranks.
    """

    families: Mapping[str, ThetaFamily]
    stack: str = "model.layers"
    extra: Mapping[str, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "families", MappingProxyType(dict(self.families)))
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))
        if not self.families:
            raise ThetaFormatError("a ThetaModel needs at least one family")
        for n, f in self.families.items():
            if getattr(f, "form", None) not in FORMS:
                raise ThetaFormatError(
                    f"{n}: {type(f).__name__} is not a theta family (forms: {', '.join(FORMS)})"
                )
        counts = {f.num_layers for f in self.families.values()}
        if len(counts) != 1:
            raise ThetaFormatError(
                "every family of a ThetaModel must have the same number of layers; got "
                + ", ".join(f"{n}: L={f.num_layers}" for n, f in self.families.items())
            )

    @property
    def num_layers(self) -> int:
        return next(iter(self.families.values())).num_layers

    @property
    def blocks(self) -> int | None:
        """The ``G`` every banded family shares; ``None`` when none is banded or they disagree."""
        return common_blocks(self.families.values())

    @property
    def passthrough(self) -> bool:
        """Whether every family is banded with ``G = L`` (the rebuild is exact)."""
        return all(f.form == "banded" and f.blocks == f.num_layers for f in self.families.values())

    @property
    def rank(self) -> int:
        """The largest rank of any layer of any family."""
        return max(f.rank for f in self.families.values())

    @property
    def forms(self) -> dict[str, str]:
        """The form of every family."""
        return {n: f.form for n, f in self.families.items()}

    def stored_parameters(self) -> int:
        """Numbers stored over every family."""
        return sum(f.stored_parameters() for f in self.families.values())

    def dense_parameters(self) -> int:
        """Numbers the dense projections store."""
        return sum(f.dense_parameters() for f in self.families.values())
