# nvfp4_dequantize: the float weight of an NVFP4 tensor (Model Optimizer's layout), written
# out once, for the batches where one stock matmul over the float weight beats decoding the
# packed codes inside every dot product (a prefill of hundreds of tokens).
#
#   W        [N, K]      output, float32 or bfloat16 (any float dtype); [K, N] with the
#                        parameter transposed=True (what `x @ W^T` multiplies by: a matmul
#                        over a computed W^T would otherwise copy it transposed first)
#   w        [N, K/2]    uint8, two E2M1 codes per byte (even input in the low nibble)
#   scale    [N, K/16]   uint8, the float8_e4m3fn bytes of the block scales
#   scale_2  [1]         float32, the per-tensor scale
#
# W[n, k] = E2M1[code] * (E4M3(scale[n, k // 16]) * scale_2) in float32, the reference's order
# and rounding (attnquant_max.dequantize_nvfp4), so the float32 output is bit for bit the
# reference's; scale bytes 0x7F and 0xFF give NaN rows.

from std.collections import Array
from std.math import ceildiv

import extensibility as compiler
from extensibility import InputTensor, OutputTensor
from max.algorithm import parallelize
from max.gpu import global_idx
from max.gpu.host import DeviceContext
from max.gpu.host.info import is_cpu, is_gpu

from ._common import F32, Ptr, check_dim, row_stride
from ._gpu import BLOCK
from ._nvfp4 import QBLOCK, U8, e2m1_x2, e2m1_x2_block, e4m3_half, e4m3_half_table
from ._panel import store_transposed

comptime OP = "nvfp4_dequantize"
# Weight rows per parallel work item on the CPU (and the side of a transposed tile).
comptime ROWS = 16
# Blocks of 16 inputs per parallel work item of the transposed output (64 bytes of codes).
comptime BLOCKS_T = 8


@always_inline
def _values(w: Ptr[U8], b: Int) -> SIMD[F32, QBLOCK]:
    """The 16 E2M1 values of block `b` of one row (exact in float32)."""
    return e2m1_x2_block(w, b) * 0.5


@always_inline
def _step(table: Ptr[F32], scale: Ptr[U8], i: Int, scale_2: Float32) -> Float32:
    """E4M3(scale byte i) * scale_2 in float32 (2 * half is exact), the reference's step."""
    return (table.unsafe_load(Int(scale.unsafe_load(i))) * 2) * scale_2


@always_inline
def _transposed_tile[
    odt: DType
](
    w: Ptr[U8],
    ws: Int,
    scale: Ptr[U8],
    ss: Int,
    table: Ptr[F32],
    scale_2: Float32,
    n0: Int,
    b: Int,
    dst: Ptr[odt],
    ds: Int,
):
    """`dst[16 b + j, n0 + i]` for the 16 x 16 tile of rows n0.. and block b: the 16 rows are
    decoded into registers, transposed there and stored 16 values an output row
    (`store_transposed`)."""
    var r = Array[SIMD[F32, QBLOCK], ROWS](fill=0)
    comptime for i in range(ROWS):
        var n = n0 + i
        r[i] = _values(w.unsafe_offset(n * ws), b) * _step(table, scale, n * ss + b, scale_2)
    store_transposed[odt](r^, dst, ds, b * QBLOCK * ds + n0)


def nvfp4_dequantize_cpu[
    odt: DType, transposed: Bool
](
    w: Ptr[U8],
    ws: Int,
    scale: Ptr[U8],
    ss: Int,
    scale_2: Float32,
    N: Int,
    K: Int,
    dst: Ptr[odt],
    ds: Int,
):
    """`dst[n, :K]` = weight row n (`transposed`: `dst[:K, n]`), every row, across the cores:
    work items of ROWS weight rows, or (transposed) of BLOCKS_T blocks of inputs, each 16 x 16
    tile transposed in registers so that every output row gets 16 contiguous values at once.
    """
    if N == 0 or K == 0:
        return
    var table_buf = e4m3_half_table()
    var table = table_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()

    comptime if not transposed:

        def rows(i: Int) {var}:
            for n in range(i * ROWS, min(N, (i + 1) * ROWS)):
                var row = w.unsafe_offset(n * ws)
                for b in range(K // QBLOCK):
                    var step = _step(table, scale, n * ss + b, scale_2)
                    dst.unsafe_store[width=QBLOCK](
                        n * ds + b * QBLOCK, (_values(row, b) * step).cast[odt]()
                    )

        parallelize(rows, ceildiv(N, ROWS))
    else:
        # Work items of BLOCKS_T blocks of inputs (a cache line of each weight row), all the
        # rows: each item writes whole output rows, a 16 x 16 tile at a time.
        var blocks = K // QBLOCK

        def columns(i: Int) {var}:
            var b1 = min(blocks, (i + 1) * BLOCKS_T)
            var n0 = 0
            while n0 < N:
                var n1 = min(N, n0 + ROWS)
                for b in range(i * BLOCKS_T, b1):
                    if n1 - n0 == ROWS:
                        _transposed_tile[odt](w, ws, scale, ss, table, scale_2, n0, b, dst, ds)
                        continue
                    for n in range(n0, n1):  # the last, partial tile: one value at a time
                        var step = _step(table, scale, n * ss + b, scale_2)
                        var v = _values(w.unsafe_offset(n * ws), b) * step
                        comptime for j in range(QBLOCK):
                            dst.unsafe_store((b * QBLOCK + j) * ds + n, v[j].cast[odt]())
                n0 = n1

        parallelize(columns, ceildiv(blocks, BLOCKS_T))
    _ = table_buf^


def _dequantize_kernel[
    odt: DType, transposed: Bool
](
    w: Ptr[U8],
    ws: Int64,
    scale: Ptr[U8],
    ss: Int64,
    scale_2: Ptr[F32],
    N: Int64,
    K: Int64,
    dst: Ptr[odt],
    ds: Int64,
):
    # One thread per output element (consecutive threads write consecutive outputs); sizes as
    # Int64 (Int is not DevicePassable).
    var i = Int64(global_idx.x)
    if i >= N * K:
        return
    var n = (i % N) if transposed else (i // K)
    var k = (i // N) if transposed else (i % K)
    var byte = UInt32(w.unsafe_load(Int(n * ws + k // 2)))
    var code = (byte >> 4) if (k & 1) != 0 else (byte & 0xF)
    var step = (e4m3_half(scale.unsafe_load(Int(n * ss + k // 16))) * 2) * scale_2.unsafe_load(0)
    var at = (k * ds + n) if transposed else (n * ds + k)
    dst.unsafe_store(Int(at), ((e2m1_x2(code) * 0.5) * step).cast[odt]())


@compiler.register("nvfp4_dequantize")
struct NVFP4Dequantize:
    @staticmethod
    def execute[
        target: StaticString,
        transposed: Bool,
    ](
        W: OutputTensor[rank=2, ...],
        w: InputTensor[dtype=DType.uint8, rank=2, ...],
        scale: InputTensor[dtype=DType.uint8, rank=2, ...],
        scale_2: InputTensor[dtype=DType.float32, rank=1, ...],
        ctx: DeviceContext,
    ) raises:
        comptime assert (
            W.dtype.is_floating_point()
        ), "nvfp4_dequantize: a float output only"
        var N = w.dim_size(0)
        var K = 2 * w.dim_size(1)
        if K % QBLOCK != 0:
            raise Error(
                OP,
                ": weight has ",
                K,
                " inputs, not a multiple of ",
                QBLOCK,
                " (one E4M3 scale per 16 inputs)",
            )
        check_dim(OP, "weight_scale", 0, scale.dim_size(0), N)
        check_dim(OP, "weight_scale", 1, scale.dim_size(1), K // QBLOCK)
        check_dim(OP, "weight_scale_2", 0, scale_2.dim_size(0), 1)
        check_dim(OP, "W", 0, W.dim_size(0), K if transposed else N)
        check_dim(OP, "W", 1, W.dim_size(1), N if transposed else K)
        var ws = row_stride(OP, "weight", w)
        var ss = row_stride(OP, "weight_scale", scale)
        if W.dim_size(0) > 0 and W.dim_size(1) > 1 and W.stride_length(1) != 1:
            raise Error(OP, ": W rows are not contiguous")
        var ds = W.stride_length(0)

        comptime if is_cpu[target]():
            nvfp4_dequantize_cpu[W.dtype, transposed](
                w.unsafe_ptr(),
                ws,
                scale.unsafe_ptr(),
                ss,
                scale_2.unsafe_ptr().unsafe_load(0),
                N,
                K,
                W.unsafe_ptr(),
                ds,
            )
        elif is_gpu[target]():
            if N * K > 0:
                ctx.enqueue_function[_dequantize_kernel[W.dtype, transposed]](
                    w.unsafe_ptr(),
                    Int64(ws),
                    scale.unsafe_ptr(),
                    Int64(ss),
                    scale_2.unsafe_ptr(),
                    Int64(N),
                    Int64(K),
                    W.unsafe_ptr(),
                    Int64(ds),
                    grid_dim=ceildiv(N * K, BLOCK),
                    block_dim=BLOCK,
                )
        else:
            raise Error(OP, ": unsupported target ", target)
