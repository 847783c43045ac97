"""Theta projections as MAX graph layers (``max.nn`` modules): the in-graph paths.

Two formulations of ``y = s * (x W0^T) + (x V) U^T`` (docs/architecture.md, docs/serving-paths.md):

* **GEMM** (``--path gemm``, ``ATTNQUANT_PATH=gemm``): the band weight ``W0V`` (see
  :mod:`attnquant_core.serving._layout`) holds ``W0`` and the band's ``V^T`` rows, so
  ``h = x @ W0V^T`` is one matmul giving ``x W0^T`` and this layer's ``x V``;
  a second matmul applies ``U^T``: two matmuls per projection. A group (q/k/v,
  gate/up) runs as one: one matmul over the stacked ``W0`` blocks and
  down-projections, one block-diagonal up-projection. Families in the other forms
  (low rank, shared basis, or served dense) are
  :class:`~attnquant_max._factored_layers.FactoredLinear` layers, their q/k/v (gate/up)
  stacked into one first matmul where the forms allow
  (:class:`~attnquant_max._factored_layers.ThetaStackedInput`). Banded families whose ``W0``
  is stored in NVFP4 are :class:`~attnquant_max._nvfp4_layers.NVFP4Linear` layers with
  ``theta`` (the band's packed ``W0`` in the bank, decoded in the graph: one fused
  ``generated_linear_nvfp4`` dispatch or dequantize-then-matmul); a q/k/v (gate/up) group of
  them only is one :class:`~attnquant_max._nvfp4_layers.NVFP4StackedLinear`, a group mixing
  them with float forms runs each member alone, outputs concatenated.
* **In-graph precompute** (``--path precompute``, ``ATTNQUANT_PATH=precompute``):
  ``W_eff = s * W0 + U V^T`` formed in the graph, then one matmul (one over the
  concatenated ``W_eff`` for a group, as the stock model does).
* **Custom op** (``--path custom-op``, ``ATTNQUANT_PATH=custom-op``): the same tensors as
  in-graph precompute (``W0`` per band, ``s``, ``U``, ``V`` per layer), computed by
  attnquant-kernels' ``generated_linear`` (one dispatch per projection, ``W_eff``
  never formed) and, with ``--fused-mlp`` (``ATTNQUANT_FUSED_MLP=1``), ``generated_mlp`` (gate, up,
  SiLU and down in one dispatch, where all three are banded). Families in forms without
  ``W0`` are :class:`~attnquant_max._factored_layers.FactoredLinear` layers running one
  ``generated_lowrank`` each. The graph must load ``kernels_path()``.

Matmuls run in the input dtype: ``x @ w`` of two float32 tensors is float32;
for bfloat16 MAX's matmul kernels accumulate in float32 and round the output
to bfloat16, so ``x V`` is rounded to bfloat16 before ``U^T`` applies.

The shared weights (``W0V``, ``W0`` or the basis of each band) belong to one
:class:`ThetaSharedBlocks` module; the layers of a band hold a plain reference,
so each band's weight is one graph weight however many layers use it.

The modules themselves (:class:`ThetaSharedBlocks`, :class:`ThetaLinear`,
:class:`ThetaStackedLinear`, :class:`ThetaMLP`) live in :mod:`attnquant_max._theta_modules`
and are re-exported here; this module makes them for a layout (:class:`ThetaBuilder`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from max.dtype import DType
from max.graph import DeviceRef, Weight

from attnquant_core import band_of_layers, basis_key, shared_key
from attnquant_core.io import NVFP4_PARTS, nvfp4_key
from attnquant_core.serving import FUSED_GROUPS, InGraphLayout, gemm_band_key

from ._factored_layers import FactoredLinear, ThetaStackedInput
from ._nvfp4_layers import NVFP4Linear, NVFP4StackedLinear, packed_specs
from ._theta_modules import ThetaLinear, ThetaMLP, ThetaSharedBlocks, ThetaStackedLinear

__all__ = [
    "ThetaBuilder",
    "ThetaLinear",
    "ThetaMLP",
    "ThetaSharedBlocks",
    "ThetaStackedLinear",
]


class ThetaBuilder:
    """Makes the theta modules of each layer for an :class:`~attnquant_core.serving.InGraphLayout`.

    Every band weight is created once, in :attr:`bank`; attach ``bank`` to the
    model (any attribute name: it is left out of the weight names).

    Parameters
    ----------
    layout : InGraphLayout
        Formulation, groups, ``G`` and ranks.
    num_layers : int
        ``L``; bands are :func:`attnquant_core.band_of_layers` ``(L, G)``.
    shapes : mapping of family to (out, in)
        The projection shapes.
    dtype, device
        Of every theta weight.
    nvfp4_fused : bool
        GEMM, families whose ``W0`` is NVFP4: one ``generated_linear_nvfp4`` dispatch per
        projection (``True``) or ``W0`` dequantized in the graph (``ATTNQUANT_NVFP4_KERNEL``).
    nvfp4_tiled : bool
        Fused on the CPU: the packed ``W0`` are held in the tiled layout
        (:func:`attnquant_max._nvfp4_layers.nvfp4_tiled`).
    nvfp4_int8 : bool
        Tiled: int8 activations at every row count (``--nvfp4-int8``).
    """

    def __init__(
        self,
        layout: InGraphLayout,
        *,
        num_layers: int,
        shapes: Mapping[str, tuple[int, int]],
        dtype: DType,
        device: DeviceRef,
        nvfp4_fused: bool = False,
        nvfp4_tiled: bool = False,
        nvfp4_int8: bool = False,
    ) -> None:
        self.layout = layout
        self.nvfp4_fused = nvfp4_fused
        self.nvfp4_tiled = nvfp4_tiled
        self.nvfp4_int8 = nvfp4_int8
        self.shapes = dict(shapes)
        self.dtype, self.device = dtype, device
        self.num_layers = num_layers
        self.bands = None if layout.gemm else band_of_layers(num_layers, layout.blocks or 1)
        self.bank = ThetaSharedBlocks()

    def _band_weight(self, group: str, layer: int) -> tuple[Weight, int]:
        """GEMM: the band weight of ``group`` holding ``layer``, and the row of its ``x V``."""
        members = self.layout.groups[group]
        served = [self.layout.served[m] for m in members]
        band = served[0][layer].band
        in_band = [i for i, s in enumerate(served[0]) if s.band == band]
        ranks = {i: sum(how[i].rank for how in served) for i in in_band}
        out = sum(self.shapes[m][0] for m in members)
        in_dim = self.shapes[members[0]][1]
        rows = out + sum(ranks.values())
        offset = out + sum(ranks[i] for i in in_band if i < layer)
        key = gemm_band_key(group, band)
        return self.bank.add(key, self.dtype, [rows, in_dim], self.device), offset

    def _rank(self, family: str, layer: int) -> int:
        if self.layout.gemm:
            return self.layout.served[family][layer].rank
        return self.layout.ranks[family]

    def _member(
        self, family: str, layer: int, band: Weight | None, offset: int | None = None
    ) -> ThetaLinear:
        out_dim, in_dim = self.shapes[family]
        return ThetaLinear(
            in_dim,
            out_dim,
            rank=self._rank(family, layer),
            dtype=self.dtype,
            device=self.device,
            band=band,
            offset=offset,
            precompute=not self.layout.gemm,
            custom_op=self.layout.custom_op,
        )

    def _factored(self, family: str, layer: int, *, own_input: bool = True) -> FactoredLinear:
        """``family`` of ``layer`` in a form without ``W0`` (its basis held in the bank)."""
        how = self.layout.served[family][layer]
        out_dim, in_dim = self.shapes[family]
        basis = None
        if how.kind.startswith("basis"):
            dim = in_dim if how.kind == "basis_in" else out_dim
            basis = self.bank.add(
                basis_key(family, how.band), self.dtype, [dim, how.rank], self.device
            )
        return FactoredLinear(
            in_dim,
            out_dim,
            kind=how.kind,
            rank=how.rank,
            dtype=self.dtype,
            device=self.device,
            basis=basis,
            own_input=own_input,
            custom_op=self.layout.custom_op,
        )

    def _kind(self, family: str, layer: int) -> str | None:
        """How ``layer`` of ``family`` is served (:mod:`attnquant_core.serving._served`); ``None`` for
        a banded family off the GEMM path."""
        how = self.layout.served.get(family)
        return how[layer].kind if how else None

    def _nvfp4(self, family: str, layer: int) -> NVFP4Linear:
        """GEMM: ``family`` of ``layer`` banded with an NVFP4 ``W0``, the band's three packed
        tensors created once in the bank under the checkpoint's names."""
        how = self.layout.served[family][layer]
        out_dim, in_dim = self.shapes[family]
        w, ws, ws2 = (
            self.bank.add(nvfp4_key(family, how.band, part), dt, shape, self.device)
            for part, (dt, shape) in zip(NVFP4_PARTS, packed_specs(out_dim, in_dim), strict=True)
        )
        return NVFP4Linear(
            in_dim,
            out_dim,
            dtype=self.dtype,
            device=self.device,
            fused=self.nvfp4_fused,
            tiled=self.nvfp4_tiled,
            int8=self.nvfp4_int8,
            band=(w, ws, ws2),
            theta=True,
            rank=how.rank,
        )

    def _alone(self, family: str, layer: int) -> ThetaLinear | FactoredLinear | NVFP4Linear:
        kind = self._kind(family, layer)
        if kind == "nvfp4":
            return self._nvfp4(family, layer)
        if kind is not None and kind != "banded":
            return self._factored(family, layer)
        if not self.layout.gemm:
            assert self.bands is not None
            band = self.bands[layer]
            W0 = self.bank.add(
                shared_key(family, band), self.dtype, list(self.shapes[family]), self.device
            )
            return self._member(family, layer, W0)
        group = self.layout.group_of(family)
        assert group is not None
        if self.layout.groups[group] != (family,):
            raise ValueError(f"{family} is fused into {group}: build the group with stacked()")
        weight, offset = self._band_weight(group, layer)
        return self._member(family, layer, weight, offset)

    def linear(self, family: str, layer: int) -> ThetaLinear | FactoredLinear | NVFP4Linear:
        """The projection ``family`` of ``layer``, on its own (o_proj, down_proj)."""
        return self._alone(family, layer)

    def stacked(
        self, families: Sequence[str], layer: int
    ) -> ThetaStackedLinear | ThetaStackedInput | NVFP4StackedLinear:
        """``families`` of ``layer`` (q/k/v or gate/up), outputs concatenated in that order.

        GEMM: one band weight and two matmuls when the layout fuses them (banded), one
        stacked first matmul and a second per projection (:class:`ThetaStackedInput`) when
        their forms allow, one :class:`~attnquant_max._nvfp4_layers.NVFP4StackedLinear` when
        every member is banded with an NVFP4 ``W0``, else each projection alone (a group
        mixing NVFP4 and float members among them). Precompute: one matmul over the
        concatenated ``W_eff`` when fused, else each projection alone.
        """
        families = list(families)
        names = [f.rsplit(".", 1)[-1] for f in families]
        if all(self._kind(f, layer) == "nvfp4" for f in families):
            return NVFP4StackedLinear([self._nvfp4(f, layer) for f in families], names)
        group = self.layout.group_of(families[0])
        fused = group is not None and self.layout.groups[group] == tuple(families)
        if self.layout.gemm and fused:
            assert group is not None
            weight, offset = self._band_weight(group, layer)
            members = [self._member(f, layer, None) for f in families]
            return ThetaStackedLinear(members, names, band=weight, offset=offset)
        stacked = next((g for g, m in FUSED_GROUPS.items() if m == tuple(families)), None)
        if self.layout.gemm and layer in self.layout.stacked.get(stacked or "", ()):
            assert stacked is not None
            parts = [self._factored(f, layer, own_input=False) for f in families]
            name = stacked.rsplit(".", 1)[-1]
            return ThetaStackedInput(parts, names, name=name, dtype=self.dtype, device=self.device)
        members = [self._alone(f, layer) for f in families]
        precompute_fused = (
            not self.layout.gemm and not self.layout.custom_op and fused and len(families) > 1
        )
        return ThetaStackedLinear(members, names, fuse_precomputed=precompute_fused)

    def mlp(self, layer: int, prefix: str = "mlp", *, activation: str = "silu") -> ThetaMLP:
        """The gated MLP of ``layer`` (``<prefix>.{gate,up,down}_proj``), ``activation`` of
        :data:`~attnquant_max._theta_modules.MLP_ACTIVATIONS`."""
        gate_up = self.stacked([f"{prefix}.gate_proj", f"{prefix}.up_proj"], layer)
        down = self.linear(f"{prefix}.down_proj", layer)
        banded = isinstance(down, ThetaLinear) and all(
            isinstance(m, ThetaLinear) for m in getattr(gate_up, "members", ())
        )
        fused = self.layout.custom_op and self.layout.fused_mlp and banded
        return ThetaMLP(gate_up, down, fused_kernel=fused, activation=activation)  # type: ignore[arg-type]
