# attnquant kernels: the NVFP4 projection with int8 activations (W4A8), on the tiled layout:
# a decode step, a batch of streams and a prefill.
#
# The float tile (_nvfp4_lanes.mojo) spends about 3 vector instructions per 16 weights: a
# shift, a `vpermps` lookup and an FMA. On this project's 2-core AVX-512 machine one thread
# decodes 7.8 GB/s of NVFP4 that way, so two threads are compute-bound below the memory's
# 25 GB/s. Here the activations are rounded to int8 first, as llama.cpp's Q8 activations are,
# and the codes become bytes:
#
# * x, per row and group of 64 inputs (4 blocks of 16): `xs = amax / 127`,
#   `q = roundeven(x * (127 / amax))` (int8, |q| <= 127), stored so that each 32-bit word holds
#   the 4 even or the 4 odd inputs of 8 (the order of the low and high nibbles of a tiled
#   word); a group whose amax is at most 2^-40 of the row's rounds to zeros;
# * a tiled word vector (16 rows x 8 codes, 64 bytes): low and high nibbles split with one
#   shift and two masks, each looked up as `2 * E2M1 + 12` (0..24, unsigned) with one
#   `vpshufb`; then one `vpdpbusd` each against the 4 int8 inputs broadcast: 64 products;
# * per block: `dot - 12 * sum(q)` (the offset: the sums start from it), converted to float and
#   added times the block's E4M3 scales (one FMA), the row's sums kept in units of its group's
#   `xs / 2` (the codes are twice E2M1); per group, one multiply takes them to the next group's
#   step, and one at the end to the last.
#
# Decoding the weights takes about 7 instructions per 128, shared by up to 8 rows; each row
# then takes 6 per block of 256 products (4 `vpdpbusd`, the conversion, the FMA), all on the
# vector multiply pipes, which bound the tile when many rows share the decoded weights
# (docs/decode-speed.md, 2026-12-06). The integer dot products are exact, so the op
# computes `s * scale_2 * <W', x_q> + <U, t>` where `x_q` is x rounded as above: its error
# against float activations is that rounding, half an int8 step of each group's largest input.
# `t = x @ V` keeps the float inputs.
#
# Off AVX-512 VNNI (and BW) the same integers are computed lane by lane: the op gives the same
# results on every CPU, slowly.

from std.collections import Array
from std.math import ceildiv, fma
from std.memory import bitcast
from std.sys import CompilationTarget, PrefetchOptions, llvm_intrinsic, prefetch

from max.algorithm import parallelize

from ._common import F32, Ptr
from ._nvfp4 import QBLOCK, U8, _nvfp4_store, e4m3
from ._nvfp4_lanes import LANES, LANES_GROUPS, TILED_AHEAD, TILED_FAR, U32

comptime I8 = DType.int8
comptime I32 = DType.int32
# Bytes of a tiled word vector: 16 rows x 4 bytes.
comptime WORD_BYTES = 64
# The code offset that makes every looked-up weight unsigned: 2 * E2M1 + OFFSET in 0..24.
comptime OFFSET = 12
# 2 * E2M1 + 12 for the 16 codes (code 8 is -0), four times: `vpshufb` looks up per 16 bytes.
comptime E2M1_U8 = SIMD[U8, 16](12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0)

# Rows of x one work item takes (a prefill or a batch of streams): their int8 rows, 64 x K
# bytes (256 KiB at K = 4096), stay in L2 while each tile's weights are read again from L1 for
# every 8 rows.
comptime A8_ROWS = 64
# Rows of x one thread rounds at a time, when there are more than that.
comptime QUANT_ROWS = 16
# Blocks of 16 inputs that share one int8 step: 64 inputs (even: the tiles' two sums per row
# take alternate blocks). A step per block would cost each row a multiply per block.
comptime A8_GROUP = 4
# A group whose largest input is at most this share of its row's largest rounds to zeros (2^-40,
# far below the other groups' rounding), so the ratio of two kept steps stays within 2^40.
comptime A8_FLUSH = Float32(9.094947017729282e-13)

# `vpdpbusd` and `vpshufb` on 512 bits.
# (Every CPU with AVX-512 VNNI has AVX-512 BW.)
comptime A8_VNNI = CompilationTarget.has_avx512f() and CompilationTarget.has_vnni()


@always_inline
def _lookup(codes: SIMD[U8, 64]) -> SIMD[U8, 64]:
    """`2 * E2M1 + 12` of the low 4 bits of each byte (the high 4 bits must be 0)."""
    comptime table = E2M1_U8.join(E2M1_U8).join(E2M1_U8.join(E2M1_U8))
    comptime if A8_VNNI:
        return llvm_intrinsic["llvm.x86.avx512.pshuf.b.512", SIMD[U8, 64]](table, codes)
    else:
        var out = SIMD[U8, 64](0)
        comptime for q in range(64):
            out[q] = E2M1_U8[Int(codes[q])]
        return out


@always_inline
def _dot4(acc: SIMD[I32, LANES], w: SIMD[U8, 64], x4: Int32) -> SIMD[I32, LANES]:
    """`acc[i] += sum_j w[4 i + j] * x[j]`, `x` the 4 int8 of `x4` (byte j: x[j])."""
    comptime if A8_VNNI:
        return llvm_intrinsic["llvm.x86.avx512.vpdpbusd.512", SIMD[I32, LANES]](
            acc, bitcast[I8, 64](w), bitcast[I8, 64](SIMD[I32, LANES](x4))
        )
    else:
        var words = bitcast[U32, LANES](w)
        var out = acc
        comptime for j in range(4):
            var xj = (x4 << Int32(24 - 8 * j)) >> Int32(24)  # byte j, sign-extended
            out += ((words >> UInt32(8 * j)) & 0xFF).cast[I32]() * xj
        return out


def quantize_rows_a8[
    xdt: DType
](
    x: Ptr[xdt],
    xs: Int,
    M: Int,
    K: Int,
    q: Ptr[I8],
    scale: Ptr[F32],
    offset: Ptr[I32],
):
    """Rows of x in int8 per group of A8_GROUP blocks of 16 inputs, in the order the tiles read.

    `q[m * K + 16 b + 8 h + 4 p + i]` = the rounded input `16 b + 8 h + 2 i + p` (group h of the
    block, p = 0 the even inputs, 1 the odd); `offset[m * K/16 + b]` = -12 * the sum of block
    b's q, the value its integer sums start from (so no subtraction follows them). A group's
    step over 2 is `amax / 254` (the codes are twice E2M1); a group whose amax is at most
    A8_FLUSH times the row's is rounded to zeros. Per row, ng + 1 floats (ng = ceil(K/16 /
    A8_GROUP), the last group may be short): `scale[m * (ng + 1) + g]` = the step of the
    nearest kept group before g over g's own (1 where g is flushed or none is kept before it),
    `scale[m * (ng + 1) + ng]` = the last kept group's step (0 if none): the tiles carry their
    sums in units of the current step, so each group costs one multiply a row, not a block.
    """
    var nb = K // QBLOCK
    var ng = ceildiv(nb, A8_GROUP)
    for m in range(M):
        var row_scale = scale.unsafe_offset(m * (ng + 1))
        # First pass: each group's amax, parked in its scale slot, and the row's.
        var top = Float32(0)
        for g in range(ng):
            var amax = Float32(0)
            for b in range(g * A8_GROUP, min((g + 1) * A8_GROUP, nb)):
                var v = x.unsafe_load[width=QBLOCK](m * xs + b * QBLOCK)
                amax = max(amax, abs(v.cast[F32]()).reduce_max())
            row_scale.unsafe_store(g, amax)
            top = max(top, amax)
        var floor = top * A8_FLUSH
        var last = Float32(0)
        for g in range(ng):
            var b0 = g * A8_GROUP
            var b1 = min(b0 + A8_GROUP, nb)
            var amax = row_scale.unsafe_load(g)
            var kept = amax > floor
            var inv = Float32(127) / amax if kept else Float32(0)
            for b in range(b0, b1):
                var v = x.unsafe_load[width=QBLOCK](m * xs + b * QBLOCK).cast[F32]()
                var r = llvm_intrinsic["llvm.roundeven", SIMD[F32, QBLOCK]](v * inv).cast[I32]()
                var total = Int32(0)
                comptime for h in range(2):
                    comptime for p in range(2):
                        comptime for i in range(4):
                            var value = r[8 * h + 2 * i + p]
                            total += value
                            q.unsafe_store(
                                m * K + b * QBLOCK + 8 * h + 4 * p + i, value.cast[I8]()
                            )
                offset.unsafe_store(m * nb + b, -total * OFFSET)
            var ratio = Float32(1)
            if kept:
                var step = amax / Float32(254)
                if last > 0:
                    ratio = last / step
                last = step
            row_scale.unsafe_store(g, ratio)
        row_scale.unsafe_store(ng, last)


@always_inline
def _a8_tile[
    sdt: DType, odt: DType, mr: Int
](
    q: Ptr[I8],
    xscale: Ptr[F32],
    xoffset: Ptr[I32],
    w: Ptr[U8],
    ws: Int,
    scale: Ptr[U8],
    ss: Int,
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
    """Outputs [m, m + mr) x [n, n + 16) of one tile of the tiled layout, int8 activations.

    Up to 4 rows, two integer and two float sums per row (halves, even and odd blocks), so the
    chains overlap; from 8 rows on, one of each: the rows' chains overlap each other."""
    comptime P = 2 if mr <= 4 else 1
    var nb = K // QBLOCK
    var ng = ceildiv(nb, A8_GROUP)
    var wn = w.unsafe_offset(n * ws)
    var sn = scale.unsafe_offset(n * ss)
    var acc = Array[SIMD[F32, LANES], P * mr](fill=0)
    for g in range(ng):
        # The sums so far, in units of this group's step (the ratio of the last step to it).
        comptime for j in range(mr):
            var ratio = SIMD[F32, LANES](xscale.unsafe_load((m + j) * (ng + 1) + g))
            comptime for p in range(P):
                acc[P * j + p] *= ratio
        comptime for bi in range(A8_GROUP):
            var b = g * A8_GROUP + bi
            if b < nb:
                var base = wn.unsafe_offset(b * 2 * WORD_BYTES)
                # Each row's first sum starts at its block's -12 * sum(q): the offset costs no
                # instruction of its own.
                var dots = Array[SIMD[I32, LANES], P * mr](fill=0)
                comptime for j in range(mr):
                    dots[P * j] = SIMD[I32, LANES](xoffset.unsafe_load((m + j) * nb + b))
                comptime for h in range(2):
                    var words = base.unsafe_load[width=64](h * WORD_BYTES)
                    prefetch[PrefetchOptions().for_read().high_locality()](
                        base.unsafe_offset(TILED_AHEAD + h * WORD_BYTES)
                    )
                    prefetch[PrefetchOptions().for_read().medium_locality()](
                        base.unsafe_offset(TILED_FAR + h * WORD_BYTES)
                    )
                    var lo = _lookup(words & 0x0F)
                    var hi = _lookup(
                        bitcast[U8, 64](bitcast[DType.uint16, 32](words) >> 4) & 0x0F
                    )
                    comptime for j in range(mr):
                        comptime d = P * j + (h if P == 2 else 0)
                        var qx = q.unsafe_offset(
                            (m + j) * K + b * QBLOCK + 8 * h
                        ).unsafe_bitcast[Int32]()
                        dots[d] = _dot4(dots[d], lo, qx.unsafe_load(0))
                        dots[d] = _dot4(dots[d], hi, qx.unsafe_load(1))
                var sc = e4m3[LANES](sn.unsafe_load[width=LANES](b * LANES).cast[U32]())
                comptime for j in range(mr):
                    var dot = dots[P * j]
                    comptime if P == 2:
                        dot += dots[P * j + 1]
                    comptime a = P * j + bi % P  # A8_GROUP is even: b % P == bi % P
                    acc[a] = fma(dot.cast[F32](), sc, acc[a])
    comptime for j in range(mr):
        var step = SIMD[F32, LANES](xscale.unsafe_load((m + j) * (ng + 1) + ng))
        comptime for p in range(P):
            acc[P * j + p] *= step
    var totals = Array[SIMD[F32, LANES], mr](fill=0)
    comptime for j in range(mr):
        totals[j] = acc[P * j]
        comptime if P == 2:
            totals[j] += acc[P * j + 1]
    if r == 0:
        # No correction: the scales and the store 16 lanes at a time.
        var rs = SIMD[F32, LANES](s.unsafe_load(n * s_step).cast[F32]())
        if s_step == 1:
            rs = s.unsafe_load[width=LANES](n).cast[F32]()
        rs *= scale_2
        comptime for j in range(mr):
            dst.unsafe_store[width=LANES]((m + j) * os + n, (totals[j] * rs).cast[odt]())
        return
    var d = Array[Float32, mr * LANES](fill=0)
    comptime for j in range(mr):
        comptime for i in range(LANES):
            d[j * LANES + i] = totals[j][i]
    _nvfp4_store[sdt, odt, mr, LANES](d, scale_2, s, s_step, u, us, t, r, r, dst, os, m, n)


def nvfp4_a8_rows[
    sdt: DType, odt: DType
](
    q: Ptr[I8],
    xscale: Ptr[F32],
    xoffset: Ptr[I32],
    w: Ptr[U8],
    ws: Int,
    scale: Ptr[U8],
    ss: Int,
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
    """Outputs [m0, m1) x [n0, n1) on the calling thread (whole tiles of the tiled layout),
    from the rows quantized by `quantize_rows_a8`; up to 8 rows share each decoded word."""
    var n = n0
    while n < n1:
        var m = m0
        while m + 8 <= m1:
            _a8_tile[sdt, odt, 8](
                q, xscale, xoffset, w, ws, scale, ss, scale_2, s, s_step, u, us, t, r, dst,
                os, K, m, n,
            )
            m += 8
        if m + 4 <= m1:
            _a8_tile[sdt, odt, 4](
                q, xscale, xoffset, w, ws, scale, ss, scale_2, s, s_step, u, us, t, r, dst,
                os, K, m, n,
            )
            m += 4
        if m + 2 <= m1:
            _a8_tile[sdt, odt, 2](
                q, xscale, xoffset, w, ws, scale, ss, scale_2, s, s_step, u, us, t, r, dst,
                os, K, m, n,
            )
            m += 2
        if m < m1:
            _a8_tile[sdt, odt, 1](
                q, xscale, xoffset, w, ws, scale, ss, scale_2, s, s_step, u, us, t, r, dst,
                os, K, m, n,
            )
        n += LANES


def nvfp4_a8_linear[
    xdt: DType, sdt: DType, odt: DType
](
    x: Ptr[xdt],
    xs: Int,
    M: Int,
    K: Int,
    w: Ptr[U8],
    ws: Int,
    scale: Ptr[U8],
    ss: Int,
    scale_2: Float32,
    s: Ptr[sdt],
    s_step: Int,
    u: Ptr[sdt],
    us: Int,
    t: Ptr[F32],
    r: Int,
    dst: Ptr[odt],
    os: Int,
    n0: Int,
    n1: Int,
):
    """Outputs [0, M) x [n0, n1) (whole tiles) with x rounded to int8, any number of rows:
    the rows rounded once (in parallel past QUANT_ROWS rows), then work items of up to A8_ROWS
    rows x LANES_GROUPS tiles in parallel. A decode step is one row chunk."""
    var nb = K // QBLOCK
    var q_buf = List[Int8](unsafe_uninit_length=M * K)
    var ng = ceildiv(nb, A8_GROUP)
    var xscale_buf = List[Float32](unsafe_uninit_length=M * (ng + 1))
    var xoffset_buf = List[Int32](unsafe_uninit_length=M * nb)
    var q = q_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var xscale = xscale_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var xoffset = xoffset_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    if M <= QUANT_ROWS:
        quantize_rows_a8[xdt](x, xs, M, K, q, xscale, xoffset)
    else:

        def quantize_item(i: Int) {var}:
            var m0 = i * QUANT_ROWS
            quantize_rows_a8[xdt](
                x.unsafe_offset(m0 * xs),
                xs,
                min(QUANT_ROWS, M - m0),
                K,
                q.unsafe_offset(m0 * K),
                xscale.unsafe_offset(m0 * (ng + 1)),
                xoffset.unsafe_offset(m0 * nb),
            )

        parallelize(quantize_item, ceildiv(M, QUANT_ROWS))

    var groups = (n1 - n0) // LANES
    var m_chunks = ceildiv(M, A8_ROWS)

    def item(i: Int) {var}:
        var g = i // m_chunks
        var m0 = (i % m_chunks) * A8_ROWS
        nvfp4_a8_rows[sdt, odt](
            q,
            xscale,
            xoffset,
            w,
            ws,
            scale,
            ss,
            scale_2,
            s,
            s_step,
            u,
            us,
            t,
            r,
            dst,
            os,
            K,
            m0,
            min(M, m0 + A8_ROWS),
            n0 + g * LANES_GROUPS * LANES,
            n0 + min(groups, (g + 1) * LANES_GROUPS) * LANES,
        )

    parallelize(item, ceildiv(groups, LANES_GROUPS) * m_chunks)
    _ = q_buf^
    _ = xscale_buf^
    _ = xoffset_buf^
