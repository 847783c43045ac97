"""The transforms an alignment applied, as recorded beside the aligned weights
(``attnquant-align.json`` and ``attnquant-align.npz``), and the report of a run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .._version import __version__
from ..forms._bands import band_of_layers
from ..io._checkpoint import Checkpoint
from ..io._manifest import read_json_manifest
from ._align_layout import (
    ALIGN_FORMAT,
    ALIGN_MANIFEST_FILE,
    ALIGN_TRANSFORMS_FILE,
    ALIGN_VERSION,
    AlignError,
)

__all__ = ["AlignReport", "AlignTransforms", "aligned_record", "load_align_transforms"]


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
    manifest_file, m = read_json_manifest(
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


def aligned_record(ckpt: Checkpoint) -> dict:
    """The ``"aligned"`` entry of a theta manifest fitted to ``ckpt``, an aligned copy written by
    :func:`align_checkpoint` (its ``attnquant-align.{json,npz}`` travel with the side files).

    Raises :class:`AlignError` when ``ckpt`` holds no ``attnquant-align.json``.
    """
    if not (ckpt.directory / ALIGN_MANIFEST_FILE).is_file():
        raise AlignError(
            f"{ckpt.path}: not an aligned copy (no {ALIGN_MANIFEST_FILE}); aligned_from= is for "
            f"decomposing what align_checkpoint wrote"
        )
    return {
        "applied": True,
        "transforms": ALIGN_MANIFEST_FILE,
        "note": "weights and source digests are those of the aligned copy; the same function",
    }
