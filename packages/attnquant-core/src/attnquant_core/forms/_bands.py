"""Banding: cut ``L`` layers into ``G`` contiguous bands of near-equal size."""

from __future__ import annotations

import numpy as np

from .._errors import DecompositionError

__all__ = ["band_of_layers", "band_sizes", "group_blocks", "parse_blocks", "resolve_blocks"]


def parse_blocks(blocks: object) -> int | str:
    """``blocks`` as an int or ``"layers"`` (passthrough), from an int or its text; no bounds."""
    if isinstance(blocks, str):
        text = blocks.strip().lower()
        if text == "layers":
            return text
        try:
            blocks = int(text)
        except ValueError:
            raise DecompositionError(
                f"blocks={blocks!r} is not an integer or 'layers' (passthrough)"
            ) from None
    if isinstance(blocks, bool) or not isinstance(blocks, int | np.integer):
        raise DecompositionError(f"blocks must be an int or 'layers', got {blocks!r}")
    return int(blocks)


def resolve_blocks(blocks: int | str, num_layers: int) -> int:
    """Turn ``blocks`` (an int, or ``"layers"`` for passthrough) into ``G`` and check ``1 <= G <= L``."""
    blocks = parse_blocks(blocks)
    if blocks == "layers":
        return num_layers
    if not 1 <= blocks <= num_layers:
        raise DecompositionError(
            f"blocks={blocks} is outside 1..{num_layers} for a model of {num_layers} layers "
            f"(use 'layers' for passthrough)"
        )
    return blocks


def band_sizes(num_layers: int, blocks: int) -> list[int]:
    """Sizes of the ``blocks`` bands: as equal as possible, earlier bands take the extra layer."""
    if num_layers < 1:
        raise DecompositionError(f"a family needs at least one layer, got {num_layers}")
    resolve_blocks(blocks, num_layers)
    base, extra = divmod(num_layers, blocks)
    return [base + 1 if b < extra else base for b in range(blocks)]


def band_of_layers(num_layers: int, blocks: int) -> list[int]:
    """The band index of every layer, e.g. ``band_of_layers(5, 2) == [0, 0, 0, 1, 1]``."""
    out: list[int] = []
    for band, size in enumerate(band_sizes(num_layers, blocks)):
        out.extend([band] * size)
    return out


def group_blocks(blocks: int, group_layers: int, num_layers: int) -> int:
    """The bands of a group of ``group_layers`` of a model's ``num_layers`` layers at ``G = blocks``.

    A family grouped by layer shape (Gemma 4 31B's global layers) is banded within each group,
    with bands in proportion to the group's share of the layers, rounded, at least one and at
    most the group's layers: ``G = L`` is passthrough in every group and ``G = 1`` one band per
    group, and the total stays close to ``G``. E.g. 60 layers, 50 sliding and 10 global, at
    ``G = 6``: 5 bands of 10 sliding layers and one band of the 10 global layers.
    """
    G = resolve_blocks(blocks, num_layers)
    share = (2 * G * group_layers + num_layers) // (2 * num_layers)  # round half up
    return min(group_layers, max(1, share))
