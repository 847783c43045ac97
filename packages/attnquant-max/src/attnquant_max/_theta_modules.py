"""The theta modules of :mod:`attnquant_max._layers` (``max.nn`` modules): the band bank
:class:`ThetaSharedBlocks`, one projection :class:`ThetaLinear`, projections of one input
:class:`ThetaStackedLinear` and the gated :class:`ThetaMLP`.

The formulations they compute (GEMM, in-graph precompute, custom op) are described in
:mod:`attnquant_max._layers`, whose :class:`~attnquant_max._layers.ThetaBuilder` makes them for
a layout; import them from there.
"""

from __future__ import annotations

from collections.abc import Sequence

from max.dtype import DType
from max.graph import DeviceRef, TensorValue, Weight, ops
from max.nn import Module

from ._nvfp4_layers import NVFP4Linear, on_rows

__all__ = [
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


#: The gated MLPs' activations: Llama's SiLU, Gemma's tanh GELU.
MLP_ACTIVATIONS = {
    "silu": ops.silu,
    "gelu_tanh": lambda x: ops.gelu(x, approximate="tanh"),
}


class ThetaMLP(Module):
    """The gated MLP ``down(act(gate(x)) * up(x))`` over theta projections (``act``: SiLU, or
    Gemma's tanh GELU, ``activation="gelu_tanh"``).

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
        activation: str = "silu",
    ) -> None:
        super().__init__()
        if activation not in MLP_ACTIVATIONS:
            raise ValueError(f"activation {activation!r}: one of {sorted(MLP_ACTIVATIONS)}")
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.feed_forward_length = gate_up_proj.out_dims[0]
        self.fused_kernel = fused_kernel
        self.activation = activation

    def __call__(self, x: TensorValue) -> TensorValue:
        if self.fused_kernel:
            from attnquant_kernels.graph import generated_mlp

            gate, up = (m.kernel_operands(x.device) for m in self.gate_up_proj.members)
            down = self.down_proj.kernel_operands(x.device)

            def mlp(rows: TensorValue) -> TensorValue:
                return generated_mlp(rows, gate, up, down, activation=self.activation)

            hidden = self.down_proj.out_dim
            return on_rows(x, hidden, hidden, mlp)
        gate, up = ops.split(
            self.gate_up_proj(x), [self.feed_forward_length, self.feed_forward_length], axis=-1
        )
        return self.down_proj(MLP_ACTIVATIONS[self.activation](gate) * up)
