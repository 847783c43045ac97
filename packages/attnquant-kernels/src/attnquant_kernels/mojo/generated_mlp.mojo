# generated_mlp: the gated MLP y = down(act(gate(x)) * up(x)) over three theta
# projections in one dispatch; the [M, F] intermediate stays in float32 scratch
# inside the op, every sum is float32.
#
#   y  [M, H]    output, dtype of x
#   x  [M, H]
#   gate: W0_g [F, H], s_g [F], U_g [F, rg], V_g [H, rg]
#   up:   W0_u [F, H], s_u [F], U_u [F, ru], V_u [H, ru]
#   down: W0_d [H, F], s_d [H], U_d [H, rd], V_d [F, rd]
#   parameter activation: "silu" (Llama) or "gelu_tanh" (Gemma)
#
# Each rank may differ, 0 <= r <= 64; above 64 the op is refused (ATTNQUANT_GEMM=1).

import extensibility as compiler
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu, is_gpu

from ._common import (
    activation_code,
    check_dim,
    check_rank,
    row_stride,
    vector_stride,
)
from ._cpu import theta_mlp_cpu
from ._gpu import theta_mlp_gpu

comptime OP = "generated_mlp"


@compiler.register("generated_mlp")
struct GeneratedMLP:
    @staticmethod
    def execute[
        target: StaticString,
        activation: StaticString,
    ](
        y: OutputTensor[rank=2, ...],
        x: InputTensor[dtype=y.dtype, rank=2, ...],
        w0_g: InputTensor[dtype=y.dtype, rank=2, ...],
        s_g: InputTensor[dtype=y.dtype, rank=1, ...],
        u_g: InputTensor[dtype=y.dtype, rank=2, ...],
        v_g: InputTensor[dtype=y.dtype, rank=2, ...],
        w0_u: InputTensor[dtype=y.dtype, rank=2, ...],
        s_u: InputTensor[dtype=y.dtype, rank=1, ...],
        u_u: InputTensor[dtype=y.dtype, rank=2, ...],
        v_u: InputTensor[dtype=y.dtype, rank=2, ...],
        w0_d: InputTensor[dtype=y.dtype, rank=2, ...],
        s_d: InputTensor[dtype=y.dtype, rank=1, ...],
        u_d: InputTensor[dtype=y.dtype, rank=2, ...],
        v_d: InputTensor[dtype=y.dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert (
            y.dtype.is_floating_point()
        ), "generated_mlp: float tensors only"
        comptime act = activation_code[activation]()
        var M = x.dim_size(0)
        var H = x.dim_size(1)
        var F = w0_g.dim_size(0)
        var r_g = u_g.dim_size(1)
        var r_u = u_u.dim_size(1)
        var r_d = u_d.dim_size(1)
        check_rank(OP, "gate", r_g)
        check_rank(OP, "up", r_u)
        check_rank(OP, "down", r_d)
        # gate
        check_dim(OP, "W0_gate", 1, w0_g.dim_size(1), H)
        check_dim(OP, "s_gate", 0, s_g.dim_size(0), F)
        check_dim(OP, "U_gate", 0, u_g.dim_size(0), F)
        check_dim(OP, "V_gate", 0, v_g.dim_size(0), H)
        check_dim(OP, "V_gate", 1, v_g.dim_size(1), r_g)
        # up
        check_dim(OP, "W0_up", 0, w0_u.dim_size(0), F)
        check_dim(OP, "W0_up", 1, w0_u.dim_size(1), H)
        check_dim(OP, "s_up", 0, s_u.dim_size(0), F)
        check_dim(OP, "U_up", 0, u_u.dim_size(0), F)
        check_dim(OP, "V_up", 0, v_u.dim_size(0), H)
        check_dim(OP, "V_up", 1, v_u.dim_size(1), r_u)
        # down
        check_dim(OP, "W0_down", 0, w0_d.dim_size(0), H)
        check_dim(OP, "W0_down", 1, w0_d.dim_size(1), F)
        check_dim(OP, "s_down", 0, s_d.dim_size(0), H)
        check_dim(OP, "U_down", 0, u_d.dim_size(0), H)
        check_dim(OP, "V_down", 0, v_d.dim_size(0), F)
        check_dim(OP, "V_down", 1, v_d.dim_size(1), r_d)
        check_dim(OP, "y", 0, y.dim_size(0), M)
        check_dim(OP, "y", 1, y.dim_size(1), H)
        vector_stride(OP, "s_gate", s_g)
        vector_stride(OP, "s_up", s_u)
        vector_stride(OP, "s_down", s_d)
        var xs = row_stride(OP, "x", x)
        var w0_gs = row_stride(OP, "W0_gate", w0_g)
        var u_gs = row_stride(OP, "U_gate", u_g)
        var v_gs = row_stride(OP, "V_gate", v_g)
        var w0_us = row_stride(OP, "W0_up", w0_u)
        var u_us = row_stride(OP, "U_up", u_u)
        var v_us = row_stride(OP, "V_up", v_u)
        var w0_ds = row_stride(OP, "W0_down", w0_d)
        var u_ds = row_stride(OP, "U_down", u_d)
        var v_ds = row_stride(OP, "V_down", v_d)
        if M > 0 and H > 1 and y.stride_length(1) != 1:
            raise Error(OP, ": y rows are not contiguous")
        var ys = y.stride_length(0)

        comptime if is_cpu[target]():
            theta_mlp_cpu[x.dtype, w0_g.dtype, y.dtype, act](
                x.unsafe_ptr(),
                xs,
                M,
                H,
                F,
                w0_g.unsafe_ptr(),
                w0_gs,
                s_g.unsafe_ptr(),
                u_g.unsafe_ptr(),
                u_gs,
                v_g.unsafe_ptr(),
                v_gs,
                r_g,
                w0_u.unsafe_ptr(),
                w0_us,
                s_u.unsafe_ptr(),
                u_u.unsafe_ptr(),
                u_us,
                v_u.unsafe_ptr(),
                v_us,
                r_u,
                w0_d.unsafe_ptr(),
                w0_ds,
                s_d.unsafe_ptr(),
                u_d.unsafe_ptr(),
                u_ds,
                v_d.unsafe_ptr(),
                v_ds,
                r_d,
                y.unsafe_ptr(),
                ys,
            )
        elif is_gpu[target]():
            theta_mlp_gpu[x.dtype, w0_g.dtype, y.dtype, act](
                ctx,
                x.unsafe_ptr(),
                xs,
                M,
                H,
                F,
                w0_g.unsafe_ptr(),
                w0_gs,
                s_g.unsafe_ptr(),
                u_g.unsafe_ptr(),
                u_gs,
                v_g.unsafe_ptr(),
                v_gs,
                r_g,
                w0_u.unsafe_ptr(),
                w0_us,
                s_u.unsafe_ptr(),
                u_u.unsafe_ptr(),
                u_us,
                v_u.unsafe_ptr(),
                v_us,
                r_u,
                w0_d.unsafe_ptr(),
                w0_ds,
                s_d.unsafe_ptr(),
                u_d.unsafe_ptr(),
                u_ds,
                v_d.unsafe_ptr(),
                v_ds,
                r_d,
                y.unsafe_ptr(),
                ys,
            )
        else:
            raise Error(OP, ": unsupported target ", target)
