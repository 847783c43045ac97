"""Solving an alignment: per band, the permutations and rotations that bring each layer closest
to the band mean, found by Hungarian matching and orthogonal Procrustes, rounds alternating.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
from scipy.linalg import orthogonal_procrustes
from scipy.optimize import linear_sum_assignment

from ..forms._bands import band_sizes
from ..io._safetensors import TensorSpec
from ._align_layout import (
    _ATTN_PARTS,
    _FAMILY_OF,
    _MLP_PARTS,
    ATTN,
    AlignError,
    _from_blocks,
    _Layout,
    _to_blocks,
)
from ._align_transforms import AlignTransforms

__all__ = []


@dataclass(frozen=True)
class _AttnT:
    kv_perm: np.ndarray  # [n_kv] int64
    q_perm: np.ndarray  # [n_heads] int64
    vo_rot: np.ndarray  # [n_kv, d, d]
    qk_angle: np.ndarray  # [n_kv, d/2]

    @classmethod
    def identity(cls, layout: _Layout) -> _AttnT:
        nh, nkv, d = layout.num_heads, layout.num_kv_heads, layout.head_dim
        assert nh and nkv and d
        return cls(
            np.arange(nkv, dtype=np.int64),
            np.arange(nh, dtype=np.int64),
            np.broadcast_to(np.eye(d), (nkv, d, d)).copy(),
            np.zeros((nkv, d // 2)),
        )


_PLANE_ROTATED = ("q", "k", "q_bias", "k_bias")


_QUERY_INDEXED = ("q", "o", "q_bias")


def _rotate_planes(B: np.ndarray, angle: np.ndarray) -> np.ndarray:
    """Rotate every plane ``(p, p + d/2)`` of blocks ``[n, d, X]`` by ``angle`` ``[n, d/2]``."""
    half = B.shape[1] // 2
    c, s = np.cos(angle)[..., None], np.sin(angle)[..., None]
    x1, x2 = B[:, :half], B[:, half:]
    return np.concatenate([c * x1 - s * x2, s * x1 + c * x2], axis=1)


def _apply_attn(
    blocks: Mapping[str, np.ndarray], t: _AttnT, n_rep: int, *, inverse: bool = False
) -> dict[str, np.ndarray]:
    out = {}
    for part, B in blocks.items():
        query = part in _QUERY_INDEXED
        perm = t.q_perm if query else t.kv_perm
        group = np.arange(len(perm)) // n_rep if query else np.arange(len(perm))
        if not inverse:
            B = B[perm]
        if part in _PLANE_ROTATED:
            B = _rotate_planes(B, -t.qk_angle[group] if inverse else t.qk_angle[group])
        else:
            R = t.vo_rot[group]
            B = np.matmul(R.transpose(0, 2, 1) if inverse else R, B)
        if inverse:
            restored = np.empty_like(B)
            restored[perm] = B
            B = restored
        out[part] = B
    return out


def _apply_mlp(
    blocks: Mapping[str, np.ndarray], perm: np.ndarray, *, inverse: bool = False
) -> dict[str, np.ndarray]:
    if not inverse:
        return {part: B[perm] for part, B in blocks.items()}
    out = {}
    for part, B in blocks.items():
        restored = np.empty_like(B)
        restored[perm] = B
        out[part] = restored
    return out


def _solve_mlp(layer: Mapping[str, np.ndarray], target: Mapping[str, np.ndarray]) -> np.ndarray:
    """The neuron permutation that best matches ``layer`` to ``target`` (Hungarian)."""
    S = target["gate"] @ layer["gate"].T
    S += target["up"] @ layer["up"].T
    S += target["down"] @ layer["down"].T
    _, perm = linear_sum_assignment(S, maximize=True)  # rows: target neurons
    return perm.astype(np.int64)


def _solve_attn(
    layer: Mapping[str, np.ndarray],
    target: Mapping[str, np.ndarray],
    layout: _Layout,
    planes: np.ndarray,
    *,
    refinements: int = 2,
) -> _AttnT:
    """Head permutations, v/o rotations and q/k plane angles that bring ``layer`` to ``target``.

    The KV-group matching scores each (layer group, target group) pair by what the best
    rotations could reach: the v/o Procrustes optimum (nuclear norm of the cross-covariance)
    plus the q/k optimum over the rotatable planes, with query heads matched within the pair
    by a rotation-invariant score. Then, per matched group, angles/rotation and the query-head
    matching are refined in turn.
    """
    n_rep, nkv = layout.n_rep, layout.num_kv_heads
    assert nkv
    half = (layout.head_dim or 0) // 2

    def planes_of(B: np.ndarray) -> np.ndarray:  # [n, d, X] -> complex [d/2, n, X]
        return (B[:, :half] + 1j * B[:, half:]).transpose(1, 0, 2)

    # Z[p, h, g] = sum_i x_h conj(y_g) over the complex plane coordinates: rotating x_h's plane
    # p by theta gives Re(exp(i theta) Z) as its inner product with y_g.
    Zq = planes_of(layer["q"]) @ planes_of(target["q"]).conj().transpose(0, 2, 1)
    Zk = planes_of(layer["k"]) @ planes_of(target["k"]).conj().transpose(0, 2, 1)

    def best(z: np.ndarray) -> np.ndarray:  # z [d/2, ...]: the best plane-wise score
        return np.where(planes.reshape((-1,) + (1,) * (z.ndim - 1)), np.abs(z), z.real).sum(0)

    def vo(a: int, heads: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
        X = np.concatenate([layer["v"][a], *layer["o"][heads]], axis=1)
        Y = np.concatenate([target["v"][j], *target["o"][j * n_rep : (j + 1) * n_rep]], axis=1)
        return X, Y

    invariant_q = best(Zq)  # [layer head, target head]
    score = np.empty((nkv, nkv))
    matched: dict[tuple[int, int], np.ndarray] = {}
    rep = np.arange(n_rep)
    for a in range(nkv):
        for j in range(nkv):
            sub = invariant_q[a * n_rep : (a + 1) * n_rep, j * n_rep : (j + 1) * n_rep]
            _, tau = linear_sum_assignment(sub.T, maximize=True)
            heads = a * n_rep + tau
            z = Zk[:, a, j] + Zq[:, heads, j * n_rep + rep].sum(axis=1)
            X, Y = vo(a, heads, j)
            score[j, a] = best(z) + np.linalg.svd(X @ Y.T, compute_uv=False).sum()
            matched[a, j] = heads
    _, kv_perm = linear_sum_assignment(score, maximize=True)  # rows: target groups

    q_perm = np.empty(nkv * n_rep, dtype=np.int64)
    vo_rot = np.empty((nkv, 2 * half, 2 * half))
    qk_angle = np.empty((nkv, half))
    for j in range(nkv):
        a = int(kv_perm[j])
        heads = matched[a, j]
        tgt = j * n_rep + rep
        candidates = a * n_rep + rep

        def fit(heads: np.ndarray, a: int = a, j: int = j, tgt: np.ndarray = tgt):
            z = Zk[:, a, j] + Zq[:, heads, tgt].sum(axis=1)
            theta = np.where(planes, -np.angle(z), 0.0)
            X, Y = vo(a, heads, j)
            Rt, _ = orthogonal_procrustes(X.T, Y.T)  # min ||X^T Rt - Y^T|| = ||Rt^T X - Y||
            return theta, Rt.T

        for _ in range(refinements if n_rep > 1 else 0):
            theta, R = fit(heads)
            Sq = np.einsum("p,phg->hg", np.exp(1j * theta), Zq[:, candidates][:, :, tgt]).real
            So = np.einsum("hdi,gdi->hg", R @ layer["o"][candidates], target["o"][tgt])
            _, tau = linear_sum_assignment((Sq + So).T, maximize=True)
            if np.array_equal(candidates[tau], heads):
                break
            heads = candidates[tau]
        q_perm[tgt], (qk_angle[j], vo_rot[j]) = heads, fit(heads)
    return _AttnT(kv_perm.astype(np.int64), q_perm, vo_rot, qk_angle)


def _weights_only(blocks: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {p: B for p, B in blocks.items() if not p.endswith("_bias")}


def _mean(layers: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    return {p: sum(layer[p] for layer in layers) / len(layers) for p in layers[0]}


def _sq_distance(layers: list[dict[str, np.ndarray]]) -> float:
    mean = _mean(layers)
    return float(sum(np.sum((layer[p] - mean[p]) ** 2) for layer in layers for p in mean))


def _align_band(
    layers: list[dict[str, np.ndarray]],
    solve: Callable[[dict[str, np.ndarray], dict[str, np.ndarray], int], object],
    apply: Callable[[Mapping[str, np.ndarray], object], dict[str, np.ndarray]],
    identity: object,
    rounds: int,
) -> tuple[list[object], list[dict[str, np.ndarray]], bool]:
    """Alternate: solve every layer against the target, then make the aligned mean the target.

    Returns the transforms, the aligned layers and whether alignment was kept (it is dropped
    when the band ends no closer to its mean than it started).
    """
    if len(layers) == 1:
        return [identity], layers, True
    weights = [_weights_only(layer) for layer in layers]
    target = weights[len(layers) // 2]
    transforms: list[object] = [identity] * len(layers)
    aligned = weights
    for _ in range(rounds):
        transforms = [solve(w, target, i) for i, w in enumerate(weights)]
        aligned = [apply(w, t) for w, t in zip(weights, transforms, strict=True)]
        target = _mean(aligned)
    if _sq_distance(aligned) >= _sq_distance(weights):  # alignment did not help: keep as was
        return [identity] * len(layers), layers, False
    aligned = [apply(layer, t) for layer, t in zip(layers, transforms, strict=True)]
    return transforms, aligned, True


def _qk_planes(
    layout: _Layout, get: Callable[[str], np.ndarray], specs: Mapping[str, TensorSpec], layer: int
) -> np.ndarray:
    """The rotary planes of one layer that may rotate: all, unless q/k norms weight them unevenly."""
    half = (layout.head_dim or 0) // 2
    ok = np.ones(half, dtype=bool)
    for norm in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
        key = layout.key(layer, norm)
        if key in specs:
            w = np.asarray(get(key), dtype=np.float64)
            ok &= w[:half] == w[half:]
    return ok


def _run(
    layout: _Layout,
    get: Callable[[str], np.ndarray],
    specs: Mapping[str, TensorSpec],
    put: Callable[[str, np.ndarray], None],
    *,
    blocks: int,
    rounds: int,
) -> AlignTransforms:
    """Align band by band, group by group: read through ``get``, hand results to ``put``."""
    L = layout.num_layers
    arrays: dict[str, np.ndarray] = {}
    sums = {name: [0.0, 0.0, 0.0] for name in layout.dtypes}  # before^2, after^2, norm^2
    qk_rotated: list[int] = [0] * L
    groups: list[tuple[str, dict[str, str]]] = []
    if layout.num_heads:
        groups.append(("attn", _ATTN_PARTS))
    if layout.intermediate:
        groups.append(("mlp", _MLP_PARTS))
    skipped: dict[str, int] = {"attn": 0, "mlp": 0}
    start = 0
    for size in band_sizes(L, blocks):
        band = list(range(start, start + size))
        for kind, parts in groups:
            loaded = []
            for layer in band:
                blocks_of = {}
                for part, suffix in parts.items():
                    key = layout.key(layer, suffix)
                    if key in specs:
                        B = _to_blocks(part, get(key), layout)
                        if not np.isfinite(B).all():
                            raise AlignError(f"{key} holds NaN/Inf values; refusing to align it")
                        blocks_of[part] = B
                loaded.append(blocks_of)
            if kind == "attn":
                planes = {layer: _qk_planes(layout, get, specs, layer) for layer in band}
                identity: object = _AttnT.identity(layout)

                def solve(w, target, i, planes=planes, band=band):
                    return _solve_attn(w, target, layout, planes[band[i]])

                def apply(b, t):
                    return _apply_attn(b, t, layout.n_rep)
            else:
                identity = np.arange(layout.intermediate or 0, dtype=np.int64)

                def solve(w, target, i):
                    return _solve_mlp(w, target)

                def apply(b, t):
                    return _apply_mlp(b, t)

            transforms, aligned, kept = _align_band(loaded, solve, apply, identity, rounds)
            skipped[kind] += not kept
            before = _weights_only(_mean(loaded))
            stored: list[dict[str, np.ndarray]] = []
            for layer, t, blocks_of in zip(band, transforms, aligned, strict=True):
                if kind == "attn":
                    assert isinstance(t, _AttnT)
                    for name in ("kv_perm", "q_perm", "vo_rot", "qk_angle"):
                        arrays[f"layers.{layer}.attn.{name}"] = getattr(t, name)
                    qk_rotated[layer] = int(np.count_nonzero(t.qk_angle))
                else:
                    arrays[f"layers.{layer}.mlp.perm"] = np.asarray(t)
                rounded = {}
                for part, B in blocks_of.items():
                    key = layout.key(layer, parts[part])
                    family = _FAMILY_OF.get(part)
                    out = _from_blocks(part, B, specs[key].dtype)
                    put(key, out)
                    if family:
                        rounded[part] = _to_blocks(part, out, layout)
                stored.append(rounded)
            after = _mean(stored)
            for part in after:
                family = _FAMILY_OF[part]
                for original, aligned_layer in zip(loaded, stored, strict=True):
                    sums[family][0] += float(np.sum((original[part] - before[part]) ** 2))
                    sums[family][1] += float(np.sum((aligned_layer[part] - after[part]) ** 2))
                    sums[family][2] += float(np.sum(original[part] ** 2))
            del loaded, aligned, stored
        start += size

    distances = {
        name: (
            float(np.sqrt(b / n)) if n > 0 else 0.0,
            float(np.sqrt(a / n)) if n > 0 else 0.0,
        )
        for name, (b, a, n) in sums.items()
    }
    notes: list[str] = []
    if blocks == L:
        notes.append("every band holds one layer (blocks = layers): nothing to align")
    for kind, count in skipped.items():
        if count:
            notes.append(
                f"{kind}: {count} band(s) left unaligned (alignment did not bring them closer "
                f"to their mean)"
            )
    half = (layout.head_dim or 0) // 2
    if layout.num_heads:
        fixed = [i for i in range(L) if not _qk_planes(layout, get, specs, i).all()]
        if fixed:
            notes.append(
                f"q/k: layers {fixed} keep some rotary planes unrotated: their q_norm/k_norm "
                f"weights differ between the plane's two coordinates"
            )
    rotated = {np.dtype(dt).name for name, dt in layout.dtypes.items() if name in ATTN}
    inexact = sorted(d for d in rotated if d not in ("float32", "float64"))
    if inexact:
        notes.append(
            f"rotated weights are stored in {', '.join(inexact)}: the aligned model equals the "
            f"original to that dtype's round-off, not bit for bit (permutations are exact)"
        )
    applied: dict[str, object] = {
        "mlp_neuron_permutation": bool(layout.intermediate),
        "kv_head_permutation": bool(layout.num_heads),
        "q_head_permutation": bool(layout.num_heads and layout.n_rep > 1),
        "vo_rotation": bool(layout.num_heads),
        "qk_plane_rotation": bool(layout.num_heads),
        "qk_planes_per_layer": (layout.num_kv_heads or 0) * half,  # (kv head, plane) pairs
        "qk_rotated_planes": qk_rotated,
    }
    return AlignTransforms(
        stack=layout.stack,
        num_layers=L,
        blocks=blocks,
        rounds=rounds,
        num_heads=layout.num_heads,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        intermediate_size=layout.intermediate,
        arrays=arrays,
        distances={name: distances[name] for name in layout.dtypes},
        applied=applied,
        notes=tuple(notes),
    )
