"""Theta projections as MAX graph layers (``max.nn`` modules): the in-graph paths.

Two formulations of ``y = s * (x W0^T) + (x V) U^T`` (DESIGN §1, §5.2):

* **GEMM** (``precompute=False``): the band weight ``W0V`` (see
  :mod:`attnquant_max._layout`) holds ``W0`` and the band's ``V^T`` rows, so
  ``h = x @ W0V^T`` is one matmul giving ``x W0^T`` and this layer's ``x V``;
  a second matmul applies ``U^T``: two matmuls per projection. A group (q/k/v,
  gate/up) runs as one: one matmul over the stacked ``W0`` blocks and
  down-projections, one block-diagonal up-projection.
* **In-graph precompute** (``precompute=True``, ``ATTNQUANT_PRECOMPUTE=1``):
  ``W_eff = s * W0 + U V^T`` formed in the graph, then one matmul (one over the
  concatenated ``W_eff`` for a group, as the stock model does).
* **Custom op** (``custom_op=True``, ``ATTNQUANT_GEMM=0``): the same tensors as
  in-graph precompute (``W0`` per band, ``s``, ``U``, ``V`` per layer), computed by
  attnquant-kernels' ``generated_linear`` (one dispatch per projection, ``W_eff``
  never formed) and, with ``ATTNQUANT_FUSED_MLP=1``, ``generated_mlp`` (gate, up,
  SiLU and down in one dispatch). The graph must load ``kernels_path()``.

Matmuls run in the input dtype: ``x @ w`` of two float32 tensors is float32;
for bfloat16 MAX's matmul kernels accumulate in float32 and round the output
to bfloat16, so ``x V`` is rounded to bfloat16 before ``U^T`` applies.

The shared weights (``W0V`` or ``W0`` of each band) belong to one
:class:`ThetaSharedBlocks` module; the layers of a band hold a plain reference,
so each band's weight is one graph weight however many layers use it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from max.dtype import DType
from max.graph import DeviceRef, TensorValue, Weight, ops
from max.nn import Module

from attnquant_core import band_of_layers, shared_key

from ._layout import InGraphLayout, gemm_band_key

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


def _rows(op: Callable[..., TensorValue], x: TensorValue, *operands: Any, out: int) -> TensorValue:
    """Apply a custom op that takes ``[M, in]`` to ``x`` of any rank (leading dims folded)."""
    if x.rank == 2:
        return op(x, *operands)
    lead = list(x.shape[:-1])
    y = op(ops.reshape(x, [-1, x.shape[-1]]), *operands)
    return ops.reshape(y, [*lead, out])


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
    slot : int
        GEMM: this layer's index within its band (which ``rank`` columns of
        ``x @ W0V^T`` are its ``x V``).
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
        slot: int = 0,
        precompute: bool = False,
        custom_op: bool = False,
    ) -> None:
        super().__init__()
        self.in_dim, self.out_dim, self.rank = in_dim, out_dim, rank
        precompute = precompute or custom_op  # the custom op reads the precompute tensors
        self.slot, self.precompute, self.custom_op, self.device = (
            slot,
            precompute,
            custom_op,
            device,
        )
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
                else dims[0] >= out_dim + (slot + 1) * rank
                and (dims[0] - out_dim) % max(rank, 1) == 0
            )
            if not ok:
                raise ValueError(
                    f"band weight {band.name} {dims} does not fit a [{out_dim}, {in_dim}] "
                    f"projection of rank {rank} in slot {slot}"
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

            return _rows(generated_linear, x, *self.kernel_operands(x.device), out=self.out_dim)
        if self.precompute:
            return x @ self.effective_weight(self.band.to(x.device)).T
        h = x @ self.band.to(x.device).T
        y = h[..., : self.out_dim] * self.theta_s.to(x.device)
        if self.rank:
            start = self.out_dim + self.slot * self.rank
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
        GEMM, fused: the group's band weight ``W0V`` ``[sum(out) + n * k * r, in]``,
        this layer's ``k * r`` down-projection columns at ``slot``. ``None``:
        every member runs alone (``ATTNQUANT_QKV_FUSE=0``), or, when
        precomputing, the members' ``W_eff`` are concatenated for one matmul.
    fuse_precomputed : bool
        Precompute path: one matmul over the concatenated ``W_eff``.
    """

    @property
    def _omit_module_attr_name(self) -> bool:
        return True

    def __init__(
        self,
        members: Sequence[ThetaLinear],
        names: Sequence[str],
        *,
        band: Weight | None = None,
        slot: int = 0,
        fuse_precomputed: bool = False,
    ) -> None:
        super().__init__()
        if len(members) != len(names) or not members:
            raise ValueError("ThetaStackedLinear needs one name per member")
        self._names = list(names)
        for name, member in zip(names, members, strict=True):
            setattr(self, name, member)
        self.out_dims = [m.out_dim for m in members]
        self.rank = members[0].rank
        self.slot = slot
        self.fuse_precomputed = fuse_precomputed
        if band is not None:
            in_dim = members[0].in_dim
            dims = list(band.shape.static_dims)
            need = sum(self.out_dims) + (slot + 1) * len(members) * self.rank
            if (
                dims[1] != in_dim
                or dims[0] < need
                or any(m.rank != self.rank or m.in_dim != in_dim for m in members)
            ):
                raise ValueError(
                    f"band weight {band.name} {dims} does not fit projections {self._names} "
                    f"(out {self.out_dims}, in {in_dim}, rank {self.rank}) in slot {slot}"
                )
        object.__setattr__(self, "_band", band)

    @property
    def members(self) -> list[ThetaLinear]:
        return [getattr(self, name) for name in self._names]

    def _up_projection(self, device: DeviceRef) -> TensorValue:
        """Block-diagonal ``[sum(out), k * r]``: member ``p``'s ``U`` in columns ``p*r .. (p+1)*r``."""
        members, r = self.members, self.rank
        rows = []
        for p, m in enumerate(members):
            U = TensorValue(m.theta_U).to(device)
            parts = []
            if p:
                parts.append(_zeros(U.dtype, [m.out_dim, p * r], device))
            parts.append(U)
            if p < len(members) - 1:
                parts.append(_zeros(U.dtype, [m.out_dim, (len(members) - 1 - p) * r], device))
            rows.append(ops.concat(parts, axis=1) if len(parts) > 1 else U)
        return ops.concat(rows, axis=0)

    def __call__(self, x: TensorValue) -> TensorValue:
        members = self.members
        if self._band is None:
            if self.fuse_precomputed:
                W0s = [m.band.to(x.device) for m in members]
                W = ops.concat([m.effective_weight(W0) for m, W0 in zip(members, W0s, strict=True)])
                return x @ W.T
            return ops.concat([m(x) for m in members], axis=-1)
        out = sum(self.out_dims)
        h = x @ self._band.to(x.device).T
        s = ops.concat([TensorValue(m.theta_s).to(x.device) for m in members])
        y = h[..., :out] * s
        if self.rank:
            k_r = len(members) * self.rank
            start = out + self.slot * k_r
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

            return _rows(mlp, x, out=self.down_proj.out_dim)
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
    """

    def __init__(
        self,
        layout: InGraphLayout,
        *,
        num_layers: int,
        shapes: Mapping[str, tuple[int, int]],
        dtype: DType,
        device: DeviceRef,
    ) -> None:
        self.layout = layout
        self.shapes = dict(shapes)
        self.dtype, self.device = dtype, device
        self.bands = band_of_layers(num_layers, layout.blocks)
        self.bank = ThetaSharedBlocks()

    def _slot(self, layer: int) -> tuple[int, int, int]:
        """``(band, slot within the band, layers in the band)`` of ``layer``."""
        band = self.bands[layer]
        first = self.bands.index(band)
        return band, layer - first, self.bands.count(band)

    def _band_weight(self, group: str, layer: int) -> tuple[Weight, int]:
        band, slot, size = self._slot(layer)
        members = self.layout.groups[group]
        out = sum(self.shapes[m][0] for m in members)
        in_dim = self.shapes[members[0]][1]
        rows = out + size * len(members) * self.layout.ranks[members[0]]
        key = gemm_band_key(group, band)
        return self.bank.add(key, self.dtype, [rows, in_dim], self.device), slot

    def _member(self, family: str, layer: int, band: Weight | None, slot: int) -> ThetaLinear:
        out_dim, in_dim = self.shapes[family]
        return ThetaLinear(
            in_dim,
            out_dim,
            rank=self.layout.ranks[family],
            dtype=self.dtype,
            device=self.device,
            band=band,
            slot=slot,
            precompute=not self.layout.gemm,
            custom_op=self.layout.custom_op,
        )

    def _alone(self, family: str, layer: int) -> ThetaLinear:
        if not self.layout.gemm:
            band = self.bands[layer]
            W0 = self.bank.add(
                shared_key(family, band), self.dtype, list(self.shapes[family]), self.device
            )
            return self._member(family, layer, W0, 0)
        group = self.layout.group_of(family)
        if self.layout.groups[group] != (family,):
            raise ValueError(f"{family} is fused into {group}: build the group with stacked()")
        weight, slot = self._band_weight(group, layer)
        return self._member(family, layer, weight, slot)

    def linear(self, family: str, layer: int) -> ThetaLinear:
        """The projection ``family`` of ``layer``, on its own (o_proj, down_proj)."""
        return self._alone(family, layer)

    def stacked(self, families: Sequence[str], layer: int) -> ThetaStackedLinear:
        """``families`` of ``layer`` (q/k/v or gate/up), outputs concatenated in that order.

        One band weight and two matmuls when the layout fuses them (GEMM), one
        matmul over the concatenated ``W_eff`` when precomputing with fusion,
        else each projection alone.
        """
        families = list(families)
        names = [f.rsplit(".", 1)[-1] for f in families]
        group = self.layout.group_of(families[0])
        fused = self.layout.groups[group] == tuple(families)
        if self.layout.gemm and fused:
            weight, slot = self._band_weight(group, layer)
            members = [self._member(f, layer, None, slot) for f in families]
            return ThetaStackedLinear(members, names, band=weight, slot=slot)
        members = [self._alone(f, layer) for f in families]
        precompute_fused = (
            not self.layout.gemm and not self.layout.custom_op and fused and len(families) > 1
        )
        return ThetaStackedLinear(members, names, fuse_precomputed=precompute_fused)

    def mlp(self, layer: int, prefix: str = "mlp") -> ThetaMLP:
        """The gated MLP of ``layer`` (``<prefix>.{gate,up,down}_proj``)."""
        gate_up = self.stacked([f"{prefix}.gate_proj", f"{prefix}.up_proj"], layer)
        fused = self.layout.custom_op and self.layout.fused_mlp
        return ThetaMLP(gate_up, self.linear(f"{prefix}.down_proj", layer), fused_kernel=fused)
