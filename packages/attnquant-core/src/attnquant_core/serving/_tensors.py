"""The theta tensors an in-graph model reads, built at load from the theta families (numpy only).

Names and shapes are those of :mod:`attnquant_core.serving._layout`'s docstring.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from ..forms import FamilyTheta, LayerTheta
from ..io import basis_key, nvfp4_key, shared_key, theta_key
from ._served import (
    FUSED_GROUPS,
    STAGE1_KINDS,
    Served,
    fused_group_of,
    gemm_band_key,
    gemm_groups,
    is_nvfp4_family,
    served_layers,
    stacked_input_key,
)

__all__ = [
    "banded_groups",
    "ingraph_tensors",
    "nvfp4_tensors",
    "stacked_layers",
    "uniform_ranks",
]


def nvfp4_tensors(
    name: str,
    *,
    projection: str | None = None,
    stack: str,
    bands: Iterable[Any],
    layers: Iterable[tuple[int, LayerTheta]],
    cast: Callable[[np.ndarray], np.ndarray],
) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors of a family whose ``W0`` is NVFP4, as stored: per band (an
    :class:`attnquant_core.NVFP4Tensor` each, in band order) ``W0_packed`` uint8 ``[out, in/2]``,
    ``W0_scale`` (the E4M3 bytes as uint8 ``[out, in/16]``) and ``W0_scale_2`` float32 ``[1]``;
    per layer ``theta_s`` and, where ``r > 0``, ``theta_U``, ``theta_V`` (through ``cast``),
    under ``projection`` (default: ``name``)."""
    projection = name if projection is None else projection
    for band, q in enumerate(bands):
        yield nvfp4_key(name, band, "packed"), np.ascontiguousarray(q.weight)
        yield nvfp4_key(name, band, "scale"), np.ascontiguousarray(q.weight_scale.view(np.uint8))
        yield nvfp4_key(name, band, "scale_2"), np.asarray(q.weight_scale_2, np.float32).reshape(1)
    for layer, t in layers:
        parts = {"s": t.s, "U": t.U, "V": t.V} if t.rank else {"s": t.s}
        for part, array in parts.items():
            yield theta_key(stack, layer, projection, part), cast(array)


def banded_groups(families: Mapping[str, Any], *, fuse: bool) -> dict[str, tuple[str, ...]]:
    """The GEMM band-weight groups of the banded families among ``families`` (any form).

    q/k/v (gate/up) share one band weight when ``fuse`` and all of them are banded with the
    same bands; otherwise each banded family has its own.
    """
    groups: dict[str, tuple[str, ...]] = {}
    taken: set[str] = set()
    for group, members in FUSED_GROUPS.items():
        fams = [families.get(m) for m in members]
        banded = fuse and all(getattr(f, "form", None) == "banded" for f in fams)
        if banded and all(f.bands == fams[0].bands for f in fams):  # type: ignore[union-attr]
            groups[group] = members
            taken.update(members)
    for name, fam in families.items():
        if fam.form == "banded" and name not in taken:
            groups[name] = (name,)
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

    The in-graph precompute and custom-op layers have one ``r`` per family; a checkpoint
    fitted to a budget has a rank per layer. Zero columns of ``U`` and ``V`` add nothing to
    ``U V^T``, so padding is exact; it costs the padded columns' arithmetic. (The GEMM path
    keeps every layer's own rank.)
    """
    out = dict(families)
    for members in gemm_groups(list(families), fuse=fuse).values():
        rank = max(t.rank for m in members for t in families[m].layers)
        for m in members:
            out[m] = _padded(families[m], rank)
    return out


def ingraph_tensors(
    families: Mapping[str, Any],
    *,
    stack: str,
    gemm: bool,
    fuse: bool,
    dtype: Mapping[str, np.dtype] | None = None,
) -> Iterator[tuple[str, np.ndarray]]:
    """Every theta tensor an in-graph model reads, under the names of the module docstring.

    Parameters
    ----------
    families : mapping of family name to a theta family
        All decomposed families of the model (same layers). Banded :class:`FamilyTheta` only
        for in-graph precompute; any form (:mod:`attnquant_core.forms`) on the GEMM path.
    stack : str
        Key prefix of the decoder layers, such as ``"model.layers"``.
    gemm : bool
        ``True``: GEMM band weights ``W0V`` and the other forms' factors, and the packed ``W0``
        of banded families stored in NVFP4 (:func:`nvfp4_tensors`; their q/k/v or gate/up
        groups are not fused); ``False``: in-graph precompute and the custom op (``W0`` per
        band, ``V`` per layer) for banded families, the other forms' factors as on the GEMM
        path but never stacked (one ``generated_lowrank`` per projection).
    fuse : bool
        GEMM path: one band weight for q/k/v and one for gate/up, or one stacked first
        matmul per layer for other forms (see the module docstring).
    dtype : mapping of family name to dtype, optional
        Cast each family's tensors to this dtype (default: as stored).

    Raises
    ------
    ValueError
        An NVFP4 ``W0`` off the GEMM path.
    """

    def cast(name: str, array: np.ndarray) -> np.ndarray:
        target = None if dtype is None else dtype.get(name)
        return np.ascontiguousarray(array if target is None else array.astype(target))

    if gemm:
        yield from _gemm_tensors(families, stack=stack, fuse=fuse, cast=cast)
        return
    quantized = sorted(n for n, f in families.items() if is_nvfp4_family(f))
    if quantized:
        raise ValueError(
            f"the in-graph precompute and custom-op paths read a float W0; {', '.join(quantized)} "
            "store it in NVFP4. Serve it on the GEMM path (ATTNQUANT_GEMM=1)"
        )
    factored = {n: f for n, f in families.items() if f.form != "banded"}
    served = {n: served_layers(f) for n, f in factored.items()}
    yield from _factored_tensors(factored, served, {}, stack=stack, cast=cast)
    banded = {n: f for n, f in families.items() if n not in factored}
    families = uniform_ranks(banded, fuse=fuse)
    for name, fam in families.items():
        rank = fam.layers[0].rank
        for layer, t in enumerate(fam.layers):
            yield theta_key(stack, layer, name, "s"), cast(name, t.s)
            if rank:
                yield theta_key(stack, layer, name, "U"), cast(name, t.U)
                yield theta_key(stack, layer, name, "V"), cast(name, t.V)
        for band, W0 in enumerate(fam.shared):
            yield shared_key(name, band), cast(name, W0)


def stacked_layers(
    served: Mapping[str, Sequence[Served]], *, fuse: bool
) -> dict[str, tuple[int, ...]]:
    """Per fused group, the layers whose members all have a per-layer first matmul.

    Those layers run q/k/v (gate/up) as one matmul over the rows stacked at load
    (``theta_in``); a group with any banded member, or a layer with a member of another
    kind, runs each projection alone.
    """
    if not fuse:
        return {}
    out: dict[str, tuple[int, ...]] = {}
    for group, members in FUSED_GROUPS.items():
        if not all(m in served for m in members):
            continue
        num_layers = len(served[members[0]])
        layers = tuple(
            i for i in range(num_layers) if all(served[m][i].kind in STAGE1_KINDS for m in members)
        )
        if layers:
            out[group] = layers
    return out


def _stage1_rows(fam: Any, layer: int, how: Served) -> np.ndarray:
    """The rows a layer's first matmul reads (``x @ rows^T``): ``W``, or ``V^T``."""
    if how.kind == "dense":
        return fam.reconstruct(layer)
    return fam.factors(layer)[3].T


def _gemm_tensors(
    families: Mapping[str, Any], *, stack: str, fuse: bool, cast: Any
) -> Iterator[tuple[str, np.ndarray]]:
    quantized = {n: f for n, f in families.items() if is_nvfp4_family(f)}
    for name, fam in quantized.items():  # packed as stored; their groups run per member
        yield from nvfp4_tensors(
            name,
            stack=stack,
            bands=fam.nvfp4,
            layers=enumerate(fam.layers),
            cast=lambda a, name=name: cast(name, a),
        )
    families = {n: f for n, f in families.items() if n not in quantized}
    groups = banded_groups(families, fuse=fuse)
    for group, members in groups.items():
        fams = [families[m] for m in members]
        for fam in fams:
            for layer, t in enumerate(fam.layers):
                yield theta_key(stack, layer, fam.name, "s"), cast(fam.name, t.s)
                if t.rank:
                    yield theta_key(stack, layer, fam.name, "U"), cast(fam.name, t.U)
        bands = fams[0].bands
        for band in range(fams[0].blocks):
            rows = [cast(f.name, f.shared[band]) for f in fams]
            for layer in (i for i, b in enumerate(bands) if b == band):
                rows += [cast(f.name, f.layers[layer].V.T) for f in fams]
            yield gemm_band_key(group, band), np.ascontiguousarray(np.concatenate(rows, axis=0))
    served = {n: served_layers(f) for n, f in families.items() if f.form != "banded"}
    stacked = stacked_layers(served, fuse=fuse)
    yield from _factored_tensors(families, served, stacked, stack=stack, cast=cast)
    for group, layers in stacked.items():
        for layer in layers:
            rows = [
                cast(
                    m, _at_least_one_column(_stage1_rows(families[m], layer, served[m][layer]).T).T
                )
                for m in FUSED_GROUPS[group]
            ]
            key = stacked_input_key(stack, layer, group)
            yield key, np.ascontiguousarray(np.concatenate(rows, axis=0))


def _factored_tensors(
    families: Mapping[str, Any],
    served: Mapping[str, Sequence[Served]],
    stacked: Mapping[str, Sequence[int]],
    *,
    stack: str,
    cast: Any,
) -> Iterator[tuple[str, np.ndarray]]:
    """The tensors of the families in forms without ``W0`` (``served``): each band's basis
    once, each layer's ``U``/``V`` (or its dense weight where the factors are not smaller),
    leaving out the first-matmul rows of the layers in ``stacked`` (held as ``theta_in``)."""
    for name, how in served.items():
        fam = families[name]
        group = fused_group_of(name)
        in_stack = stacked.get(group, ()) if group is not None else ()
        if how[0].kind.startswith("basis"):
            for band, B in enumerate(fam.bases):
                yield basis_key(name, band), cast(name, _at_least_one_column(B))
        for layer, h in enumerate(how):
            if h.kind == "dense" and layer not in in_stack:
                key = f"{stack}.{layer}.{name}.weight"
                yield key, cast(name, fam.reconstruct(layer))
            elif h.kind in ("lowrank", "basis_in", "basis_out"):
                _, _, U, V = fam.factors(layer)
                if h.kind != "basis_out":
                    yield theta_key(stack, layer, name, "U"), cast(name, _at_least_one_column(U))
                if h.kind != "basis_in" and layer not in in_stack:
                    yield theta_key(stack, layer, name, "V"), cast(name, _at_least_one_column(V))


def _at_least_one_column(a: np.ndarray) -> np.ndarray:
    """``a`` with a zero column when it has none (a shared basis of width 0: exact, tiny)."""
    return a if a.shape[1] else np.zeros((a.shape[0], 1), a.dtype)
