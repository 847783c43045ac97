"""The theta forms and the one identity they all store: ``W_eff = diag(s) @ W0 + U @ V.T``.

``banded`` (:class:`FamilyTheta` of :class:`LayerTheta`), ``lowrank`` (:class:`LowRankFamily`)
and ``shared_basis`` (:class:`SharedBasisFamily`); :class:`ThetaModel` holds every family of
one model. :func:`apply` and :func:`reconstruct` are the identity itself; the bands helpers cut
``L`` layers into ``G`` contiguous bands. Depends on nothing but numpy and the errors.
"""

from ._banded import FamilyTheta, LayerTheta
from ._bands import band_of_layers, band_sizes, group_blocks, resolve_blocks
from ._factored import SIDES, LowRankFamily, SharedBasisFamily, check_bands
from ._identity import apply, compute_dtype, reconstruct
from ._measure import FamilyErrors, pooled_error
from ._model import FORMS, ThetaFamily, ThetaModel, common_blocks

__all__ = [
    # the identity
    "apply",
    "compute_dtype",
    "reconstruct",
    # the forms
    "FORMS",
    "SIDES",
    "FamilyTheta",
    "LayerTheta",
    "LowRankFamily",
    "SharedBasisFamily",
    "ThetaFamily",
    "ThetaModel",
    "check_bands",
    "common_blocks",
    # bands
    "band_of_layers",
    "group_blocks",
    "band_sizes",
    "resolve_blocks",
    # errors of a fitted family
    "FamilyErrors",
    "pooled_error",
]
