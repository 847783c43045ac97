"""How each layer of a theta family is served on the GEMM path: the per-layer choice (numpy only).

Every form of the identity (docs/architecture.md) runs in the graph holding only its stored tensors:

``banded``
    ``y = s * (x W0^T) + (x V) U^T`` with the band's ``W0`` held once (the ``W0V`` band
    weight of :mod:`attnquant_core.serving._layout`).
``lowrank``
    ``y = (x V_l) U_l^T``: two thin matmuls, no ``W0``.
``basis_in``
    A shared basis on the input side (``W_l ~ U_l B_b^T``): ``t = x B_b``, then ``t U_l^T``;
    ``B_b`` held once per band.
``basis_out``
    A shared basis on the output side (``W_l ~ B_b V_l^T``): ``t = x V_l``, then ``t B_b^T``.
``dense``
    ``y = x W^T`` with ``W`` rebuilt once at load: chosen where the stored factors of a layer
    (low rank) or of a family (shared basis) are not smaller than the dense weights they stand
    for, so the graph never holds more than the stock model for a projection, nor runs two
    matmuls where one reads fewer bytes.
``zero``
    A low-rank layer of rank 0 (``W = 0``): ``y = 0``, nothing held (a family whose every
    layer has rank 0 is served dense, so that it is seen in the state at all).
``nvfp4``
    Banded with its ``W0`` stored in NVFP4 (format version 4): ``y = s * (x W0^T) + (x V) U^T``
    with the band's packed ``W0`` held once as stored (``W0_packed``, ``W0_scale``,
    ``W0_scale_2``) and decoded in the graph (:class:`attnquant_max._nvfp4_layers.NVFP4Linear`:
    one fused ``generated_linear_nvfp4`` dispatch, or dequantized then a matmul).

Banded families are served banded as they are stored (passthrough holds ``W0 = W`` plus a scale
per row, the production shape of the in-graph paths).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

__all__ = [
    "FACTORED_KINDS",
    "FUSED_GROUPS",
    "GEMM_PREFIX",
    "KINDS",
    "STAGE1_KINDS",
    "Served",
    "fused_group_of",
    "gemm_band_key",
    "gemm_groups",
    "is_nvfp4_family",
    "served_layers",
    "stacked_input_key",
]

#: Every way one layer of a family is served on the GEMM path.
KINDS: tuple[str, ...] = (
    "banded",
    "dense",
    "lowrank",
    "basis_in",
    "basis_out",
    "zero",
    "nvfp4",
)
#: The kinds held without ``W0`` (the forms of :mod:`attnquant_core.forms` other than banded).
FACTORED_KINDS: tuple[str, ...] = ("dense", "lowrank", "basis_in", "basis_out", "zero")
#: The kinds whose first matmul reads a per-layer tensor (``W``, ``V_l``): several of them in
#: one layer's q/k/v (or gate/up) share one matmul over their rows stacked at load.
STAGE1_KINDS: tuple[str, ...] = ("dense", "lowrank", "basis_out")


class Served(NamedTuple):
    """How one layer of one family is served.

    Attributes
    ----------
    kind : str
        One of :data:`KINDS`.
    rank : int
        Columns of ``U``/``V`` (banded, low rank) or the band's basis width (shared basis);
        ``0`` for dense and zero.
    band : int
        The layer's band (banded, shared basis); ``0`` otherwise.
    """

    kind: str
    rank: int = 0
    band: int = 0


def is_nvfp4_family(fam: Any) -> bool:
    """Whether ``fam`` is banded with its ``W0`` stored in NVFP4 (served packed, not in ``W0V``)."""
    return getattr(fam, "form", None) == "banded" and getattr(fam, "quant", None) == "nvfp4"


def served_layers(fam: Any) -> tuple[Served, ...]:
    """How every layer of ``fam`` (any :mod:`attnquant_core` family form) is served.

    A low-rank layer is served dense when ``r (out + in) >= out * in``, and as zero at rank 0;
    a shared-basis family when its bases and coefficients hold at least as many numbers as its
    dense weights.
    """
    form = fam.form
    if form == "banded":
        kind = "nvfp4" if is_nvfp4_family(fam) else "banded"
        return tuple(Served(kind, t.rank, b) for t, b in zip(fam.layers, fam.bands, strict=True))
    out_dim, in_dim = fam.shape
    dense = out_dim * in_dim
    if form == "lowrank":
        if not any(fam.ranks):
            return (Served("dense"),) * fam.num_layers
        return tuple(
            Served("zero")
            if r == 0
            else Served("dense")
            if r * (out_dim + in_dim) >= dense
            else Served("lowrank", r)
            for r in fam.ranks
        )
    if form != "shared_basis":
        raise ValueError(f"{fam.name}: no GEMM serving for the form {form!r}")
    if fam.stored_parameters() >= fam.dense_parameters():
        return (Served("dense"),) * fam.num_layers
    # A band of width 0 is served as width 1 of zeros (ingraph_tensors pads it): every band
    # keeps its basis, so the band of each layer reads back from the names.
    return tuple(
        Served(f"basis_{fam.side}", max(1, int(fam.bases[b].shape[1])), b) for b in fam.bands
    )


#: The projection groups fused into one band weight when ``ATTNQUANT_QKV_FUSE=1``.
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}

GEMM_PREFIX = "attnquant.gemm."


def gemm_band_key(group: str, band: int) -> str:
    """``attnquant.gemm.self_attn.qkv_proj.0.W0V``: the GEMM band weight of ``group``."""
    return f"{GEMM_PREFIX}{group}.{band}.W0V"


def stacked_input_key(stack: str, layer: int, group: str) -> str:
    """``layers.3.self_attn.qkv_proj.theta_in``: one layer's stacked first-matmul rows."""
    return f"{stack}.{layer}.{group}.theta_in"


def fused_group_of(family: str) -> str | None:
    """The fused group (``self_attn.qkv_proj``, ``mlp.gate_up_proj``) of ``family``, if any."""
    return next((g for g, members in FUSED_GROUPS.items() if family in members), None)


def gemm_groups(families: Sequence[str], *, fuse: bool) -> dict[str, tuple[str, ...]]:
    """The band-weight groups: fused q/k/v and gate/up when ``fuse``, else one per family."""
    groups: dict[str, tuple[str, ...]] = {}
    taken: set[str] = set()
    if fuse:
        for group, members in FUSED_GROUPS.items():
            if all(m in families for m in members):
                groups[group] = members
                taken.update(members)
    for family in families:
        if family not in taken:
            groups[family] = (family,)
    return groups
