# attnquant kernels: NVFP4 weights (Model Optimizer's layout) decoded inside the dot product.
#
#   W[n, k] = E2M1[code(n, k)] * E4M3(scale[n, k // 16]) * scale_2
#
# `w` holds two 4-bit E2M1 codes per byte (even k in the low nibble; code = sign bit 3,
# magnitude index 0..7 into {0, 0.5, 1, 1.5, 2, 3, 4, 6}), `scale` the float8_e4m3fn bytes of
# one scale per 16 inputs, `scale_2` one float32. The float weight is never written anywhere:
# per 16 inputs of a weight row the CPU loads 8 packed bytes, splits the nibbles, looks the 16
# codes up in a 16-entry byte table with one SIMD shuffle (pshufb / tbl), widens them to
# float32 and multiplies by the block's scale (one table load per 16 weights); the dot product
# with x accumulates in float32. So a decode step reads 4.5 bits per weight.
#
# Then, as generated_linear: y[m, n] = s[n] * scale_2 * <W'[n, :], x[m, :]> + <U[n, :], t[m, :]>,
# t = x @ V, where W' is the weight without scale_2. These are the decode tiles; the CPU entry
# (`nvfp4_linear_cpu`, _nvfp4_cpu.mojo) runs a GEMM over decoded panels from 16 rows on.

from std.collections import Array
from std.math import ceildiv, fma
from std.memory import bitcast
from std.sys import simd_width_of

from max.gpu import global_idx
from max.gpu.host import DeviceContext

from ._common import F32, Ptr
from ._cpu import (
    MR,
    NR,
    NR1,
    _dot_rank,
    _dot_tile,
)
from ._gpu import BLOCK, _project_gpu

comptime U8 = DType.uint8
# Inputs per E4M3 block scale.
comptime QBLOCK = 16
# Input rows of a work item from which the weights are decoded into a scratch tile shared by
# all of them, rather than in registers per tile of rows.
comptime SCRATCH_ROWS = MR
# float32 lanes the block's 16 values are accumulated in (8 on AVX2, 16 on AVX-512).
comptime AW = min(simd_width_of[F32](), QBLOCK)

# Twice each E2M1 value, as the bytes of int8 (code 8 is -0 -> 0): 0, 1, 2, 3, 4, 6, 8, 12,
# then their negatives. Twice, so every entry is a whole number; the half goes into the scale.
comptime E2M1_X2 = SIMD[U8, 16](
    0, 1, 2, 3, 4, 6, 8, 12, 0, 255, 254, 253, 252, 250, 248, 244
)


@always_inline
def e4m3[width: Int](byte: SIMD[DType.uint32, width]) -> SIMD[F32, width]:
    """The float8_e4m3fn value of the low byte of each lane (0x7F, 0xFF: NaN), exactly."""
    var b = byte & 0xFF
    var mag = b & 0x7F
    # Normal: exponent e - 7 and 3 mantissa bits moved under float32's (bias 127 = 7 + 120).
    var normal = bitcast[F32, width]((mag << 20) + UInt32(120 << 23))
    # Subnormal (e = 0): m * 2^-9.
    var sub = mag.cast[F32]() * Float32(0.001953125)
    var value = mag.lt(8).select(sub, normal)
    value = mag.eq(0x7F).select(SIMD[F32, width](Float32.MAX * 2 - Float32.MAX * 2), value)
    return bitcast[F32, width](bitcast[DType.uint32, width](value) | ((b & 0x80) << 24))


@always_inline
def e4m3_half(byte: UInt8) -> Float32:
    """Half the float8_e4m3fn value of `byte` in float32 (0x7F and 0xFF: NaN)."""
    return e4m3[1](UInt32(byte)) * 0.5


def e4m3_half_table() -> List[Float32]:
    """`e4m3_half` of every byte, built once per call of the op that reads it (1 KiB, stays
    in L1): the row-major layout and the rows past the last whole tile of the tiled one."""
    var table = List[Float32](length=256, fill=0)
    for i in range(256):
        table[i] = e4m3_half(UInt8(i))
    return table^


@always_inline
def e2m1_x2_block(w: Ptr[U8], b: Int) -> SIMD[F32, QBLOCK]:
    """Twice the 16 E2M1 values of block `b` of one row (whole numbers, exact in float32)."""
    var packed = w.unsafe_load[width=8](b * 8)
    var codes = (packed & 0x0F).interleave(packed >> 4)  # element order
    var q = bitcast[DType.int8, 16](E2M1_X2._dynamic_shuffle(codes))
    return q.cast[F32]()


@always_inline
def _decode_block(
    w: Ptr[U8], scale: Ptr[U8], table: Ptr[F32], b: Int
) -> SIMD[F32, QBLOCK]:
    """The 16 weights of block `b` of one row, without scale_2, in float32."""
    return e2m1_x2_block(w, b) * table.unsafe_load(Int(scale.unsafe_load(b)))


@always_inline
def _nvfp4_dot_tile[
    xdt: DType, mr: Int, nr: Int
](
    x: Ptr[xdt],
    xs: Int,
    w: Ptr[U8],
    ws: Int,
    scale: Ptr[U8],
    ss: Int,
    table: Ptr[F32],
    K: Int,
) -> Array[Float32, mr * nr]:
    """`res[j * nr + i] = <x[j, :K], W'[i, :K]>`, each weight block decoded once per tile.
    """
    var acc = Array[SIMD[F32, AW], mr * nr](fill=0)
    for b in range(K // QBLOCK):
        var wv = Array[SIMD[F32, QBLOCK], nr](fill=0)
        comptime for i in range(nr):
            wv[i] = _decode_block(
                w.unsafe_offset(i * ws),
                scale.unsafe_offset(i * ss),
                table,
                b,
            )
        comptime for j in range(mr):
            var xv = x.unsafe_load[width=QBLOCK](j * xs + b * QBLOCK).cast[F32]()
            comptime for i in range(nr):
                comptime for c in range(QBLOCK // AW):
                    acc[j * nr + i] = fma(
                        xv.slice[AW, offset=c * AW](),
                        wv[i].slice[AW, offset=c * AW](),
                        acc[j * nr + i],
                    )
    var res = Array[Float32, mr * nr](fill=0)
    comptime for q in range(mr * nr):
        res[q] = acc[q].reduce_add()
    return res^


@always_inline
def _nvfp4_store[
    sdt: DType, odt: DType, mr: Int, nr: Int
](
    d: Array[Float32, mr * nr],
    scale_2: Float32,
    s: Ptr[sdt],
    s_step: Int,
    u: Ptr[sdt],
    us: Int,
    t: Ptr[F32],
    ts: Int,
    r: Int,
    dst: Ptr[odt],
    os: Int,
    m: Int,
    n: Int,
):
    """Outputs [m, m + mr) x [n, n + nr) from their dot products `d`: scales, correction."""
    comptime for j in range(mr):
        comptime for i in range(nr):
            var value = (s.unsafe_load((n + i) * s_step).cast[F32]() * scale_2) * d[
                j * nr + i
            ]
            if r > 0:
                value += _dot_rank[sdt](
                    u.unsafe_offset((n + i) * us),
                    t.unsafe_offset((m + j) * ts),
                    r,
                )
            dst.unsafe_store((m + j) * os + n + i, value.cast[odt]())


@always_inline
def _nvfp4_tile[
    xdt: DType, sdt: DType, odt: DType, mr: Int, nr: Int
](
    x: Ptr[xdt],
    xs: Int,
    w: Ptr[U8],
    ws: Int,
    scale: Ptr[U8],
    ss: Int,
    table: Ptr[F32],
    scale_2: Float32,
    s: Ptr[sdt],
    s_step: Int,
    u: Ptr[sdt],
    us: Int,
    t: Ptr[F32],
    r: Int,
    dst: Ptr[odt],
    os: Int,
    K: Int,
    m: Int,
    n: Int,
):
    """Outputs [m, m + mr) x [n, n + nr), the weights decoded in registers."""
    var d = _nvfp4_dot_tile[xdt, mr, nr](
        x.unsafe_offset(m * xs),
        xs,
        w.unsafe_offset(n * ws),
        ws,
        scale.unsafe_offset(n * ss),
        ss,
        table,
        K,
    )
    _nvfp4_store[sdt, odt, mr, nr](
        d, scale_2, s, s_step, u, us, t, r, r, dst, os, m, n
    )


def _decode_rows(
    w: Ptr[U8],
    ws: Int,
    scale: Ptr[U8],
    ss: Int,
    table: Ptr[F32],
    rows: Int,
    K: Int,
    dst: Ptr[F32],
):
    """`dst[i, :K]` = weight row i without scale_2, for `rows` rows (row stride K)."""
    for i in range(rows):
        for b in range(K // QBLOCK):
            dst.unsafe_store[width=QBLOCK](
                i * K + b * QBLOCK,
                _decode_block(
                    w.unsafe_offset(i * ws),
                    scale.unsafe_offset(i * ss),
                    table,
                    b,
                ),
            )


def _nvfp4_block[
    xdt: DType, sdt: DType, odt: DType
](
    x: Ptr[xdt],
    xs: Int,
    w: Ptr[U8],
    ws: Int,
    scale: Ptr[U8],
    ss: Int,
    table: Ptr[F32],
    scale_2: Float32,
    s: Ptr[sdt],
    s_step: Int,
    u: Ptr[sdt],
    us: Int,
    t: Ptr[F32],
    r: Int,
    dst: Ptr[odt],
    os: Int,
    K: Int,
    m0: Int,
    m1: Int,
    n0: Int,
    n1: Int,
):
    """Outputs [m0, m1) x [n0, n1) on the calling thread.

    Few input rows (decode): 1 x NR1 register tiles, each weight block decoded in registers
    and used at once. From SCRATCH_ROWS rows on: NR weight rows at a time are decoded once
    into a small float32 scratch (NR x K, in L1/L2) that every MR x NR tile of input rows
    reads, so the decoding is shared by all the rows of the batch block.
    """
    if m1 - m0 >= SCRATCH_ROWS:
        var m_main = m0 + ((m1 - m0) // MR) * MR
        var buf = List[Float32](length=NR * K, fill=0)
        var scratch = buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
        var n = n0
        while n < n1:
            var step = NR if n + NR <= n1 else 1
            _decode_rows(
                w.unsafe_offset(n * ws),
                ws,
                scale.unsafe_offset(n * ss),
                ss,
                table,
                step,
                K,
                scratch,
            )
            var m = m0
            while m < m1:
                var x_m = x.unsafe_offset(m * xs)
                if m < m_main and step == NR:
                    var d = _dot_tile[xdt, F32, MR, NR](x_m, xs, scratch, K, K)
                    _nvfp4_store[sdt, odt, MR, NR](
                        d, scale_2, s, s_step, u, us, t, r, r, dst, os, m, n
                    )
                    m += MR
                elif m < m_main:
                    var d = _dot_tile[xdt, F32, MR, 1](x_m, xs, scratch, K, K)
                    _nvfp4_store[sdt, odt, MR, 1](
                        d, scale_2, s, s_step, u, us, t, r, r, dst, os, m, n
                    )
                    m += MR
                elif step == NR:
                    var d = _dot_tile[xdt, F32, 1, NR](x_m, xs, scratch, K, K)
                    _nvfp4_store[sdt, odt, 1, NR](
                        d, scale_2, s, s_step, u, us, t, r, r, dst, os, m, n
                    )
                    m += 1
                else:
                    var d = _dot_tile[xdt, F32, 1, 1](x_m, xs, scratch, K, K)
                    _nvfp4_store[sdt, odt, 1, 1](
                        d, scale_2, s, s_step, u, us, t, r, r, dst, os, m, n
                    )
                    m += 1
            n += step
        _ = buf^
        return
    var n = n0
    while n < n1:
        if n + NR1 <= n1:
            for m in range(m0, m1):
                _nvfp4_tile[xdt, sdt, odt, 1, NR1](
                    x, xs, w, ws, scale, ss, table, scale_2, s, s_step, u, us,
                    t, r, dst, os, K, m, n,
                )
            n += NR1
        else:
            for m in range(m0, m1):
                _nvfp4_tile[xdt, sdt, odt, 1, 1](
                    x, xs, w, ws, scale, ss, table, scale_2, s, s_step, u, us,
                    t, r, dst, os, K, m, n,
                )
            n += 1


# ---------------------------------------------------------------- GPU


@always_inline
def e2m1_x2(code: UInt32) -> Float32:
    """Twice the E2M1 value of a 4-bit code, branch-free: |.| in {0, 1, 2, 3, 4, 6, 8, 12}.
    """
    var m = code & 7
    var mag = m if m < 4 else ((m - 2) * 2 if m < 6 else (m - 4) * 4)
    var f = Float32(mag)
    return -f if (code & 8) != 0 else f


def _nvfp4_kernel[
    xdt: DType, sdt: DType, odt: DType
](
    x: Ptr[xdt],
    xs: Int64,
    w: Ptr[U8],
    ws: Int64,
    scale: Ptr[U8],
    ss: Int64,
    scale_2: Ptr[F32],
    s: Ptr[sdt],
    s_step: Int64,
    u: Ptr[sdt],
    us: Int64,
    t: Ptr[F32],
    ts: Int64,
    r: Int64,
    dst: Ptr[odt],
    os: Int64,
    M: Int64,
    N: Int64,
    K: Int64,
):
    var i = Int64(global_idx.x)
    if i >= M * N:
        return
    var m = i // N
    var n = i % N
    var acc = Float32(0)
    for b in range(Int(K) // QBLOCK):
        var part = Float32(0)
        for h in range(QBLOCK // 2):
            var k = Int64(b * QBLOCK + 2 * h)
            var byte = UInt32(w.unsafe_load(Int(n * ws + k // 2)))
            part += e2m1_x2(byte & 0xF) * x.unsafe_load(Int(m * xs + k)).cast[
                F32
            ]()
            part += e2m1_x2(byte >> 4) * x.unsafe_load(
                Int(m * xs + k + 1)
            ).cast[F32]()
        acc += part * e4m3_half(scale.unsafe_load(Int(n * ss) + b))
    var value = s.unsafe_load(Int(n * s_step)).cast[F32]() * scale_2.unsafe_load(0) * acc
    for j in range(r):
        value += u.unsafe_load(Int(n * us + j)).cast[F32]() * t.unsafe_load(
            Int(m * ts + j)
        )
    dst.unsafe_store(Int(m * os + n), value.cast[odt]())


def nvfp4_linear_gpu[
    xdt: DType, sdt: DType, odt: DType
](
    ctx: DeviceContext,
    x: Ptr[xdt],
    xs: Int,
    M: Int,
    K: Int,
    w: Ptr[U8],
    ws: Int,
    scale: Ptr[U8],
    ss: Int,
    scale_2: Ptr[F32],
    s: Ptr[sdt],
    s_step: Int,
    u: Ptr[sdt],
    us: Int,
    v: Ptr[sdt],
    vs: Int,
    r: Int,
    N: Int,
    dst: Ptr[odt],
    os: Int,
) raises:
    """The NVFP4 projection on the GPU of `ctx`: one thread per output, a plain kernel."""
    var t_buf = ctx.enqueue_create_buffer[F32](max(M * r, 1))
    var t = t_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    _project_gpu[xdt, sdt](ctx, x, xs, M, K, v, vs, r, t)
    if M * N > 0:
        ctx.enqueue_function[_nvfp4_kernel[xdt, sdt, odt]](
            x,
            Int64(xs),
            w,
            Int64(ws),
            scale,
            Int64(ss),
            scale_2,
            s,
            Int64(s_step),
            u,
            Int64(us),
            t,
            Int64(r),
            Int64(r),
            dst,
            Int64(os),
            Int64(M),
            Int64(N),
            Int64(K),
            grid_dim=ceildiv(M * N, BLOCK),
            block_dim=BLOCK,
        )
    _ = t_buf^
