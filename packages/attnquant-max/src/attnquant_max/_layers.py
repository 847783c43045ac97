"""Theta projections as MAX graph layers (``max.nn`` modules): the in-graph paths.

Two formulations of ``y = s * (x W0^T) + (x V) U^T`` (DESIGN §1, §5.2):

* **GEMM** (``precompute=False``): the band weight ``W0V`` (see
  :mod:`attnquant_max._layout`) holds ``W0`` and the band's ``V^T`` rows, so
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
* **In-graph precompute** (``precompute=True``, ``ATTNQUANT_PRECOMPUTE=1``):
  ``W_eff = s * W0 + U V^T`` formed in the graph, then one matmul (one over the
  concatenated ``W_eff`` for a group, as the stock model does).
* **Custom op** (``custom_op=True``, ``ATTNQUANT_GEMM=0``): the same tensors as
  in-graph precompute (``W0`` per band, ``s``, ``U``, ``V`` per layer), computed by
  attnquant-kernels' ``generated_linear`` (one dispatch per projection, ``W_eff``
  never formed) and, with ``ATTNQUANT_FUSED_MLP=1``, ``generated_mlp`` (gate, up,
  SiLU and down in one dispatch, where all three are banded). Families in forms without
  ``W0`` are :class:`~attnquant_max._factored_layers.FactoredLinear` layers running one
  ``generated_lowrank`` each. The graph must load ``kernels_path()``.

Matmuls run in the input dtype: ``x @ w`` of two float32 tensors is float32;
for bfloat16 MAX's matmul kernels accumulate in float32 and round the output
to bfloat16, so ``x V`` is rounded to bfloat16 before ``U^T`` applies.

The shared weights (``W0V``, ``W0`` or the basis of each band) belong to one
:class:`ThetaSharedBlocks` module; the layers of a band hold a plain reference,
so each band's weight is one graph weight however many layers use it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from max.dtype import DType
from max.graph import DeviceRef, TensorValue, Weight, ops
from max.nn import Module

from attnquant_core import band_of_layers, basis_key, shared_key
from attnquant_core.io import NVFP4_PARTS, nvfp4_key

from ._factored_layers import FactoredLinear, ThetaStackedInput
from ._layout import FUSED_GROUPS, InGraphLayout, gemm_band_key
from ._nvfp4_layers import NVFP4Linear, NVFP4StackedLinear, on_rows, packed_specs

__all__ = [
    "ThetaBuilder",
    "ThetaLinear",
    "ThetaMLP",
    "ThetaSharedBlocks",
    "ThetaStackedLinear",
]


class ThetaSharedBlocks(Module):
    """Owner of the band weights, under their full names (``attnquant.gemm.<group>.<band>.W0V``).

    Its own attribute name is left out of the weight names, so they read the
    same wherever the module is attached.
    """

    @property
    def _omit_module_attr_name(self) -> bool:
        return True

    def __init__(self) -> None:
        super().__init__()
        self._by_name: dict[str, Weight] = {}

    def add(self, name: str, dtype: DType, shape: Sequence[int], device: DeviceRef) -> Weight:
        """Create (once) and return the weight ``name``."""
        if name in self._by_name:
            weight = self._by_name[name]
            if list(weight.shape.static_dims) != list(shape) or weight.dtype != dtype:
                raise ValueError(
                    f"{name}: asked for {dtype}{list(shape)}, already {weight.dtype}"
                    f"{list(weight.shape.static_dims)}"
                )
            return weight
        weight = Weight(name, dtype, list(shape), device=device)
        setattr(self, f"block_{len(self._by_name)}", weight)
        self._by_name[name] = weight
        return weight

    def __call__(self) -> None:  # pragma: no cover - holds weights, computes nothing
        raise TypeError("ThetaSharedBlocks holds weights; it is not called")


def _zeros(dtype: DType, shape: Sequence[int], device: DeviceRef) -> TensorValue:
    return ops.broadcast_to(ops.constant(0, dtype, device=device), list(shape))


class ThetaLinear(Module):
    """One theta projection ``y = s * (x W0^T) + (x V) U^T`` of one layer.

    Parameters
    ----------
    in_dim, out_dim : int
        The projection's ``W`` is ``[out_dim, in_dim]``.
    rank : int
        ``r``; ``0`` leaves ``y = s * (x W0^T)``.
    dtype, device
        Of the weights (and the matmuls).
    band : Weight or None
        The shared weight of this layer's band: ``W0V`` of shape
        ``[out_dim + n * rank, in_dim]`` (GEMM) or ``W0`` ``[out_dim, in_dim]``
        (precompute). ``None`` for a member of a fused :class:`ThetaStackedLinear`,
        which holds only ``theta_s`` and ``theta_U`` (and ``theta_V``).
    offset : int or None
        GEMM: the first of this layer's ``rank`` columns of ``x @ W0V^T`` (its ``x V``);
        ``None``: the band's first layer (``out_dim``).
    precompute : bool
        Form ``W_eff`` in the graph and run one matmul.

    Weights: ``theta_s [out]``, ``theta_U [out, r]`` and, when precomputing,
    ``theta_V [in, r]``: the names of the theta checkpoint.
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        *,
        rank: int,
        dtype: DType,
        device: DeviceRef,
        band: Weight | None,
        offset: int | None = None,
        precompute: bool = False,
        custom_op: bool = False,
    ) -> None:
        super().__init__()
        self.in_dim, self.out_dim, self.rank = in_dim, out_dim, rank
        precompute = precompute or custom_op  # the custom op reads the precompute tensors
        self.offset = out_dim if offset is None else offset
        self.precompute, self.custom_op, self.device = precompute, custom_op, device
        self.theta_s = Weight("theta_s", dtype, [out_dim], device=device)
        if rank:
            self.theta_U = Weight("theta_U", dtype, [out_dim, rank], device=device)
            if precompute:
                self.theta_V = Weight("theta_V", dtype, [in_dim, rank], device=device)
        if band is not None:
            dims = list(band.shape.static_dims)
            ok = dims[1] == in_dim and (
                dims[0] == out_dim
                if precompute
                else dims[0] >= self.offset + rank and self.offset >= out_dim
            )
            if not ok:
                raise ValueError(
                    f"band weight {band.name} {dims} does not fit a [{out_dim}, {in_dim}] "
                    f"projection of rank {rank} at row {self.offset}"
                )
        # A reference, not a registered weight: the band's owner registers it once.
        object.__setattr__(self, "_band", band)

    @property
    def band(self) -> Weight:
        if self._band is None:
            raise TypeError("this ThetaLinear is a member of a fused group; call the group")
        return self._band

    def effective_weight(self, W0: TensorValue) -> TensorValue:
        """``W_eff = diag(s) W0 + U V^T`` (``[out, in]``), formed in the graph."""
        s = TensorValue(self.theta_s).to(W0.device)
        W = ops.unsqueeze(s, 1) * W0
        if self.rank:
            W = W + self.theta_U.to(W0.device) @ self.theta_V.to(W0.device).T
        return W

    def kernel_operands(self, device: DeviceRef) -> tuple[TensorValue, ...]:
        """``(W0, s, U, V)`` for the custom ops (``U = V = None`` at rank 0)."""
        U = TensorValue(self.theta_U).to(device) if self.rank else None
        V = TensorValue(self.theta_V).to(device) if self.rank else None
        return (self.band.to(device), TensorValue(self.theta_s).to(device), U, V)

    def __call__(self, x: TensorValue) -> TensorValue:
        if self.custom_op:
            from attnquant_kernels.graph import generated_linear

            operands = self.kernel_operands(x.device)
            return on_rows(
                x, self.in_dim, self.out_dim, lambda rows: generated_linear(rows, *operands)
            )
        if self.precompute:
            return x @ self.effective_weight(self.band.to(x.device)).T
        h = x @ self.band.to(x.device).T
        y = h[..., : self.out_dim] * self.theta_s.to(x.device)
        if self.rank:
            start = self.offset
            y = y + h[..., start : start + self.rank] @ self.theta_U.to(x.device).T
        return y


class ThetaStackedLinear(Module):
    """Projections of one input computed together: q/k/v, or gate/up; outputs concatenated.

    Its own attribute name is left out of the weight names, so the members'
    weights read ``self_attn.q_proj.theta_s`` as in the checkpoint (the stock
    ``StackedLinear`` does the same).

    Parameters
    ----------
    members : sequence of ThetaLinear
        In output order, named by ``names``.
    names : sequence of str
        ``["q_proj", "k_proj", "v_proj"]``.
    band : Weight or None
        GEMM, fused: the group's band weight ``W0V`` ``[sum(out) + sum(r), in]``,
        this layer's down-projection columns (each member's ``r`` in turn) from row
        ``offset``. ``None``: every member runs alone (``ATTNQUANT_QKV_FUSE=0``, or members
        in other forms), or, when precomputing, the members' ``W_eff`` are concatenated for
        one matmul.
    offset : int or None
        GEMM, fused: see ``band``; ``None``: ``sum(out)`` (the band's first layer).
    fuse_precomputed : bool
        Precompute path: one matmul over the concatenated ``W_eff``.
    """

    @property
    def _omit_module_attr_name(self) -> bool:
        return True

    def __init__(
        self,
        members: Sequence[Module],
        names: Sequence[str],
        *,
        band: Weight | None = None,
        offset: int | None = None,
        fuse_precomputed: bool = False,
    ) -> None:
        super().__init__()
        if len(members) != len(names) or not members:
            raise ValueError("ThetaStackedLinear needs one name per member")
        self._names = list(names)
        for name, member in zip(names, members, strict=True):
            setattr(self, name, member)
        self.out_dims = [m.out_dim for m in members]  # type: ignore[attr-defined]
        self.ranks = [m.rank for m in members]  # type: ignore[attr-defined]
        self.offset = sum(self.out_dims) if offset is None else offset
        self.fuse_precomputed = fuse_precomputed
        if band is not None:
            in_dim = members[0].in_dim  # type: ignore[attr-defined]
            dims = list(band.shape.static_dims)
            need = self.offset + sum(self.ranks)
            if (
                dims[1] != in_dim
                or dims[0] < need
                or self.offset < sum(self.out_dims)
                or any(not isinstance(m, ThetaLinear) or m.in_dim != in_dim for m in members)
            ):
                raise ValueError(
                    f"band weight {band.name} {dims} does not fit projections {self._names} "
                    f"(out {self.out_dims}, in {in_dim}, ranks {self.ranks}) at row {self.offset}"
                )
        object.__setattr__(self, "_band", band)

    @property
    def rank(self) -> int:
        """The largest member rank."""
        return max(self.ranks)

    @property
    def members(self) -> list[ThetaLinear]:
        return [getattr(self, name) for name in self._names]

    def _up_projection(self, device: DeviceRef) -> TensorValue:
        """Block-diagonal ``[sum(out), sum(r)]``: member ``p``'s ``U`` in its own ``r_p`` columns."""
        members, total = self.members, sum(self.ranks)
        rows, start = [], 0
        for m in members:
            if not m.rank:
                rows.append(_zeros(m.theta_s.dtype, [m.out_dim, total], device))
                continue
            U = TensorValue(m.theta_U).to(device)
            parts = []
            if start:
                parts.append(_zeros(U.dtype, [m.out_dim, start], device))
            parts.append(U)
            if start + m.rank < total:
                parts.append(_zeros(U.dtype, [m.out_dim, total - start - m.rank], device))
            rows.append(ops.concat(parts, axis=1) if len(parts) > 1 else U)
            start += m.rank
        return ops.concat(rows, axis=0)

    def __call__(self, x: TensorValue) -> TensorValue:
        members = self.members
        if self._band is None:
            if self.fuse_precomputed:
                W0s = [m.band.to(x.device) for m in members]
                W = ops.concat([m.effective_weight(W0) for m, W0 in zip(members, W0s, strict=True)])
                return x @ W.T
            # A fused NVFP4 member beside float ones runs the op at every batch: its many-row
            # branch (on an accelerator) would put matmuls on x inside an ops.cond next to the
            # float members' outside it, and MAX 26.7's compiler then fails ("operand does not
            # dominate this use").
            return ops.concat(
                [
                    m.fused_call(x, branch=False)
                    if isinstance(m, NVFP4Linear) and m.fused
                    else m(x)
                    for m in members
                ],
                axis=-1,
            )
        out = sum(self.out_dims)
        h = x @ self._band.to(x.device).T
        s = ops.concat([TensorValue(m.theta_s).to(x.device) for m in members])
        y = h[..., :out] * s
        if sum(self.ranks):
            start, k_r = self.offset, sum(self.ranks)
            y = y + h[..., start : start + k_r] @ self._up_projection(x.device).T
        return y


class ThetaMLP(Module):
    """The gated MLP ``down(silu(gate(x)) * up(x))`` over theta projections.

    ``gate_up_proj`` is a :class:`ThetaStackedLinear` (its name is left out of
    the weight names: ``mlp.gate_proj.theta_s``), ``down_proj`` a :class:`ThetaLinear`.
    ``fused_kernel``: one ``generated_mlp`` dispatch for the whole MLP (custom-op
    path, ``ATTNQUANT_FUSED_MLP=1``).
    """

    def __init__(
        self,
        gate_up_proj: ThetaStackedLinear,
        down_proj: ThetaLinear,
        *,
        fused_kernel: bool = False,
    ) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.feed_forward_length = gate_up_proj.out_dims[0]
        self.fused_kernel = fused_kernel

    def __call__(self, x: TensorValue) -> TensorValue:
        if self.fused_kernel:
            from attnquant_kernels.graph import generated_mlp

            gate, up = (m.kernel_operands(x.device) for m in self.gate_up_proj.members)
            down = self.down_proj.kernel_operands(x.device)

            def mlp(rows: TensorValue) -> TensorValue:
                return generated_mlp(rows, gate, up, down, activation="silu")

            hidden = self.down_proj.out_dim
            return on_rows(x, hidden, hidden, mlp)
        gate, up = ops.split(
            self.gate_up_proj(x), [self.feed_forward_length, self.feed_forward_length], axis=-1
        )
        return self.down_proj(ops.silu(gate) * up)


class ThetaBuilder:
    """Makes the theta modules of each layer for an :class:`~attnquant_max._layout.InGraphLayout`.

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
    ) -> None:
        self.layout = layout
        self.nvfp4_fused = nvfp4_fused
        self.nvfp4_tiled = nvfp4_tiled
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
        """How ``layer`` of ``family`` is served (:mod:`attnquant_max._served`); ``None`` for
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

    def mlp(self, layer: int, prefix: str = "mlp") -> ThetaMLP:
        """The gated MLP of ``layer`` (``<prefix>.{gate,up,down}_proj``)."""
        gate_up = self.stacked([f"{prefix}.gate_proj", f"{prefix}.up_proj"], layer)
        down = self.linear(f"{prefix}.down_proj", layer)
        banded = isinstance(down, ThetaLinear) and all(
            isinstance(m, ThetaLinear) for m in getattr(gate_up, "members", ())
        )
        fused = self.layout.custom_op and self.layout.fused_mlp and banded
        return ThetaMLP(gate_up, down, fused_kernel=fused)  # type: ignore[arg-type]
