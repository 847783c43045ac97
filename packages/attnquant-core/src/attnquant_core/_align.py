"""Function-preserving alignment of a decoder's layers before fitting (``--align``).

A decoder layer can be reparametrised without changing what it computes: the intermediate
neurons of the MLP can be reordered, the attention heads too (a KV head moves with its query
heads), the values of each KV head can be rotated if the output projection is rotated back,
and the query/key pairs of each rotary plane can be rotated together because 2-D rotations
commute with the rotary embedding. Trained layers are independent draws of those symmetries,
so their band mean ``W0`` blurs; aligning every layer to the band first brings the layers
closer to ``W0`` and leaves less for ``U V^T`` to fix.

Transforms of one layer (``n_rep = num_heads / num_kv_heads``, ``d = head_dim``), applied in
this order to the original weights:

* ``mlp.perm`` ``[I]``: aligned neuron ``m`` is original neuron ``perm[m]`` (``gate_proj`` and
  ``up_proj`` rows, ``down_proj`` columns, gate/up biases);
* ``attn.kv_perm`` ``[n_kv]``: aligned KV head ``j`` is original KV head ``kv_perm[j]``
  (``k_proj``/``v_proj`` rows); ``attn.q_perm`` ``[n_heads]``: aligned query head ``h`` is
  original head ``q_perm[h]`` (``q_proj`` rows, ``o_proj`` columns), with
  ``q_perm[h] // n_rep == kv_perm[h // n_rep]`` so grouped-query attention stays valid;
* ``attn.vo_rot`` ``[n_kv, d, d]``: ``R_j`` left-multiplies the ``v_proj`` rows of KV head
  ``j`` and right-multiplies by ``R_j^T`` the ``o_proj`` columns of each query head of group
  ``j`` (a head's output is a convex combination of value rows, so ``o R^T R v = o v``);
* ``attn.qk_angle`` ``[n_kv, d/2]``: for each rotary plane ``(p, p + d/2)`` (the Hugging Face
  ``rotate_half`` pairing) the 2-D rotation by ``theta_{j,p}``, ``x_p' = cos x_p - sin x_{p+d/2}``,
  ``x_{p+d/2}' = sin x_p + cos x_{p+d/2}``, applied to the ``k_proj`` rows of KV head ``j``
  and the ``q_proj`` rows of every query head of its group. Planes where ``q_norm``/``k_norm``
  weights differ between the two coordinates are left unrotated (angle 0): there the norm's
  weight does not commute with the rotation.

Solving: permutations by Hungarian matching (``scipy.optimize.linear_sum_assignment``) on the
similarity to the band's target, rotations by orthogonal Procrustes (v/o) and the closed-form
best angle per plane (q/k). Round 1 aligns every layer of a band to the band's middle layer
(the mean of unaligned layers is a blur each layer matches itself to); each later round
re-aligns the original layers against the mean of the previous round's aligned layers. A
family group (attention, MLP) whose band ends no closer to its mean than it started is left
as it was.

Memory and time: one band of one family group (attention or MLP) is held in float64, with a
few working copies, plus an ``[I, I]`` similarity and an ``O(I^3)`` Hungarian matching per MLP
layer and round. That suits the analysis-scale models this is for, not 70B-class ones.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.linalg import orthogonal_procrustes
from scipy.optimize import linear_sum_assignment

from ._bands import band_of_layers, band_sizes, resolve_blocks
from ._checkpoint import Checkpoint, _detect_families, open_checkpoint
from ._errors import AttnquantError, CheckpointError
from ._format import _read_json_manifest, atomic_directory, copy_side_files
from ._safetensors_io import PlannedWriter, TensorSpec, dtype_name

__all__ = [
    "ALIGN_FORMAT",
    "ALIGN_MANIFEST_FILE",
    "ALIGN_TRANSFORMS_FILE",
    "ALIGN_VERSION",
    "AlignError",
    "AlignReport",
    "AlignTransforms",
    "align_checkpoint",
    "align_state",
    "load_align_transforms",
    "unalign_state",
]

ALIGN_FORMAT = "attnquant-align"
ALIGN_VERSION = 1
ALIGN_TRANSFORMS_FILE = "attnquant-align.npz"
ALIGN_MANIFEST_FILE = "attnquant-align.json"

#: Decoders whose layers are Llama-shaped with ``rotate_half`` rotary embeddings over the whole
#: head: the symmetries above are exact for them.
ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "GemmaForCausalLM",
        "Gemma2ForCausalLM",
        "Gemma3ForCausalLM",
        "Gemma3ForConditionalGeneration",
    }
)
MODEL_TYPES = frozenset(
    {"llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3", "gemma3_text"}
)

ATTN = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Block names: every block is [n, d, X] (attention) or [I, X] (MLP) and transforms act on
# axis 0 (permutations) and on the left of axis 1 (rotations).
_ATTN_PARTS = {
    "q": "self_attn.q_proj.weight",
    "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight",
    "o": "self_attn.o_proj.weight",
    "q_bias": "self_attn.q_proj.bias",
    "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias",
}
_MLP_PARTS = {
    "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight",
    "down": "mlp.down_proj.weight",
    "gate_bias": "mlp.gate_proj.bias",
    "up_bias": "mlp.up_proj.bias",
}
_FAMILY_OF = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
# Per-layer tensors alignment leaves alone and whose meaning it knows: hidden-size norms, biases
# of outputs in the residual stream, the per-head-dim q/k norms (handled), rotary buffers.
_PASSIVE = frozenset(
    {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "self_attn.o_proj.bias",
        "mlp.down_proj.bias",
        "self_attn.rotary_emb.inv_freq",
    }
)


class AlignError(AttnquantError, ValueError):
    """A model alignment cannot handle (architecture, shapes, unknown per-layer tensors)."""


# -- what a model is -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Layout:
    """What alignment needs to know about a model, checked against its tensors."""

    stack: str
    num_layers: int
    num_heads: int | None  # None: no attention families to align
    num_kv_heads: int | None
    head_dim: int | None
    intermediate: int | None  # None: no MLP families
    dtypes: dict[str, np.dtype]  # family -> stored dtype

    @property
    def n_rep(self) -> int:
        assert self.num_heads and self.num_kv_heads
        return self.num_heads // self.num_kv_heads

    def key(self, layer: int, suffix: str) -> str:
        return f"{self.stack}.{layer}.{suffix}"


class _SpecView:
    """The two methods of :class:`SafetensorsFiles` that family detection uses, over specs."""

    def __init__(self, specs: Mapping[str, TensorSpec]) -> None:
        self._specs = specs

    def keys(self) -> list[str]:
        return sorted(self._specs)

    def spec(self, key: str) -> TensorSpec:
        return self._specs[key]


def _text_config(config: Mapping | None, where: str) -> dict:
    if not isinstance(config, Mapping):
        raise AlignError(f"{where}: no config.json; alignment needs the head counts from it")
    text = config.get("text_config")
    return {**config, **text} if isinstance(text, Mapping) else dict(config)


def _layout(config: Mapping | None, specs: Mapping[str, TensorSpec], where: str) -> _Layout:
    cfg = _text_config(config, where)
    archs = [a for a in (config or {}).get("architectures") or [] if isinstance(a, str)]
    if not (set(archs) & ARCHITECTURES or cfg.get("model_type") in MODEL_TYPES):
        named = ", ".join(archs) or repr(cfg.get("model_type"))
        raise AlignError(
            f"{where}: unknown architecture {named}; alignment knows {', '.join(sorted(ARCHITECTURES))}"
        )
    if float(cfg.get("partial_rotary_factor") or 1.0) != 1.0:
        raise AlignError(f"{where}: partial_rotary_factor != 1 is not supported by alignment")
    try:
        families = _detect_families(Path(where), _SpecView(specs))  # type: ignore[arg-type]
    except CheckpointError as exc:
        raise AlignError(str(exc)) from None
    some = next(iter(families.values()))
    stack, L = some.stack, some.num_layers
    present = set(families)
    for group in (ATTN, MLP):
        if present & set(group) and not set(group) <= present:
            missing = sorted(set(group) - present)
            raise AlignError(f"{where}: family {missing[0]} is missing; alignment needs {group}")
    dtypes = {name: info.dtype for name, info in families.items()}
    for name, dt in dtypes.items():
        if np.dtype(dt).itemsize < 2:
            raise AlignError(
                f"{where}: {name} is stored in {dt}; refusing to rotate float8 weights"
            )

    def shape(name: str) -> tuple[int, int]:
        return families[name].shape

    nh = nkv = hd = inter = None
    if "self_attn.q_proj" in present:
        hidden = shape("self_attn.q_proj")[1]
        nh = cfg.get("num_attention_heads")
        if not isinstance(nh, int) or nh < 1:
            raise AlignError(f"{where}: config has no valid num_attention_heads ({nh!r})")
        nkv = cfg.get("num_key_value_heads") or nh
        hd = cfg.get("head_dim") or int(cfg.get("hidden_size") or hidden) // nh
        if not isinstance(nkv, int) or nkv < 1 or nh % nkv:
            raise AlignError(
                f"{where}: num_attention_heads={nh} is not a multiple of num_key_value_heads={nkv}"
            )
        if hd % 2:
            raise AlignError(f"{where}: head_dim={hd} is odd; rotary planes need even head_dim")
        want = {
            "self_attn.q_proj": (nh * hd, hidden),
            "self_attn.k_proj": (nkv * hd, hidden),
            "self_attn.v_proj": (nkv * hd, hidden),
            "self_attn.o_proj": (hidden, nh * hd),
        }
        for name, expected in want.items():
            if shape(name) != expected:
                raise AlignError(
                    f"{where}: {families[name].keys[0]} has shape {list(shape(name))}, but the "
                    f"config ({nh} heads, {nkv} kv heads, head_dim {hd}) gives {list(expected)}"
                )
    if "mlp.gate_proj" in present:
        inter, hidden = shape("mlp.gate_proj")
        for name, expected in (
            ("mlp.up_proj", (inter, hidden)),
            ("mlp.down_proj", (hidden, inter)),
        ):
            if shape(name) != expected:
                raise AlignError(
                    f"{where}: {families[name].keys[0]} has shape {list(shape(name))}, expected "
                    f"{list(expected)} to match mlp.gate_proj"
                )
    layout = _Layout(stack, L, nh, nkv, hd, inter, dtypes)
    _check_layer_keys(layout, specs, where)
    return layout


def _check_layer_keys(layout: _Layout, specs: Mapping[str, TensorSpec], where: str) -> None:
    """Refuse per-layer tensors whose meaning alignment does not know; check bias/norm shapes."""
    handled = set(_ATTN_PARTS.values()) | set(_MLP_PARTS.values())
    prefix = layout.stack + "."
    for key in specs:
        if not key.startswith(prefix):
            continue
        suffix = key[len(prefix) :].partition(".")[2]
        if suffix not in handled and suffix not in _PASSIVE:
            raise AlignError(
                f"{where}: {key} is a per-layer tensor alignment does not know; refusing, as "
                f"permuting or rotating around it might change the function"
            )
        shape = tuple(specs[key].shape)
        hd = layout.head_dim
        want: tuple[int, ...] | None = None
        if suffix in ("self_attn.q_norm.weight", "self_attn.k_norm.weight"):
            want = (hd,) if hd else shape
        elif suffix == "self_attn.q_proj.bias" and layout.num_heads:
            want = (layout.num_heads * (hd or 0),)
        elif suffix in ("self_attn.k_proj.bias", "self_attn.v_proj.bias") and layout.num_kv_heads:
            want = (layout.num_kv_heads * (hd or 0),)
        elif suffix in ("mlp.gate_proj.bias", "mlp.up_proj.bias") and layout.intermediate:
            want = (layout.intermediate,)
        if want is not None and shape != want:
            raise AlignError(f"{where}: {key} has shape {list(shape)}, expected {list(want)}")


# -- blocks: stored weights <-> arrays the transforms act on --------------------------------


def _to_blocks(part: str, W: np.ndarray, layout: _Layout) -> np.ndarray:
    """A stored weight or bias as float64 blocks: ``[n, d, X]`` for attention, ``[I, X]`` MLP."""
    W = np.asarray(W, dtype=np.float64)
    d = layout.head_dim or 0
    if part == "o":
        return W.T.reshape(-1, d, W.shape[0])
    if part in ("q", "k", "v"):
        return W.reshape(-1, d, W.shape[1])
    if part.endswith("_bias") and part[0] in "qkv":
        return W.reshape(-1, d, 1)
    if part == "down":
        return W.T
    if part.endswith("_bias"):
        return W[:, None]
    return W


def _from_blocks(part: str, B: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The inverse of :func:`_to_blocks`, rounded to the stored ``dtype``."""
    if part == "o":
        out = B.reshape(-1, B.shape[2]).T
    elif part in ("q", "k", "v"):
        out = B.reshape(-1, B.shape[2])
    elif part.endswith("_bias"):
        out = B.reshape(-1)
    elif part == "down":
        out = B.T
    else:
        out = B
    return np.ascontiguousarray(out).astype(dtype)


# -- transforms -----------------------------------------------------------------------------


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


# -- solving one layer against a target -------------------------------------------------------


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


# -- bands --------------------------------------------------------------------------------


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


# -- the record -----------------------------------------------------------------------------


@dataclass(frozen=True)
class AlignTransforms:
    """Every transform alignment applied, per layer, and what it achieved.

    ``arrays`` maps ``layers.{i}.mlp.perm``, ``layers.{i}.attn.kv_perm``,
    ``layers.{i}.attn.q_perm``, ``layers.{i}.attn.vo_rot`` and ``layers.{i}.attn.qk_angle``
    to arrays (conventions in the module docstring); ``distances`` maps each family to its
    relative Frobenius distance to the band mean ``(before, after)``.
    """

    stack: str
    num_layers: int
    blocks: int
    rounds: int
    num_heads: int | None
    num_kv_heads: int | None
    head_dim: int | None
    intermediate_size: int | None
    arrays: dict[str, np.ndarray]
    distances: dict[str, tuple[float, float]]
    applied: dict[str, object]
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict:
        """The ``attnquant-align.json`` manifest describing these transforms."""
        from . import __version__

        return {
            "format": ALIGN_FORMAT,
            "format_version": ALIGN_VERSION,
            "writer": f"attnquant-core {__version__}",
            "transforms_file": ALIGN_TRANSFORMS_FILE,
            "stack": self.stack,
            "num_layers": self.num_layers,
            "blocks": self.blocks,
            "bands": band_of_layers(self.num_layers, self.blocks),
            "rounds": self.rounds,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "applied": self.applied,
            "families": {
                name: {"distance_before": before, "distance_after": after}
                for name, (before, after) in self.distances.items()
            },
            "notes": list(self.notes),
            "arrays": sorted(self.arrays),
            "conventions": (
                "applied to the original weights in this order: permutations (aligned index i "
                "is original index perm[i]; q_perm/o columns per query head, kv_perm for k/v), "
                "then per KV head j: v rows <- vo_rot[j] @ v rows, o columns of its query heads "
                "<- o columns @ vo_rot[j]^T, and the rotary planes (p, p + head_dim/2) of its k "
                "and q heads rotated by qk_angle[j, p]"
            ),
        }

    def save(self, directory: str | Path) -> None:
        """Write ``attnquant-align.npz`` and ``attnquant-align.json`` into ``directory``."""
        directory = Path(directory)
        with open(directory / ALIGN_TRANSFORMS_FILE, "wb") as f:
            np.savez(f, **self.arrays)
        (directory / ALIGN_MANIFEST_FILE).write_text(json.dumps(self.to_json(), indent=2) + "\n")


def load_align_transforms(directory: str | Path) -> AlignTransforms:
    """Read the transforms an aligned checkpoint records (for :func:`unalign_state`)."""
    directory = Path(directory)
    manifest_file, m = _read_json_manifest(
        directory, ALIGN_MANIFEST_FILE, what="an aligned checkpoint", error=AlignError
    )
    if m.get("format") != ALIGN_FORMAT:
        raise AlignError(f"{manifest_file}: not an {ALIGN_FORMAT} manifest")
    if not isinstance(m.get("format_version"), int) or m["format_version"] > ALIGN_VERSION:
        raise AlignError(
            f"{manifest_file}: format version {m.get('format_version')!r} is newer than this "
            f"attnquant-core reads ({ALIGN_VERSION}); upgrade attnquant-core"
        )
    try:
        with np.load(directory / ALIGN_TRANSFORMS_FILE, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as exc:
        raise AlignError(f"{directory / ALIGN_TRANSFORMS_FILE}: cannot read ({exc})") from exc
    return AlignTransforms(
        stack=m["stack"],
        num_layers=m["num_layers"],
        blocks=m["blocks"],
        rounds=m["rounds"],
        num_heads=m["num_attention_heads"],
        num_kv_heads=m["num_key_value_heads"],
        head_dim=m["head_dim"],
        intermediate_size=m["intermediate_size"],
        arrays=arrays,
        distances={
            k: (v["distance_before"], v["distance_after"]) for k, v in m["families"].items()
        },
        applied=m["applied"],
        notes=tuple(m["notes"]),
    )


@dataclass(frozen=True)
class AlignReport:
    """What :func:`align_checkpoint` wrote and how much closer the layers came to their mean."""

    path: Path
    transforms: AlignTransforms

    @property
    def distances(self) -> dict[str, tuple[float, float]]:
        """Family -> relative distance to the band mean ``(before, after)``."""
        return self.transforms.distances

    @property
    def notes(self) -> tuple[str, ...]:
        return self.transforms.notes

    def table(self) -> str:
        """A plain-text table: per family the distance before, after and their ratio."""
        lines = [f"{'family':<18} {'before':>8} {'after':>8} {'ratio':>6}"]
        for name, (before, after) in self.distances.items():
            ratio = after / before if before > 0 else 1.0
            lines.append(f"{name:<18} {before:>8.4f} {after:>8.4f} {ratio:>6.3f}")
        return "\n".join(lines)


# -- the driver ---------------------------------------------------------------------------


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


def _check_rounds(rounds: int) -> int:
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise AlignError(f"rounds must be an int >= 1, got {rounds!r}")
    return rounds


def align_state(
    config: Mapping,
    state: Mapping[str, np.ndarray],
    *,
    blocks: int | str = 1,
    rounds: int = 3,
) -> tuple[dict[str, np.ndarray], AlignTransforms]:
    """Align a model held in memory; returns the aligned state (same keys, dtypes) and transforms.

    Parameters
    ----------
    config : mapping
        The model's ``config.json`` (head counts, head_dim, architecture).
    state : mapping of str to ndarray
        Every tensor under its Hugging Face key; tensors alignment does not touch are passed
        through as the same objects.
    blocks : int or "layers", default=1
        ``G``: layers are aligned to the mean of their band (as decomposition will band them).
    rounds : int, default=3
        Alternations of "align every layer to the target" and "target = aligned band mean".
    """
    rounds = _check_rounds(rounds)
    specs = {k: TensorSpec(np.asarray(v).dtype, tuple(np.shape(v))) for k, v in state.items()}
    layout = _layout(config, specs, "state")
    G = resolve_blocks(blocks, layout.num_layers)
    out = dict(state)

    def put(key: str, array: np.ndarray) -> None:
        out[key] = array

    transforms = _run(layout, state.__getitem__, specs, put, blocks=G, rounds=rounds)
    return out, transforms


def unalign_state(
    state: Mapping[str, np.ndarray], transforms: AlignTransforms
) -> dict[str, np.ndarray]:
    """Undo :func:`align_state`: the original parametrisation (permutations exactly, rotations
    to round-off), same keys and dtypes."""
    out = dict(state)
    layout = _Layout(
        transforms.stack,
        transforms.num_layers,
        transforms.num_heads,
        transforms.num_kv_heads,
        transforms.head_dim,
        transforms.intermediate_size,
        {},
    )
    for layer in range(transforms.num_layers):
        a = transforms.arrays
        if transforms.num_heads:
            prefix = f"layers.{layer}.attn."
            try:
                t = _AttnT(*(a[prefix + n] for n in ("kv_perm", "q_perm", "vo_rot", "qk_angle")))
            except KeyError as exc:
                raise AlignError(f"transforms have no {exc.args[0]!r}") from None
            _restore(
                out,
                layout,
                layer,
                _ATTN_PARTS,
                lambda b, t=t: _apply_attn(b, t, layout.n_rep, inverse=True),
            )
        if transforms.intermediate_size:
            name = f"layers.{layer}.mlp.perm"
            if name not in a:
                raise AlignError(f"transforms have no {name!r}")
            perm = a[name]
            _restore(
                out, layout, layer, _MLP_PARTS, lambda b, p=perm: _apply_mlp(b, p, inverse=True)
            )
    return out


def _restore(
    out: dict[str, np.ndarray],
    layout: _Layout,
    layer: int,
    parts: Mapping[str, str],
    undo: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]],
) -> None:
    keys = {part: layout.key(layer, suffix) for part, suffix in parts.items()}
    keys = {part: key for part, key in keys.items() if key in out}
    if not keys:
        raise AlignError(f"{layout.key(layer, '')}: the state has none of the aligned tensors")
    blocks = {part: _to_blocks(part, out[key], layout) for part, key in keys.items()}
    for part, B in undo(blocks).items():
        out[keys[part]] = _from_blocks(part, B, np.asarray(out[keys[part]]).dtype)


def align_checkpoint(
    src: str | Path | Checkpoint,
    out: str | Path,
    *,
    blocks: int | str = 1,
    rounds: int = 3,
    max_shard_bytes: int = 2 << 30,
    overwrite: bool = False,
) -> AlignReport:
    """Write an aligned copy of a dense checkpoint: same keys and dtypes, the same function.

    The transforms go into ``attnquant-align.npz`` (not ``*.safetensors``, which other tools
    load wholesale) and ``attnquant-align.json`` (what was applied, the distances to the band
    mean before and after). Reads one band of one family group at a time; the output is
    written to a temporary directory renamed to ``out`` when complete.
    """
    rounds = _check_rounds(rounds)
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    specs = {k: ckpt.spec(k) for k in ckpt.keys()}
    layout = _layout(ckpt.config, specs, str(ckpt.path))
    G = resolve_blocks(blocks, layout.num_layers)
    aligned_keys = {
        layout.key(layer, suffix)
        for layer in range(layout.num_layers)
        for suffix in (*_ATTN_PARTS.values(), *_MLP_PARTS.values())
    }
    with atomic_directory(Path(out), overwrite) as tmp:
        copy_side_files(ckpt.directory if ckpt.path.is_dir() else None, tmp)
        for stale in (ALIGN_TRANSFORMS_FILE, ALIGN_MANIFEST_FILE):
            (tmp / stale).unlink(missing_ok=True)
        with PlannedWriter(tmp, specs, max_shard_bytes=max_shard_bytes) as writer:
            for key in specs:
                if key not in aligned_keys:
                    writer.write(key, ckpt.get(key))
            transforms = _run(layout, ckpt.get, specs, writer.write, blocks=G, rounds=rounds)
        transforms.save(tmp)
        manifest = json.loads((tmp / ALIGN_MANIFEST_FILE).read_text())
        manifest["source"] = str(ckpt.path)
        manifest["dtypes"] = {name: dtype_name(dt) for name, dt in layout.dtypes.items()}
        (tmp / ALIGN_MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")
    return AlignReport(Path(out), transforms)
