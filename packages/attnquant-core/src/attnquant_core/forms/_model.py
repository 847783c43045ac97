"""Theta bundles: every decomposed family of one model, in any of the forms."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeAlias

import numpy as np

from .._errors import ThetaFormatError
from ._banded import FamilyTheta
from ._factored import LowRankFamily, SharedBasisFamily

__all__ = ["FORMS", "ThetaFamily", "ThetaModel", "common_blocks"]


#: The forms a family may be stored in (``"form"`` in ``attnquant.json``).
FORMS: tuple[str, ...] = ("banded", "lowrank", "shared_basis")


ThetaFamily: TypeAlias = "FamilyTheta | LowRankFamily | SharedBasisFamily"


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
