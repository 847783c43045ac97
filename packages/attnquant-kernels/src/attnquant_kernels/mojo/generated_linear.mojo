# generated_linear: one theta projection y = s * (x @ W0^T) + (x @ V) @ U^T in one
# dispatch, without forming the [out, in] weight; float32 accumulation.
#
#   y  [M, N]   output, dtype of x
#   x  [M, K]   float32 or bfloat16 (any float dtype)
#   W0 [N, K]   the shared block of the projection's band
#   s  [N]      per-output-row scale
#   U  [N, r]   correction, 0 <= r <= 64 (r = 0: zero-size U and V)
#   V  [K, r]
#
# Ranks above 64 are refused (use the GEMM formulation, ATTNQUANT_GEMM=1).

import extensibility as compiler
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu, is_gpu

from ._common import check_dim, check_rank, row_stride, vector_stride
from ._cpu import theta_linear_cpu
from ._gpu import theta_linear_gpu

comptime OP = "generated_linear"


@compiler.register("generated_linear")
struct GeneratedLinear:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        y: OutputTensor[rank=2, ...],
        x: InputTensor[dtype=y.dtype, rank=2, ...],
        w0: InputTensor[dtype=y.dtype, rank=2, ...],
        s: InputTensor[dtype=y.dtype, rank=1, ...],
        u: InputTensor[dtype=y.dtype, rank=2, ...],
        v: InputTensor[dtype=y.dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert (
            y.dtype.is_floating_point()
        ), "generated_linear: float tensors only"
        var M = x.dim_size(0)
        var K = x.dim_size(1)
        var N = w0.dim_size(0)
        var r = u.dim_size(1)
        check_rank(OP, "correction", r)
        check_dim(OP, "W0", 1, w0.dim_size(1), K)
        check_dim(OP, "s", 0, s.dim_size(0), N)
        check_dim(OP, "U", 0, u.dim_size(0), N)
        check_dim(OP, "V", 0, v.dim_size(0), K)
        check_dim(OP, "V", 1, v.dim_size(1), r)
        check_dim(OP, "y", 0, y.dim_size(0), M)
        check_dim(OP, "y", 1, y.dim_size(1), N)
        var xs = row_stride(OP, "x", x)
        var w0s = row_stride(OP, "W0", w0)
        var us = row_stride(OP, "U", u)
        var vs = row_stride(OP, "V", v)
        vector_stride(OP, "s", s)
        if M > 0 and N > 1 and y.stride_length(1) != 1:
            raise Error(OP, ": y rows are not contiguous")
        var ys = y.stride_length(0)

        comptime if is_cpu[target]():
            theta_linear_cpu[x.dtype, w0.dtype, y.dtype](
                x.unsafe_ptr(),
                xs,
                M,
                K,
                w0.unsafe_ptr(),
                w0s,
                s.unsafe_ptr(),
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
            theta_linear_gpu[x.dtype, w0.dtype, y.dtype](
                ctx,
                x.unsafe_ptr(),
                xs,
                M,
                K,
                w0.unsafe_ptr(),
                w0s,
                s.unsafe_ptr(),
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
