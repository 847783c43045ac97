"""A theta checkpoint with its ``W0`` in NVFP4 (format version 4), served in the graph (numpy only).

``attnquant decompose --quant nvfp4`` stores each band's ``W0`` as three tensors and each layer's
``s``, ``U``, ``V`` as usual. The in-graph model holds exactly those, under the checkpoint's
names (after MAX's adapter strips ``model.``):

``attnquant.shared.<family>.<band>.W0_packed``   uint8   ``[out, in/2]``   one per band
``attnquant.shared.<family>.<band>.W0_scale``    uint8   ``[out, in/16]``  the E4M3 bytes
``attnquant.shared.<family>.<band>.W0_scale_2``  float32 ``[1]``           (``[]`` on disk)
``<stack>.<i>.<family>.theta_s``                 ``[out]``                 every layer
``<stack>.<i>.<family>.theta_U``, ``theta_V``    ``[out, r]``, ``[in, r]`` layers with ``r > 0``

so the weights held are the checkpoint's stored bytes: nothing is dequantized at load.
:class:`NVFP4ThetaLayout` reads the bands and ranks back from those names and shapes;
:class:`attnquant_max._ingraph.NVFP4ThetaLlama3` builds the model from it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from attnquant_core import band_of_layers, theta_key
from attnquant_core.io import NVFP4_PARTS, nvfp4_key

__all__ = ["NVFP4ThetaLayout", "is_nvfp4_theta_state"]

_PACKED = re.compile(r"^attnquant\.shared\.(?P<family>.+)\.(?P<band>\d+)\.W0_packed$")


def is_nvfp4_theta_state(keys: Mapping[str, object] | Sequence[str]) -> bool:
    """Whether a state (its keys) holds an NVFP4 ``W0`` band (``...W0_packed``)."""
    return any(_PACKED.match(key) for key in keys)


@dataclass(frozen=True, kw_only=True)
class NVFP4ThetaLayout:
    """What the in-graph model of an NVFP4-``W0`` theta state builds, read from its names and shapes.

    Attributes
    ----------
    shapes : dict of str to (int, int)
        ``(out, in)`` of each family's ``W``.
    bands : dict of str to tuple of int
        The band of every layer of each family (contiguous, :func:`attnquant_core.band_of_layers`).
    ranks : dict of str to tuple of int
        The correction rank of every layer of each family (``0``: no ``theta_U``/``theta_V``).
    """

    shapes: dict[str, tuple[int, int]]
    bands: dict[str, tuple[int, ...]]
    ranks: dict[str, tuple[int, ...]]

    @property
    def num_layers(self) -> int:
        return len(next(iter(self.bands.values())))

    @property
    def blocks(self) -> dict[str, int]:
        """``G`` of each family."""
        return {family: max(bands) + 1 for family, bands in self.bands.items()}

    def keys(self, *, stack: str = "layers") -> set[str]:
        """Every theta tensor name the model reads: three per band, ``s`` (``U``, ``V``) per layer."""
        keys: set[str] = set()
        for family, bands in self.bands.items():
            for band in range(max(bands) + 1):
                keys.update(nvfp4_key(family, band, part) for part in NVFP4_PARTS)
            for i, rank in enumerate(self.ranks[family]):
                parts = ("s", "U", "V") if rank else ("s",)
                keys.update(theta_key(stack, i, family, p) for p in parts)
        return keys

    @classmethod
    def from_state(
        cls,
        shapes: Mapping[str, Sequence[int]],
        families: Sequence[str],
        *,
        stack: str = "layers",
    ) -> NVFP4ThetaLayout | None:
        """The layout of a state (``name -> shape``); ``None`` when it holds no NVFP4 ``W0``.

        Raises
        ------
        ValueError
            A family of ``families`` has no NVFP4 ``W0`` (the in-graph NVFP4 model serves
            checkpoints whose every family stores one), or its bands are not ``0..G-1``.
        """
        seen: dict[str, dict[int, tuple[int, int]]] = {}
        for key, shape in shapes.items():
            m = _PACKED.match(key)
            if m is not None:
                out_dim, half = (int(d) for d in shape)
                seen.setdefault(m["family"], {})[int(m["band"])] = (out_dim, 2 * half)
        if not seen:
            return None
        missing = [f for f in families if f not in seen]
        unknown = sorted(set(seen) - set(families))
        if missing or unknown:
            raise ValueError(
                f"the NVFP4 theta state does not hold an NVFP4 W0 for each projection family "
                f"once: missing {missing}, unexpected {unknown}"
            )
        pattern = re.compile(rf"^{re.escape(stack)}\.(\d+)\.")
        layers = [int(m[1]) for key in shapes if (m := pattern.match(key))]
        if not layers:
            raise ValueError(f"the NVFP4 theta state has no tensor under {stack}.<i>.")
        num_layers = max(layers) + 1
        out_shapes, bands, ranks = {}, {}, {}
        for family in families:
            by_band = seen[family]
            if sorted(by_band) != list(range(len(by_band))) or len(by_band) > num_layers:
                raise ValueError(
                    f"{family}: NVFP4 W0 bands {sorted(by_band)} are not 0..G-1 with G <= "
                    f"{num_layers}"
                )
            if len(set(by_band.values())) != 1:
                raise ValueError(f"{family}: NVFP4 W0 bands of different shapes {by_band}")
            out_shapes[family] = by_band[0]
            bands[family] = tuple(band_of_layers(num_layers, len(by_band)))
            ranks[family] = tuple(
                int(U[1]) if (U := shapes.get(theta_key(stack, i, family, "U"))) else 0
                for i in range(num_layers)
            )
        return cls(shapes=out_shapes, bands=bands, ranks=ranks)
