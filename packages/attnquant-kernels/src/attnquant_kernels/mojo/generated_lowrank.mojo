# generated_lowrank: one projection in a form without W0, y = (x @ V) @ U^T, in one dispatch
# without forming the [out, in] weight; float32 accumulation. It serves every such form of
# the identity: low rank (U_l, V_l), a basis shared on the input side (V = B_b) or on the
# output side (U = B_b), either factor a band's weight held once.
#
#   y  [M, N]   output, dtype of x
#   x  [M, K]   float32 or bfloat16 (any float dtype)
#   U  [N, r]   r >= 1, any size (no MAX_RANK limit: the rank is the whole weight here)
#   V  [K, r]

import extensibility as compiler
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu, is_gpu

from ._common import check_dim, row_stride
from ._cpu import lowrank_linear_cpu
from ._gpu import lowrank_linear_gpu

comptime OP = "generated_lowrank"


@compiler.register("generated_lowrank")
struct GeneratedLowrank:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        y: OutputTensor[rank=2, ...],
        x: InputTensor[dtype=y.dtype, rank=2, ...],
        u: InputTensor[dtype=y.dtype, rank=2, ...],
        v: InputTensor[dtype=y.dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert (
            y.dtype.is_floating_point()
        ), "generated_lowrank: float tensors only"
        var M = x.dim_size(0)
        var K = x.dim_size(1)
        var N = u.dim_size(0)
        var r = u.dim_size(1)
        check_dim(OP, "V", 0, v.dim_size(0), K)
        check_dim(OP, "V", 1, v.dim_size(1), r)
        check_dim(OP, "y", 0, y.dim_size(0), M)
        check_dim(OP, "y", 1, y.dim_size(1), N)
        var xs = row_stride(OP, "x", x)
        var us = row_stride(OP, "U", u)
        var vs = row_stride(OP, "V", v)
        if M > 0 and N > 1 and y.stride_length(1) != 1:
            raise Error(OP, ": y rows are not contiguous")
        var ys = y.stride_length(0)

        comptime if is_cpu[target]():
            lowrank_linear_cpu[x.dtype, u.dtype, y.dtype](
                x.unsafe_ptr(),
                xs,
                M,
                K,
                u.unsafe_ptr(),
                us,
                v.unsafe_ptr(),
                vs,
                r,
                N,
                y.unsafe_ptr(),
                ys,
            )
        elif is_gpu[target]():
            lowrank_linear_gpu[x.dtype, u.dtype, y.dtype](
                ctx,
                x.unsafe_ptr(),
                xs,
                M,
                K,
                u.unsafe_ptr(),
                us,
                v.unsafe_ptr(),
                vs,
                r,
                N,
                y.unsafe_ptr(),
                ys,
            )
        else:
            raise Error(OP, ": unsupported target ", target)
