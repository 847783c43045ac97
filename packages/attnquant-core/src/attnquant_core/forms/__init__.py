"""The theta forms and the one identity they all store: ``W_eff = diag(s) @ W0 + U @ V.T``.

``banded`` (:class:`FamilyTheta` of :class:`LayerTheta`), ``lowrank`` (:class:`LowRankFamily`)
and ``shared_basis`` (:class:`SharedBasisFamily`); :class:`ThetaModel` holds every family of
one model. :func:`apply` and :func:`reconstruct` are the identity itself; the bands helpers cut
``L`` layers into ``G`` contiguous bands. A banded family may hold its ``W0`` in NVFP4
(:func:`quantize_nvfp4`, modelopt's layout); its identity then uses the dequantized ``W0``.
Depends on nothing but numpy, ml_dtypes and the errors.
"""

from ._banded import QUANTS, FamilyTheta, LayerTheta
from ._bands import band_of_layers, band_sizes, group_blocks, resolve_blocks
from ._factored import SIDES, LowRankFamily, SharedBasisFamily, check_bands
from ._identity import apply, compute_dtype, reconstruct
from ._measure import FamilyErrors, pooled_error
from ._model import FORMS, ThetaFamily, ThetaModel, common_blocks
from ._nvfp4 import (
    BLOCK_SIZE,
    E2M1_MAX,
    E2M1_VALUES,
    E4M3_MAX,
    E4M3_MIN_SUBNORMAL,
    E4M3_VALUES,
    NVFP4Error,
    NVFP4Tensor,
    check_nvfp4_shape,
    dequantize_nvfp4,
    e2m1_codes,
    nvfp4_error_bound,
    pack_nibbles,
    quantize_nvfp4,
    unpack_nibbles,
)

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
    # NVFP4 (the 4-bit W0 of a quantized banded family; modelopt's layout)
    "BLOCK_SIZE",
    "E2M1_MAX",
    "E2M1_VALUES",
    "E4M3_MAX",
    "E4M3_MIN_SUBNORMAL",
    "E4M3_VALUES",
    "NVFP4Error",
    "NVFP4Tensor",
    "QUANTS",
    "check_nvfp4_shape",
    "dequantize_nvfp4",
    "e2m1_codes",
    "nvfp4_error_bound",
    "pack_nibbles",
    "quantize_nvfp4",
    "unpack_nibbles",
]
