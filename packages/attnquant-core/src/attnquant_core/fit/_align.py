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
from pathlib import Path

import numpy as np

from ..forms._bands import resolve_blocks
from ..io._atomic import atomic_directory, copy_side_files
from ..io._checkpoint import Checkpoint, open_checkpoint
from ..io._safetensors import PlannedWriter, TensorSpec, dtype_name
from ._align_layout import (
    _ATTN_PARTS,
    _MLP_PARTS,
    ALIGN_MANIFEST_FILE,
    ALIGN_TRANSFORMS_FILE,
    AlignError,
    _from_blocks,
    _Layout,
    _layout,
    _to_blocks,
)
from ._align_solve import (
    _apply_attn,
    _apply_mlp,
    _AttnT,
    _run,
)
from ._align_transforms import AlignReport, AlignTransforms

__all__ = ["align_checkpoint", "align_state", "unalign_state"]


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
