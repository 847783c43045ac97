"""The tensors the in-graph paths feed to MAX, and their names (numpy only).

On the in-graph paths (docs/serving-paths.md, and ``ATTNQUANT_PRECOMPUTE=1``) the served
graph holds the theta tensors themselves, never ``W_eff``. The names are the
theta checkpoint's (docs/checkpoint-format.md), plus two kinds of tensor built at load for the
GEMM formulation:

``<stack>.<i>.<family>.theta_s`` ``[out]`` and ``theta_U`` ``[out, r]``
    per layer, both paths (``theta_U`` only where the layer's ``r > 0``).
``<stack>.<i>.<family>.theta_V`` ``[in, r]``
    per layer, in-graph precompute only (the GEMM path keeps ``V`` in the band weight).
``attnquant.shared.<family>.<band>.W0`` ``[out, in]``
    one per band, in-graph precompute only.
``attnquant.gemm.<group>.<band>.W0V`` ``[sum(out) + sum(r), in]``
    one per band, GEMM path: the band's ``W0`` rows of the ``k`` projections of
    ``group`` (``self_attn.qkv_proj`` = q, k, v; ``mlp.gate_up_proj`` = gate,
    up; or a single family), then the ``V^T`` rows of every layer of the band,
    layer by layer, projection by projection (each layer its own ranks). One matmul
    ``x @ W0V^T`` gives a layer both ``x W0^T`` and its ``x V`` (the layer picks its
    columns), so ``W0`` is stored once per band: weight memory follows the
    theta size. The price is the other layers' ``x V`` columns computed
    and dropped per layer: nothing at passthrough, ``(L - 1) k r`` at ``G = 1``.

The other forms (GEMM path only; how each layer is served is
:func:`attnquant_core.serving._served.served_layers`) keep the checkpoint's names:

``<stack>.<i>.<family>.theta_U``, ``theta_V``
    low rank (both), shared basis on the input side (``theta_U``, the coefficients) or on
    the output side (``theta_V``).
``attnquant.shared.<family>.<band>.basis``
    the band's basis, held once per band.
``<stack>.<i>.<family>.weight`` ``[out, in]``
    a layer served dense, rebuilt once at load (its factors are not smaller).
``attnquant.shared.<family>.<band>.W0_packed``, ``W0_scale``, ``W0_scale_2``
    a banded family whose ``W0`` is stored in NVFP4 (kind ``nvfp4``): the band's packed ``W0``
    as stored (E4M3 block scales as uint8 bytes, the per-tensor scale ``[1]``), held once per
    band, with ``<stack>.<i>.<family>.theta_s`` (``theta_U``, ``theta_V`` where ``r > 0``) per
    layer. Such a family has no ``W0V``: its q/k/v (gate/up) group runs per member, outputs
    concatenated (one :class:`~attnquant_max._nvfp4_layers.NVFP4StackedLinear` when every member
    is one).
``<stack>.<i>.<group>.theta_in`` ``[rows, in]``
    q/k/v (or gate/up) of one layer whose first matmuls all read a per-layer tensor (dense
    ``W``, low-rank ``V_l^T``, output-side ``V_l^T``): those rows stacked at load, so one
    matmul serves the group; each projection then applies its own ``U_l`` or basis. The
    members' own ``weight`` / ``theta_V`` are then not in the state.

Why not concatenate ``[W0 ; V_l^T]`` per layer in the graph: a weight-only
concat is either folded into a per-layer constant at compile time (``W0``
copied once per layer: dense-size memory) or redone on every forward (a copy of
``W0`` per layer per step). A band weight built once at load avoids both.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ..forms import band_of_layers
from ..io import NVFP4_PARTS, basis_key, nvfp4_key, shared_key, theta_key
from ._served import (
    FUSED_GROUPS,
    GEMM_PREFIX,
    Served,
    fused_group_of,
    gemm_band_key,
    gemm_groups,
    stacked_input_key,
)
from ._tensors import banded_groups, ingraph_tensors, stacked_layers, uniform_ranks

__all__ = [
    "FUSED_GROUPS",
    "InGraphLayout",
    "banded_groups",
    "gemm_band_key",
    "gemm_groups",
    "ingraph_tensors",
    "stacked_input_key",
    "stacked_layers",
    "uniform_ranks",
]


@dataclass(frozen=True, kw_only=True)
class InGraphLayout:
    """What an in-graph model must build, read back from the names and shapes of its state.

    Attributes
    ----------
    gemm : bool
        GEMM band weights (``True``) or in-graph precompute (``False``).
    groups : dict of str to tuple of str
        The banded projections computed by one matmul: ``self_attn.qkv_proj`` and
        ``mlp.gate_up_proj`` when fused, else one group per family. Families in other
        forms (GEMM path only) are in :attr:`served`, not here.
    blocks : int or None
        ``G`` of the banded groups when they share one (always on the in-graph precompute
        path); ``None`` when they differ or no family is banded.
    ranks : dict of str to int
        The largest ``r`` of each family (``0``: no correction stored).
    custom_op : bool
        With ``gemm=False``: compute with attnquant-kernels' custom ops instead of
        forming ``W_eff`` (the tensors are the same; the serving path decides).
    fused_mlp : bool
        Custom op: one ``generated_mlp`` dispatch per MLP (``ATTNQUANT_FUSED_MLP``).
    served : dict of str to tuple of Served
        GEMM path: how each layer of each family is served (:mod:`attnquant_core.serving._served`),
        banded ones included. Off the GEMM path: the families in forms without ``W0`` only
        (custom op: ``generated_lowrank``), empty when every family is banded.
    stacked : dict of str to tuple of int
        GEMM path: the layers of each fused group that run one stacked first matmul
        (``theta_in``).
    nvfp4_shapes : dict of str to (int, int)
        GEMM path: ``(out, in)`` of each banded family whose ``W0`` is NVFP4 (served kind
        ``nvfp4``), read from its packed ``W0``.
    """

    gemm: bool
    groups: dict[str, tuple[str, ...]]
    blocks: int | None
    ranks: dict[str, int]
    custom_op: bool = False
    fused_mlp: bool = True
    served: dict[str, tuple[Served, ...]] = field(default_factory=dict)
    stacked: dict[str, tuple[int, ...]] = field(default_factory=dict)
    nvfp4_shapes: dict[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def nvfp4(self) -> bool:
        """Whether some family is banded with an NVFP4 ``W0`` (served packed, decoded in the graph)."""
        return bool(self.nvfp4_shapes)

    @property
    def fused(self) -> bool:
        """Whether q/k/v and gate/up run as one group each (anywhere in the model)."""
        return any(len(members) > 1 for members in self.groups.values()) or bool(self.stacked)

    @property
    def forms(self) -> dict[str, tuple[str, ...]]:
        """GEMM path: the kind each layer of each family is served as."""
        return {name: tuple(s.kind for s in how) for name, how in self.served.items()}

    def group_of(self, family: str) -> str | None:
        """The banded group ``family`` belongs to; ``None`` for a family in another form."""
        return next((g for g, members in self.groups.items() if family in members), None)

    def group_blocks(self, group: str) -> int:
        """``G`` of a banded group."""
        if not self.gemm:
            assert self.blocks is not None
            return self.blocks
        return max(s.band for s in self.served[self.groups[group][0]]) + 1

    def keys(self, num_layers: int, *, stack: str = "layers") -> set[str]:
        """Every theta tensor name a model of this layout reads (and every layer served dense)."""
        keys: set[str] = set()
        for group, members in self.groups.items():
            for band in range(self.group_blocks(group)):
                if self.gemm:
                    keys.add(gemm_band_key(group, band))
                else:
                    keys.update(shared_key(m, band) for m in members)
            if not self.gemm:
                for family in members:
                    parts = ["s"] + (["U", "V"] if self.ranks[family] else [])
                    keys.update(
                        theta_key(stack, i, family, p) for i in range(num_layers) for p in parts
                    )
        for group, layers in self.stacked.items():
            keys.update(stacked_input_key(stack, i, group) for i in layers)
        for family, how in self.served.items():
            group = fused_group_of(family)
            in_stack = self.stacked.get(group, ()) if group is not None else ()
            for i, h in enumerate(how):
                if h.kind in ("banded", "nvfp4"):
                    keys.add(theta_key(stack, i, family, "s"))
                if h.kind == "nvfp4":
                    keys.update(nvfp4_key(family, h.band, part) for part in NVFP4_PARTS)
                    if h.rank:
                        keys.add(theta_key(stack, i, family, "V"))
                if h.kind in ("banded", "lowrank", "basis_in", "nvfp4") and h.rank:
                    keys.add(theta_key(stack, i, family, "U"))
                if h.kind in ("lowrank", "basis_out") and i not in in_stack:
                    keys.add(theta_key(stack, i, family, "V"))
                if h.kind == "dense" and i not in in_stack:
                    keys.add(f"{stack}.{i}.{family}.weight")
                if h.kind.startswith("basis"):
                    keys.add(basis_key(family, h.band))
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
        concatenated ``W_eff``, as the stock model does). On the GEMM path every family
        without a band weight is read back layer by layer from its keys (module docstring).

        Raises
        ------
        ValueError
            The theta names do not describe every family once.
        """
        gemm_bands: dict[str, set[int]] = {}
        shared_bands: dict[str, set[int]] = {}
        nvfp4_bands: dict[str, dict[int, tuple[int, int]]] = {}
        for key, shape in shapes.items():
            if (m := _PACKED.match(key)) is not None:
                out_dim, half = (int(d) for d in shape)
                nvfp4_bands.setdefault(m["family"], {})[int(m["band"])] = (out_dim, 2 * half)
            elif key.startswith(GEMM_PREFIX) and key.endswith(".W0V"):
                group, band = key[len(GEMM_PREFIX) : -len(".W0V")].rsplit(".", 1)
                gemm_bands.setdefault(group, set()).add(int(band))
            elif key.startswith("attnquant.shared.") and key.endswith(".W0"):
                family, band = key[len("attnquant.shared.") : -len(".W0")].rsplit(".", 1)
                shared_bands.setdefault(family, set()).add(int(band))
        if not (gemm_bands or shared_bands or nvfp4_bands or _has_factored(shapes, stack)):
            return None
        if gemm_bands and shared_bands:
            raise ValueError("a state holds both GEMM band weights (W0V) and W0 blocks")
        if shared_bands and nvfp4_bands:
            raise ValueError(
                "the in-graph precompute state holds NVFP4 W0 blocks: only the GEMM path serves "
                "them packed"
            )
        if shared_bands:
            return cls._precompute(shapes, families, shared_bands, fuse=fuse, stack=stack)
        return cls._gemm(shapes, families, gemm_bands, nvfp4_bands, stack=stack)

    @classmethod
    def _precompute(
        cls,
        shapes: Mapping[str, Sequence[int]],
        families: Sequence[str],
        bands: dict[str, set[int]],
        *,
        fuse: bool,
        stack: str,
    ) -> InGraphLayout:
        stacked = sorted(k for k in shapes if k.endswith(".theta_in"))
        if stacked:
            raise ValueError(
                f"the in-graph precompute state holds stacked first matmuls (GEMM path): "
                f"{stacked[:4]}"
            )
        unknown = sorted(set(bands) - set(families))
        if unknown:
            raise ValueError(
                f"the in-graph state does not hold each projection family once: "
                f"unexpected {unknown}"
            )
        # Families without W0 blocks are in forms without W0 (custom-op path), read back as
        # the GEMM path reads them, never stacked.
        num_layers = _num_layers(shapes, stack)
        factored = [f for f in families if f not in bands]
        served = _read_factored_families(shapes, factored, num_layers, {}, stack)
        groups = gemm_groups([f for f in families if f in bands], fuse=fuse)
        counts = _check_bands(bands)
        if len(set(counts.values())) != 1:
            raise ValueError(f"the families have different numbers of bands: {counts}")
        ranks = {}
        for family in bands:
            U = shapes.get(theta_key(stack, 0, family, "U"))
            ranks[family] = int(U[1]) if U is not None else 0
        for group, members in groups.items():
            if len({ranks[m] for m in members}) != 1:
                raise ValueError(f"{group}: {', '.join(members)} have different ranks")
        return cls(
            gemm=False, groups=groups, blocks=counts.popitem()[1], ranks=ranks, served=served
        )

    @classmethod
    def _gemm(
        cls,
        shapes: Mapping[str, Sequence[int]],
        families: Sequence[str],
        bands: dict[str, set[int]],
        nvfp4_bands: Mapping[str, Mapping[int, tuple[int, int]]],
        *,
        stack: str,
    ) -> InGraphLayout:
        groups = {g: FUSED_GROUPS.get(g, (g,)) for g in bands}
        covered = [m for members in groups.values() for m in members]
        unknown = sorted((set(covered) - set(families)) | (set(bands) - set(groups)))
        if unknown or len(covered) != len(set(covered)):
            raise ValueError(
                f"the in-graph state's band weights do not name each projection family once: "
                f"unexpected {unknown}, covered {sorted(covered)}"
            )
        counts = _check_bands(bands)
        num_layers = _num_layers(shapes, stack)
        served: dict[str, tuple[Served, ...]] = {}
        for group, members in groups.items():
            band_of = band_of_layers(num_layers, counts[group])
            for family in members:
                served[family] = tuple(
                    Served("banded", _width(shapes.get(theta_key(stack, i, family, "U"))), b)
                    for i, b in enumerate(band_of)
                )
        nvfp4_shapes: dict[str, tuple[int, int]] = {}
        for family, by_band in nvfp4_bands.items():
            if family not in families or family in served:
                raise ValueError(
                    f"{family}: an NVFP4 W0 for a family that is "
                    f"{'not a projection family' if family not in families else 'in a W0V'}"
                )
            if set(by_band) != set(range(len(by_band))) or len(by_band) > num_layers:
                raise ValueError(
                    f"{family}: NVFP4 W0 bands {sorted(by_band)} are not 0..G-1 with G <= "
                    f"{num_layers}"
                )
            if len(set(by_band.values())) != 1:
                raise ValueError(f"{family}: NVFP4 W0 bands of different shapes {dict(by_band)}")
            nvfp4_shapes[family] = by_band[0]
            counts[family] = len(by_band)
            served[family] = tuple(
                Served("nvfp4", _width(shapes.get(theta_key(stack, i, family, "U"))), b)
                for i, b in enumerate(band_of_layers(num_layers, len(by_band)))
            )
        stacked: dict[str, tuple[int, ...]] = {}
        for group in FUSED_GROUPS:
            layers = tuple(
                i for i in range(num_layers) if stacked_input_key(stack, i, group) in shapes
            )
            if layers:
                stacked[group] = layers
        others = [f for f in families if f not in served]
        served.update(_read_factored_families(shapes, others, num_layers, stacked, stack))
        Gs = set(counts.values())
        return cls(
            gemm=True,
            groups=groups,
            blocks=Gs.pop() if len(Gs) == 1 else None,
            ranks={f: max(s.rank for s in how) for f, how in served.items()},
            served=served,
            stacked=stacked,
            nvfp4_shapes=nvfp4_shapes,
        )


_PACKED = re.compile(r"^attnquant\.shared\.(?P<family>.+)\.(?P<band>\d+)\.W0_packed$")


def _width(shape: Sequence[int] | None) -> int:
    return int(shape[1]) if shape is not None else 0


def _check_bands(bands: Mapping[str, set[int]]) -> dict[str, int]:
    for name, seen in bands.items():
        if seen != set(range(len(seen))):
            raise ValueError(f"{name}: band weights {sorted(seen)} are not 0..G-1")
    return {name: len(seen) for name, seen in bands.items()}


def _num_layers(shapes: Mapping[str, Sequence[int]], stack: str) -> int:
    pattern = re.compile(rf"^{re.escape(stack)}\.(\d+)\.")
    layers = [int(m[1]) for key in shapes if (m := pattern.match(key))]
    if not layers:
        raise ValueError(f"the in-graph state has no tensor under {stack}.<i>.")
    return max(layers) + 1


def _has_factored(shapes: Mapping[str, Sequence[int]], stack: str) -> bool:
    """Whether the state holds a theta tensor of a family in another form than banded."""
    return any(
        (key.startswith(f"{stack}.") and ".theta_" in key)
        or (key.startswith("attnquant.shared.") and key.endswith(".basis"))
        for key in shapes
    )


def _read_factored_families(
    shapes: Mapping[str, Sequence[int]],
    families: Sequence[str],
    num_layers: int,
    stacked: Mapping[str, tuple[int, ...]],
    stack: str,
) -> dict[str, tuple[Served, ...]]:
    """:func:`_read_factored` of every family; refused in one line naming those not held."""
    served, missing = {}, []
    for family in families:
        how = _read_factored(shapes, family, num_layers, stacked, stack)
        if how is None:
            missing.append(family)
        else:
            served[family] = how
    if missing:
        raise ValueError(
            f"the in-graph state does not hold each projection family once: missing {missing}"
        )
    return served


def _read_factored(
    shapes: Mapping[str, Sequence[int]],
    family: str,
    num_layers: int,
    stacked: Mapping[str, tuple[int, ...]],
    stack: str,
) -> tuple[Served, ...] | None:
    """How each layer of a family without a band weight is served, read from its keys;
    ``None`` when the state holds nothing of it."""
    bases = []
    while (B := shapes.get(basis_key(family, len(bases)))) is not None:
        bases.append(B)
    band_of = band_of_layers(num_layers, len(bases)) if bases else [0] * num_layers
    group = fused_group_of(family)
    in_stack = stacked.get(group, ()) if group is not None else ()
    how: list[Served] = []
    for i in range(num_layers):
        U, V = (shapes.get(theta_key(stack, i, family, p)) for p in ("U", "V"))
        W = shapes.get(f"{stack}.{i}.{family}.weight")
        if shapes.get(theta_key(stack, i, family, "s")) is not None:
            raise ValueError(f"{family}: layer {i} holds theta_s but no band weight W0V")
        b = band_of[i]
        if i in in_stack:
            V = (0, 0) if U is not None or bases else None  # its V^T rows are in theta_in
            W = None if V is not None else (0, 0)
        if W is not None:
            how.append(Served("dense"))
        elif U is not None and V is not None and not bases:
            how.append(Served("lowrank", int(U[1])))
        elif bases and (U is not None) != (V is not None):
            kind = "basis_in" if U is not None else "basis_out"
            how.append(Served(kind, int(bases[b][1]), b))
        elif U is None and V is None and not bases:
            how.append(Served("zero"))
        else:
            raise ValueError(
                f"{family}: layer {i} holds a set of tensors no form has "
                f"(theta_U {U}, theta_V {V}, weight {W}, {len(bases)} bases)"
            )
    if all(h.kind == "zero" for h in how):
        return None
    return tuple(how)
