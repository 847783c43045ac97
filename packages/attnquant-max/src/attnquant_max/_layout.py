"""The tensors the in-graph paths feed to MAX, and their names (numpy only).

On the in-graph paths (DESIGN §5.2, and ``ATTNQUANT_PRECOMPUTE=1``) the served
graph holds the theta tensors themselves, never ``W_eff``. The names are the
theta checkpoint's (DESIGN §4), plus one kind of tensor built at load for the
GEMM formulation:

``<stack>.<i>.<family>.theta_s`` ``[out]`` and ``theta_U`` ``[out, r]``
    per layer, both paths.
``<stack>.<i>.<family>.theta_V`` ``[in, r]``
    per layer, in-graph precompute only (the GEMM path keeps ``V`` in the band weight).
``attnquant.shared.<family>.<band>.W0`` ``[out, in]``
    one per band, in-graph precompute only.
``attnquant.gemm.<group>.<band>.W0V`` ``[sum(out) + n_band * k * r, in]``
    one per band, GEMM path: the band's ``W0`` rows of the ``k`` projections of
    ``group`` (``self_attn.qkv_proj`` = q, k, v; ``mlp.gate_up_proj`` = gate,
    up; or a single family), then the ``V^T`` rows of every layer of the band,
    layer by layer, projection by projection. One matmul ``x @ W0V^T`` gives a
    layer both ``x W0^T`` and its ``x V`` (the layer picks its ``k * r``
    columns), so ``W0`` is stored once per band: weight memory follows the
    theta size. The price is ``(n_band - 1) * k * r`` output columns computed
    and dropped per layer: nothing at passthrough, ``(L - 1) k r`` at ``G = 1``.

Why not concatenate ``[W0 ; V_l^T]`` per layer in the graph: a weight-only
concat is either folded into a per-layer constant at compile time (``W0``
copied once per layer: dense-size memory) or redone on every forward (a copy of
``W0`` per layer per step). A band weight built once at load avoids both.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from attnquant_core import FamilyTheta, LayerTheta, shared_key, theta_key

__all__ = [
    "FUSED_GROUPS",
    "InGraphLayout",
    "gemm_band_key",
    "gemm_groups",
    "ingraph_tensors",
    "uniform_ranks",
]

#: The projection groups fused into one band weight when ``ATTNQUANT_QKV_FUSE=1``.
FUSED_GROUPS: dict[str, tuple[str, ...]] = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}

GEMM_PREFIX = "attnquant.gemm."


def gemm_band_key(group: str, band: int) -> str:
    """``attnquant.gemm.self_attn.qkv_proj.0.W0V``: the GEMM band weight of ``group``."""
    return f"{GEMM_PREFIX}{group}.{band}.W0V"


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


def _padded(fam: FamilyTheta, rank: int) -> FamilyTheta:
    """``fam`` with every layer's ``U``, ``V`` padded with zero columns to ``rank`` (exact)."""
    if all(t.rank == rank for t in fam.layers):
        return fam

    def pad(a: np.ndarray) -> np.ndarray:
        return np.pad(a, ((0, 0), (0, rank - a.shape[1])))

    layers = tuple(LayerTheta(s=t.s, U=pad(t.U), V=pad(t.V)) for t in fam.layers)
    return FamilyTheta(name=fam.name, shared=fam.shared, bands=fam.bands, layers=layers)


def uniform_ranks(families: Mapping[str, FamilyTheta], *, fuse: bool) -> dict[str, FamilyTheta]:
    """Each family with one rank per projection group (the group's largest, zeros padded).

    A graph layer has one ``r``; a checkpoint fitted to a budget has a rank per layer.
    Zero columns of ``U`` and ``V`` add nothing to ``U V^T``, so padding is exact; it costs
    the padded columns' arithmetic.
    """
    out = dict(families)
    for members in gemm_groups(list(families), fuse=fuse).values():
        rank = max(t.rank for m in members for t in families[m].layers)
        for m in members:
            out[m] = _padded(families[m], rank)
    return out


def ingraph_tensors(
    families: Mapping[str, FamilyTheta],
    *,
    stack: str,
    gemm: bool,
    fuse: bool,
    dtype: Mapping[str, np.dtype] | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """Every theta tensor an in-graph model reads, under the names of the module docstring.

    Parameters
    ----------
    families : mapping of family name to FamilyTheta
        All decomposed families of the model (same layers and bands).
    stack : str
        Key prefix of the decoder layers, such as ``"model.layers"``.
    gemm : bool
        ``True``: GEMM band weights ``W0V``; ``False``: in-graph precompute
        (``W0`` per band, ``V`` per layer).
    fuse : bool
        GEMM path: one band weight for q/k/v and one for gate/up.
    dtype : mapping of family name to dtype, optional
        Cast each family's tensors to this dtype (default: as stored).
    """

    def cast(name: str, array: np.ndarray) -> np.ndarray:
        target = None if dtype is None else dtype.get(name)
        return np.ascontiguousarray(array if target is None else array.astype(target))

    families = uniform_ranks(families, fuse=fuse)
    for name, fam in families.items():
        rank = fam.layers[0].rank
        for layer, t in enumerate(fam.layers):
            yield theta_key(stack, layer, name, "s"), cast(name, t.s)
            if rank:
                yield theta_key(stack, layer, name, "U"), cast(name, t.U)
                if not gemm:
                    yield theta_key(stack, layer, name, "V"), cast(name, t.V)
        if not gemm:
            for band, W0 in enumerate(fam.shared):
                yield shared_key(name, band), cast(name, W0)
    if not gemm:
        return
    for group, members in gemm_groups(list(families), fuse=fuse).items():
        fams = [families[m] for m in members]
        rank = fams[0].layers[0].rank
        bands = fams[0].bands
        if any(f.bands != bands for f in fams):
            raise ValueError(f"{group}: {', '.join(members)} have different bands")
        for band in range(fams[0].blocks):
            rows = [cast(f.name, f.shared[band]) for f in fams]
            if rank:
                for layer in (i for i, b in enumerate(bands) if b == band):
                    rows += [cast(f.name, f.layers[layer].V.T) for f in fams]
            yield gemm_band_key(group, band), np.ascontiguousarray(np.concatenate(rows, axis=0))


@dataclass(frozen=True, kw_only=True)
class InGraphLayout:
    """What an in-graph model must build, read back from the names and shapes of its state.

    Attributes
    ----------
    gemm : bool
        GEMM band weights (``True``) or in-graph precompute (``False``).
    groups : dict of str to tuple of str
        The projections computed by one matmul: ``self_attn.qkv_proj`` and
        ``mlp.gate_up_proj`` when fused, else one group per family.
    blocks : int
        ``G``, the same for every family.
    ranks : dict of str to int
        ``r`` of each family (``0``: no correction stored).
    custom_op : bool
        With ``gemm=False``: compute with attnquant-kernels' custom ops instead of
        forming ``W_eff`` (the tensors are the same; the serving path decides).
    fused_mlp : bool
        Custom op: one ``generated_mlp`` dispatch per MLP (``ATTNQUANT_FUSED_MLP``).
    """

    gemm: bool
    groups: dict[str, tuple[str, ...]]
    blocks: int
    ranks: dict[str, int]
    custom_op: bool = False
    fused_mlp: bool = True

    @property
    def fused(self) -> bool:
        """Whether q/k/v and gate/up run as one group each."""
        return any(len(members) > 1 for members in self.groups.values())

    def group_of(self, family: str) -> str:
        return next(g for g, members in self.groups.items() if family in members)

    def keys(self, num_layers: int, *, stack: str = "layers") -> set[str]:
        """Every theta tensor name a model of this layout reads."""
        keys: set[str] = set()
        for group, members in self.groups.items():
            for band in range(self.blocks):
                if self.gemm:
                    keys.add(gemm_band_key(group, band))
                else:
                    keys.update(shared_key(m, band) for m in members)
            for family in members:
                parts = ["s"]
                if self.ranks[family]:
                    parts += ["U"] if self.gemm else ["U", "V"]
                keys.update(
                    theta_key(stack, i, family, p) for i in range(num_layers) for p in parts
                )
        return keys

    @classmethod
    def from_state(
        cls,
        shapes: Mapping[str, Sequence[int]],
        families: Sequence[str],
        *,
        fuse: bool,
        stack: str = "layers",
    ) -> InGraphLayout | None:
        """The layout of an in-graph state (``name -> shape``); ``None`` for a dense state.

        The GEMM band weights say themselves whether q/k/v are fused; on the
        in-graph precompute path ``fuse`` decides (one matmul over the
        concatenated ``W_eff``, as the stock model does).

        Raises
        ------
        ValueError
            The theta names do not describe every family once, with one ``G``.
        """
        gemm_bands: dict[str, set[int]] = {}
        shared_bands: dict[str, set[int]] = {}
        for key in shapes:
            if key.startswith(GEMM_PREFIX) and key.endswith(".W0V"):
                group, band = key[len(GEMM_PREFIX) : -len(".W0V")].rsplit(".", 1)
                gemm_bands.setdefault(group, set()).add(int(band))
            elif key.startswith("attnquant.shared.") and key.endswith(".W0"):
                family, band = key[len("attnquant.shared.") : -len(".W0")].rsplit(".", 1)
                shared_bands.setdefault(family, set()).add(int(band))
        if not gemm_bands and not shared_bands:
            return None
        if gemm_bands and shared_bands:
            raise ValueError("a state holds both GEMM band weights (W0V) and W0 blocks")
        gemm = bool(gemm_bands)
        bands = gemm_bands if gemm else shared_bands
        if gemm:
            groups = {g: FUSED_GROUPS.get(g, (g,)) for g in bands}
        else:
            groups = gemm_groups(list(families), fuse=fuse)
        covered = [m for members in groups.values() for m in members]
        named = set(groups) if gemm else set(families)
        unknown = sorted((set(covered) - set(families)) | (set(bands) - named))
        missing = sorted(set(families) - set(covered if gemm else bands))
        if missing or unknown or len(covered) != len(set(covered)):
            raise ValueError(
                f"the in-graph state does not hold each projection family once: "
                f"missing {missing}, unexpected {unknown}"
            )
        counts = {name: len(seen) for name, seen in bands.items()}
        for name, seen in bands.items():
            if seen != set(range(len(seen))):
                raise ValueError(f"{name}: band weights {sorted(seen)} are not 0..G-1")
        if len(set(counts.values())) != 1:
            raise ValueError(f"the families have different numbers of bands: {counts}")
        ranks = {}
        for family in families:
            U = shapes.get(f"{stack}.0.{family}.theta_U")
            ranks[family] = int(U[1]) if U is not None else 0
        for group, members in groups.items():
            if len({ranks[m] for m in members}) != 1:
                raise ValueError(f"{group}: {', '.join(members)} have different ranks")
        return cls(gemm=gemm, groups=groups, blocks=counts.popitem()[1], ranks=ranks)
