"""The forms without ``W0`` as MAX graph layers: low rank, shared basis, dense, zero.

How a layer of a family is served is :class:`attnquant_core.serving.Served`; this module computes
it, each projection in at most two matmuls over the tensors the theta checkpoint stores:

=============  ==========================  ===================
kind           first matmul                second matmul
=============  ==========================  ===================
``dense``      ``x W^T``                   (none)
``lowrank``    ``t = x V_l``               ``t U_l^T``
``basis_in``   ``t = x B_b``               ``t U_l^T``
``basis_out``  ``t = x V_l``               ``t B_b^T``
``zero``       (none: ``y = 0``)
=============  ==========================  ===================

On the custom-op path (``custom_op=True``, ``ATTNQUANT_GEMM=0``) the low-rank and shared-basis
kinds run both matmuls in one ``generated_lowrank`` dispatch of attnquant-kernels
(``y = (x V) U^T`` with ``V`` = ``V_l`` or ``B_b``, ``U`` = ``U_l`` or ``B_b``); dense and zero
are as above.

``B_b`` is one weight per band, owned by the model's
:class:`~attnquant_max._layers.ThetaSharedBlocks`; the layers of the band hold a reference.
:class:`ThetaStackedInput` runs q/k/v (or gate/up) of one layer whose first matmuls all read
a per-layer tensor as one matmul over those rows, stacked at load (``theta_in``).
"""

from __future__ import annotations

from collections.abc import Sequence

from max.dtype import DType
from max.graph import DeviceRef, TensorValue, Weight, ops
from max.nn import Module

from attnquant_core.serving import FACTORED_KINDS

from ._nvfp4_layers import on_rows

__all__ = ["FactoredLinear", "ThetaStackedInput"]


class FactoredLinear(Module):
    """One projection of one layer in a form without ``W0`` (see the module docstring).

    Parameters
    ----------
    in_dim, out_dim : int
        The projection's ``W`` is ``[out_dim, in_dim]``.
    kind : str
        ``dense``, ``lowrank``, ``basis_in``, ``basis_out`` or ``zero``.
    rank : int
        Columns of ``U``/``V``, or the basis width; ignored for ``dense`` and ``zero``.
    dtype, device
        Of the weights (and the matmuls).
    basis : Weight or None
        The band's basis (shared-basis kinds): ``[in, rank]`` (``basis_in``) or
        ``[out, rank]`` (``basis_out``).
    own_input : bool
        ``False`` for a member of a :class:`ThetaStackedInput`, which holds this layer's
        first-matmul rows (``W`` or ``V^T``); this module then holds only its second factor.
    custom_op : bool
        Low rank and shared basis: one ``generated_lowrank`` dispatch instead of two matmuls.

    Weights (the theta checkpoint's names): ``weight`` (dense), ``theta_U`` (low rank, input
    side basis), ``theta_V`` (low rank, output side basis).
    """

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        *,
        kind: str,
        rank: int,
        dtype: DType,
        device: DeviceRef,
        basis: Weight | None = None,
        own_input: bool = True,
        custom_op: bool = False,
    ) -> None:
        super().__init__()
        if kind not in FACTORED_KINDS:
            raise ValueError(f"FactoredLinear serves {FACTORED_KINDS}, not {kind!r}")
        if custom_op and not own_input:
            raise ValueError("a FactoredLinear on the custom op holds its own first factor")
        self.custom_op = custom_op
        self.in_dim, self.out_dim, self.kind, self.device = in_dim, out_dim, kind, device
        self.rank = rank if kind in ("lowrank", "basis_in", "basis_out") else 0
        self.own_input = own_input
        if kind == "dense" and own_input:
            self.weight = Weight("weight", dtype, [out_dim, in_dim], device=device)
        if kind in ("lowrank", "basis_in"):
            self.theta_U = Weight("theta_U", dtype, [out_dim, rank], device=device)
        if kind in ("lowrank", "basis_out") and own_input:
            self.theta_V = Weight("theta_V", dtype, [in_dim, rank], device=device)
        if kind.startswith("basis"):
            want = [in_dim if kind == "basis_in" else out_dim, rank]
            if basis is None or list(basis.shape.static_dims) != want:
                got = None if basis is None else list(basis.shape.static_dims)
                raise ValueError(f"{kind} of rank {rank} needs a basis {want}, got {got}")
        # A reference, not a registered weight: the band's owner registers it once.
        object.__setattr__(self, "_basis", basis)

    @property
    def input_rows(self) -> int:
        """Columns of the first matmul's output: ``out`` (dense), ``rank``, or 0 (zero)."""
        return self.out_dim if self.kind == "dense" else self.rank

    def first(self, x: TensorValue) -> TensorValue:
        """The first matmul: ``x W^T``, ``x V_l`` or ``x B_b``."""
        if not self.own_input:
            raise TypeError("this FactoredLinear is a member of a ThetaStackedInput")
        if self.kind == "dense":
            return x @ self.weight.to(x.device).T
        if self.kind == "basis_in":
            return x @ self._basis.to(x.device)
        return x @ self.theta_V.to(x.device)

    def second(self, h: TensorValue) -> TensorValue:
        """The second matmul on the first's output: none, ``h U_l^T`` or ``h B_b^T``."""
        if self.kind == "dense":
            return h
        if self.kind == "basis_out":
            return h @ self._basis.to(h.device).T
        return h @ self.theta_U.to(h.device).T

    def factors(self, device: DeviceRef) -> tuple[TensorValue, TensorValue]:
        """``(U, V)`` with ``W = U V^T`` (low rank and shared basis), for ``generated_lowrank``."""
        if self.kind == "lowrank":
            U, V = self.theta_U, self.theta_V
        elif self.kind == "basis_in":
            U, V = self.theta_U, self._basis
        elif self.kind == "basis_out":
            U, V = self._basis, self.theta_V
        else:
            raise TypeError(f"a {self.kind} projection has no factors")
        return TensorValue(U).to(device), TensorValue(V).to(device)

    def __call__(self, x: TensorValue) -> TensorValue:
        if self.kind == "zero":
            zero = ops.constant(0, x.dtype, device=x.device)
            return ops.broadcast_to(zero, [*x.shape[:-1], self.out_dim])
        if self.custom_op and self.kind != "dense":
            from attnquant_kernels.graph import generated_lowrank

            U, V = self.factors(x.device)
            return on_rows(x, self.in_dim, self.out_dim, lambda rows: generated_lowrank(rows, U, V))
        return self.second(self.first(x))


class ThetaStackedInput(Module):
    """q/k/v (or gate/up) of one layer: one first matmul over the stacked rows, then each
    projection's own second factor; outputs concatenated in member order.

    Its own attribute name is left out of the weight names (as ``ThetaStackedLinear`` does), so
    the members' weights read ``self_attn.q_proj.theta_U``; the stacked rows are
    ``<name>.theta_in`` (``self_attn.qkv_proj.theta_in``).

    Parameters
    ----------
    members : sequence of FactoredLinear
        Built with ``own_input=False``, each of kind ``dense``, ``lowrank`` or ``basis_out``.
    names : sequence of str
        ``["q_proj", "k_proj", "v_proj"]``.
    name : str
        The group's attribute name, ``qkv_proj`` or ``gate_up_proj``.
    """

    @property
    def _omit_module_attr_name(self) -> bool:
        return True

    def __init__(
        self,
        members: Sequence[FactoredLinear],
        names: Sequence[str],
        *,
        name: str,
        dtype: DType,
        device: DeviceRef,
    ) -> None:
        super().__init__()
        if len(members) != len(names) or not members:
            raise ValueError("ThetaStackedInput needs one name per member")
        in_dim = members[0].in_dim
        bad = [
            n
            for n, m in zip(names, members, strict=True)
            if m.own_input or m.in_dim != in_dim or m.kind not in ("dense", "lowrank", "basis_out")
        ]
        if bad:
            raise ValueError(
                f"ThetaStackedInput cannot stack {bad}: need own_input=False, one in_dim"
            )
        self._names = list(names)
        for n, m in zip(names, members, strict=True):
            setattr(self, n, m)
        self.out_dims = [m.out_dim for m in members]
        rows = sum(m.input_rows for m in members)
        self.theta_in = Weight(f"{name}.theta_in", dtype, [rows, in_dim], device=device)

    @property
    def members(self) -> list[FactoredLinear]:
        return [getattr(self, n) for n in self._names]

    def __call__(self, x: TensorValue) -> TensorValue:
        h = x @ self.theta_in.to(x.device).T
        outs, start = [], 0
        for m in self.members:
            outs.append(m.second(h[..., start : start + m.input_rows]))
            start += m.input_rows
        return ops.concat(outs, axis=-1)
