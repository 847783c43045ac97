# generated_linear_nvfp4: y = s * (x @ W^T) + (x @ V) @ U^T with W held as NVFP4 (Model
# Optimizer's layout) and decoded inside the dot product, never written out as floats;
# float32 accumulation.
#
#   y        [M, N]      output, dtype of x
#   x        [M, K]      float32 or bfloat16 (any float dtype); K a multiple of 16
#   w        [N, K/2]    uint8, two E2M1 codes per byte (even input in the low nibble)
#   scale    [N, K/16]   uint8, the float8_e4m3fn bytes of the block scales
#   scale_2  [1]         float32, the per-tensor scale
#   s        [N]         per-output-row scale (ones for a plain NVFP4 projection)
#   U        [N, r]      correction, 0 <= r <= 64 (r = 0: zero-size U and V)
#   V        [K, r]
#
# W[n, k] = E2M1[code] * E4M3(scale[n, k // 16]) * scale_2.
#
# generated_linear_nvfp4_tiled: the same on the CPU with `w` and `scale` in the tiled layout of
# `attnquant_kernels.layout.tile_nvfp4` (same shapes and bytes, each tile of 16 rows
# transposed, _nvfp4_lanes.mojo), which a decode step reads as one stream per tile.

import extensibility as compiler
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu, is_gpu

from ._common import check_dim, check_rank, row_stride
from ._nvfp4 import QBLOCK, nvfp4_linear_gpu
from ._nvfp4_cpu import nvfp4_linear_cpu

comptime OP = "generated_linear_nvfp4"
comptime OP_TILED = "generated_linear_nvfp4_tiled"


@compiler.register("generated_linear_nvfp4")
struct GeneratedLinearNVFP4:
    @staticmethod
    def execute[
        target: StaticString,
    ](
        y: OutputTensor[rank=2, ...],
        x: InputTensor[dtype=y.dtype, rank=2, ...],
        w: InputTensor[dtype=DType.uint8, rank=2, ...],
        scale: InputTensor[dtype=DType.uint8, rank=2, ...],
        scale_2: InputTensor[dtype=DType.float32, rank=1, ...],
        s: InputTensor[dtype=y.dtype, rank=1, ...],
        u: InputTensor[dtype=y.dtype, rank=2, ...],
        v: InputTensor[dtype=y.dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        execute_nvfp4[target, False](y, x, w, scale, scale_2, s, u, v, ctx)


def execute_nvfp4[
    target: StaticString, tiled: Bool, a8: Bool = False
](
    y: OutputTensor[rank=2, ...],
    x: InputTensor[dtype=y.dtype, rank=2, ...],
    w: InputTensor[dtype=DType.uint8, rank=2, ...],
    scale: InputTensor[dtype=DType.uint8, rank=2, ...],
    scale_2: InputTensor[dtype=DType.float32, rank=1, ...],
    s: InputTensor[dtype=y.dtype, rank=1, ...],
    u: InputTensor[dtype=y.dtype, rank=2, ...],
    v: InputTensor[dtype=y.dtype, rank=2, ...],
    ctx: DeviceContext,
) raises:
    comptime assert (
        y.dtype.is_floating_point()
    ), "generated_linear_nvfp4: float activations only"
    var M = x.dim_size(0)
    var K = x.dim_size(1)
    var N = w.dim_size(0)
    var r = u.dim_size(1)
    if K % QBLOCK != 0:
        raise Error(
            OP,
            ": x has ",
            K,
            " inputs, not a multiple of ",
            QBLOCK,
            " (one E4M3 scale per 16 inputs)",
        )
    check_rank(OP, "correction", r)
    check_dim(OP, "weight", 1, w.dim_size(1), K // 2)
    check_dim(OP, "weight_scale", 0, scale.dim_size(0), N)
    check_dim(OP, "weight_scale", 1, scale.dim_size(1), K // QBLOCK)
    check_dim(OP, "weight_scale_2", 0, scale_2.dim_size(0), 1)
    check_dim(OP, "s", 0, s.dim_size(0), N)
    check_dim(OP, "U", 0, u.dim_size(0), N)
    check_dim(OP, "V", 0, v.dim_size(0), K)
    check_dim(OP, "V", 1, v.dim_size(1), r)
    check_dim(OP, "y", 0, y.dim_size(0), M)
    check_dim(OP, "y", 1, y.dim_size(1), N)
    var xs = row_stride(OP, "x", x)
    var ws = row_stride(OP, "weight", w)
    var ss = row_stride(OP, "weight_scale", scale)
    var us = row_stride(OP, "U", u)
    var vs = row_stride(OP, "V", v)
    # s may be a broadcast (stride 0): the wrapper's ones for a plain NVFP4 projection.
    var s_step = s.stride_length(0) if N > 1 else 1
    if M > 0 and N > 1 and y.stride_length(1) != 1:
        raise Error(OP, ": y rows are not contiguous")
    var ys = y.stride_length(0)

    comptime if is_cpu[target]():
        nvfp4_linear_cpu[x.dtype, s.dtype, y.dtype, tiled, a8](
            x.unsafe_ptr(),
            xs,
            M,
            K,
            w.unsafe_ptr(),
            ws,
            scale.unsafe_ptr(),
            ss,
            scale_2.unsafe_ptr().unsafe_load(0),
            s.unsafe_ptr(),
            s_step,
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
        comptime if tiled:
            raise Error(OP_TILED, ": the tiled layout is the CPU's; on a GPU run ", OP)
        nvfp4_linear_gpu[x.dtype, s.dtype, y.dtype](
            ctx,
            x.unsafe_ptr(),
            xs,
            M,
            K,
            w.unsafe_ptr(),
            ws,
            scale.unsafe_ptr(),
            ss,
            scale_2.unsafe_ptr(),
            s.unsafe_ptr(),
            s_step,
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
