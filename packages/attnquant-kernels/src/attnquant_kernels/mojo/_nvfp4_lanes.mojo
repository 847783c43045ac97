# attnquant kernels: the NVFP4 decode step on AVX-512, sixteen weight rows in the lanes.
#
# A decode step's projection is a matrix-vector product over 4-bit codes: one FMA per weight,
# so the cost is in the decoding. `_nvfp4_block` (_nvfp4.mojo) puts the inputs of one weight
# row in the lanes: per 16 weights it splits nibbles, looks the codes up, widens and converts
# them and multiplies by the block's scale before its one FMA, about 12 instructions.
#
# Here the lanes hold sixteen weight rows instead. Each row's next 64 packed bytes (128 inputs,
# 8 blocks) are one load; a 16 x 16 transpose of 32-bit words (64 shuffles for 2048 weights)
# gives, per group of 8 inputs, a vector whose lane i holds the 8 codes of row i. Then per
# input k: a shift brings its code to the low 4 bits, one `vpermps` looks the 16 codes up in
# a register table of the E2M1 values, and one FMA with x[k] broadcast adds them to the
# block's sums; per block the sums are multiplied by the 16 rows' decoded E4M3 scales. About 3
# instructions per 16 weights, and the 16 rows' outputs take the scales and correction of
# the other decode tiles (`_nvfp4_store`).
#
# Measured (standalone driver, one input row, r = 16, the weight in DRAM, each call on a fresh
# copy, interleaved): 4096 x 1024 in 0.19-0.21 ms against _nvfp4_block's 0.33-0.36 ms;
# 1024 x 4096 in 0.20 ms against 0.30-0.31 ms.
#
# K is taken 128 inputs at a time; a last part of fewer is copied into a zero-padded tile
# first (zero codes, scales and inputs add nothing). On Model Optimizer's row-major layout only
# where the target has AVX-512 (`NVFP4_LANES`); elsewhere _nvfp4_block serves every shape.
#
# The tiled layout (`generated_linear_nvfp4_tiled`; `attnquant_kernels.layout.tile_nvfp4`
# writes it at load) stores each tile of 16 rows already transposed: for every 8 inputs (one
# 32-bit word of each row), the 16 rows' words side by side, 64 bytes; the scales likewise,
# per block of 16 inputs the 16 rows' bytes. A tile is then one contiguous stream of 8 * K
# bytes read front to back, with no transpose and no gather, where the row-major tile reads 16
# streams: 4096 x 1024 in 0.13-0.14 ms against 0.18-0.19 (standalone driver, one input row,
# the weight in DRAM, interleaved, r = 0; 1.24-1.37x over shapes). The rows past the last whole tile stay row-major
# after the tiles, so every byte is where `_nvfp4_block` expects it there. Off AVX-512 the
# tiled op runs these tiles too, looking codes up lane by lane.

from std.collections import Array
from std.math import fma
from std.memory import bitcast
from std.sys import CompilationTarget, PrefetchOptions, llvm_intrinsic, prefetch

from ._common import F32, Ptr
from ._nvfp4 import U8, _nvfp4_store, e4m3

# Weight rows of a tile: the float32 lanes of an AVX-512 register.
comptime LANES = 16
# Inputs of a chunk: 64 packed bytes per row, 8 blocks of 16.
comptime KCHUNK = 128
comptime CHUNK_BLOCKS = KCHUNK // 16
comptime U32 = DType.uint32
# Bytes of each row's stream fetched ahead into L1 (two chunks), beside the next tile into L2.
# Both against neither, the weight in DRAM (standalone driver, interleaved): 1.22x at 4096 x
# 1024, 0.97-0.99x at 1024 x 4096 (whose next tile is 32 KiB ahead). L1 alone at 64, 128, 256
# and 512 bytes: 1.01x, 1.14-1.16x, 1.08x, 1.02x at 4096 x 1024.
comptime PREFETCH_AHEAD = 128
# Bytes ahead of the tiled layout's stream prefetched into L1 (one chunk), and into L2 (eight).
# L1 alone at 1, 2 and 4 KiB ran within noise of each other (standalone driver, 4096 x 1024 and
# 1024 x 4096); the L2 line beside it: 0.96-0.99x with two sum chains, 1.05-1.10x with four.
comptime TILED_AHEAD = 1024
comptime TILED_FAR = 8192
# Partial sums per block for one input row: independent FMA chains in flight. Against two sums
# and the 2 KiB L1 line alone (standalone driver, one row, the weight in DRAM, interleaved,
# 2026-12-02): four with both prefetches 1.09-1.14x at 4096 x 1024, 1024 x 4096, 8192 x 1024
# and 32000 x 1024; four alone 0.98-1.08x; eight 0.93-0.96x.
comptime SUM_CHAINS = 4

# The E2M1 values of the 16 codes (code 8 is -0).
comptime E2M1 = SIMD[F32, LANES](
    0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6
)


# Whether this target runs these tiles (AVX-512: `vpermps` on 16 lanes).
comptime NVFP4_LANES = CompilationTarget.has_avx512f()
# Input rows below which they serve a projection; from 8 rows on, decoding a weight row once
# into a float scratch for every input row (_nvfp4_block) is as fast. _nvfp4_block's time over
# this one's, measured as in the header (before the L2 prefetch): 1.48 at 1 row, 2.00 at 2,
# 1.89 at 3, 1.27 at 4, 1.28 at 6, 1.01 at 8, 0.99 at 12.
comptime LANES_BELOW_ROWS = 8
# Tiles of 16 weight rows per parallel work item.
comptime LANES_GROUPS = 4


@always_inline
def lookup_e2m1(codes: SIMD[U32, LANES]) -> SIMD[F32, LANES]:
    """The E2M1 value of the low 4 bits of each lane (one `vpermps`; higher bits ignored).

    Off AVX-512 (where only the tiled layout's op runs these tiles, `TILED`), lane by lane.
    """
    comptime if NVFP4_LANES:
        return llvm_intrinsic["llvm.x86.avx512.permvar.sf.512", SIMD[F32, LANES]](
            E2M1, bitcast[DType.int32, LANES](codes)
        )
    else:
        var out = SIMD[F32, LANES](0)
        comptime for q in range(LANES):
            out[q] = E2M1[Int(codes[q] & 15)]
        return out


@always_inline
def _swap_mask[h: Int, hi: Bool]() -> SIMD[DType.int32, LANES]:
    """Lane sources of one butterfly step of the 16 x 16 transpose (2-input shuffle indices)."""
    var mask = SIMD[DType.int32, LANES](0)
    comptime for q in range(LANES):
        comptime if not hi:
            mask[q] = Int32(q if (q & h) == 0 else LANES + q - h)
        else:
            mask[q] = Int32(q + h if (q & h) == 0 else LANES + q)
    return mask


@always_inline
def _pair[
    h: Int
](a: SIMD[U32, LANES], b: SIMD[U32, LANES]) -> Tuple[SIMD[U32, LANES], SIMD[U32, LANES]]:
    """One butterfly step: blocks of h lanes swapped between rows i and i + h."""
    comptime lo = _swap_mask[h, False]()
    comptime hi = _swap_mask[h, True]()
    var first = a.shuffle[
        Int(lo[0]), Int(lo[1]), Int(lo[2]), Int(lo[3]), Int(lo[4]), Int(lo[5]), Int(lo[6]),
        Int(lo[7]), Int(lo[8]), Int(lo[9]), Int(lo[10]), Int(lo[11]), Int(lo[12]),
        Int(lo[13]), Int(lo[14]), Int(lo[15]),
    ](b)
    var second = a.shuffle[
        Int(hi[0]), Int(hi[1]), Int(hi[2]), Int(hi[3]), Int(hi[4]), Int(hi[5]), Int(hi[6]),
        Int(hi[7]), Int(hi[8]), Int(hi[9]), Int(hi[10]), Int(hi[11]), Int(hi[12]),
        Int(hi[13]), Int(hi[14]), Int(hi[15]),
    ](b)
    return (first, second)


@always_inline
def _transpose(mut rows: Array[SIMD[U32, LANES], LANES]):
    """`rows[i][q]` becomes `rows[q][i]` (four butterfly steps of 16 shuffles)."""
    comptime for step in range(4):
        comptime h = 8 >> step
        comptime for i in range(LANES):
            comptime if (i & h) == 0:
                var pair = _pair[h](rows[i], rows[i + h])
                rows[i] = pair[0]
                rows[i + h] = pair[1]


@always_inline
def _scale_bytes(
    scale: Ptr[U8], ss: Int
) -> Tuple[SIMD[DType.uint64, 8], SIMD[DType.uint64, 8]]:
    """The 8 scale bytes of one chunk for rows 0-7 and 8-15, a row per 64-bit lane."""
    var lo = SIMD[DType.uint64, 8](0)
    var hi = SIMD[DType.uint64, 8](0)
    comptime for i in range(8):
        lo[i] = scale.unsafe_offset(i * ss).unsafe_bitcast[UInt64]().unsafe_load(0)
        hi[i] = scale.unsafe_offset((i + 8) * ss).unsafe_bitcast[UInt64]().unsafe_load(0)
    return (lo, hi)


@always_inline
def _block_scale[
    b: Int
](lo: SIMD[DType.uint64, 8], hi: SIMD[DType.uint64, 8]) -> SIMD[F32, LANES]:
    """The decoded E4M3 scales of block b of the chunk, lane i for row i."""
    # Lane i: byte b of row i's 8 bytes (shifted down; e4m3 masks the higher bytes).
    var l = (lo >> UInt64(8 * b)).cast[U32]()
    var h = (hi >> UInt64(8 * b)).cast[U32]()
    return e4m3[LANES](l.join(h))


@always_inline
def _chain_sum[
    n: Int
](part: Array[SIMD[F32, LANES], _], first: Int) -> SIMD[F32, LANES]:
    """`part[first] + ... + part[first + n - 1]`, pairwise: halves of n // 2 and n - n // 2."""
    comptime if n == 1:
        return part[first]
    else:
        return _chain_sum[n // 2](part, first) + _chain_sum[n - n // 2](part, first + n // 2)


@always_inline
def _chunk[
    xdt: DType, mr: Int, tiled: Bool
](
    x: Ptr[xdt],
    xs: Int,
    w: Ptr[U8],
    ws: Int,
    scale: Ptr[U8],
    ss: Int,
    ahead: Ptr[U8],
    mut acc: Array[SIMD[F32, LANES], mr],
):
    """`acc[j][i] += <W'[i, :128], x[j, :128]>` for 16 rows of W' (without scale_2) and mr of x.

    Row-major (Model Optimizer's layout): `w`, `scale` at row 0 of the chunk, rows `ws`, `ss`
    apart; `ahead`: 1 KiB of the next tile's weight rows to prefetch meanwhile (any address
    will do). Tiled (`tile_nvfp4`): `w` at the chunk's 16 words of 16 rows (1 KiB), `scale` at
    its 8 blocks of 16 rows' scale bytes (128 bytes); the strides and `ahead` are not read.
    """
    var rows = Array[SIMD[U32, LANES], LANES](fill=0)
    var sb = (SIMD[DType.uint64, 8](0), SIMD[DType.uint64, 8](0))
    comptime if tiled:
        # Already transposed: word q of every row is one vector. The stream is contiguous, so
        # one prefetch per line a fixed distance ahead keeps it in flight.
        comptime for q in range(LANES):
            rows[q] = bitcast[U32, LANES](w.unsafe_load[width=64](q * 64))
            prefetch[PrefetchOptions().for_read().high_locality()](
                w.unsafe_offset(TILED_AHEAD + q * 64)
            )
            prefetch[PrefetchOptions().for_read().medium_locality()](
                w.unsafe_offset(TILED_FAR + q * 64)
            )
    else:
        comptime for i in range(LANES):
            rows[i] = bitcast[U32, LANES](w.unsafe_load[width=64](i * ws))
            # Into L1: this row two chunks on; into L2: the next tile's rows, line by line, so a
            # tile's 16 * ws contiguous bytes are fetched while the one before it is decoded.
            prefetch[PrefetchOptions().for_read().high_locality()](
                w.unsafe_offset(i * ws + PREFETCH_AHEAD)
            )
            prefetch[PrefetchOptions().for_read().medium_locality()](
                ahead.unsafe_offset(i * 64)
            )
        _transpose(rows)
        sb = _scale_bytes(scale, ss)
    # One input row: SUM_CHAINS partial sums per block; more rows are chains of their own.
    comptime P = SUM_CHAINS if mr == 1 else 1
    comptime for b in range(CHUNK_BLOCKS):
        var part = Array[SIMD[F32, LANES], P * mr](fill=0)
        comptime for half in range(2):
            var words = rows[2 * b + half]
            comptime for i in range(8):
                var vals = lookup_e2m1(words >> UInt32(4 * i))
                comptime k = 16 * b + 8 * half + i
                comptime for j in range(mr):
                    part[P * j + i % P] = fma(
                        vals,
                        SIMD[F32, LANES](x.unsafe_load(j * xs + k).cast[F32]()),
                        part[P * j + i % P],
                    )
        var sc: SIMD[F32, LANES]
        comptime if tiled:
            sc = e4m3[LANES](scale.unsafe_load[width=LANES](b * LANES).cast[U32]())
        else:
            sc = _block_scale[b](sb[0], sb[1])
        comptime for j in range(mr):
            acc[j] = fma(_chain_sum[P](part, P * j), sc, acc[j])


@always_inline
def _lanes_tile[
    xdt: DType, sdt: DType, odt: DType, mr: Int, tiled: Bool
](
    x: Ptr[xdt],
    xs: Int,
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
    """Outputs [m, m + mr) x [n, n + 16): y = s * scale_2 * <W', x> + <U, t>.

    Either layout puts the tile's weights at `w + n * ws` and its scales at `scale + n * ss`
    (a tile of the tiled layout holds the 16 rows' bytes, transposed).
    """
    var acc = Array[SIMD[F32, LANES], mr](fill=0)
    var xm = x.unsafe_offset(m * xs)
    var wn = w.unsafe_offset(n * ws)
    var sn = scale.unsafe_offset(n * ss)
    # Bytes from one chunk to the next: of a row (row-major), of the tile (tiled).
    comptime W_STEP = LANES * 64 if tiled else KCHUNK // 2
    comptime S_STEP = LANES * CHUNK_BLOCKS if tiled else CHUNK_BLOCKS
    var chunks = K // KCHUNK
    for c in range(chunks):
        _chunk[xdt, mr, tiled](
            xm.unsafe_offset(c * KCHUNK),
            xs,
            wn.unsafe_offset(c * W_STEP),
            ws,
            sn.unsafe_offset(c * S_STEP),
            ss,
            wn.unsafe_offset(LANES * ws + c * LANES * 64),
            acc,
        )
    var k0 = chunks * KCHUNK
    if k0 < K:
        # The last blocks, padded with zeros to a whole chunk.
        var nb = (K - k0) // 16
        var wbuf = Array[UInt8, LANES * 64](fill=0)
        var sbuf = Array[UInt8, LANES * CHUNK_BLOCKS](fill=0)
        var xbuf = Array[Float32, mr * KCHUNK](fill=0)
        comptime if tiled:
            # Its 2 * nb words of 16 rows, then its nb blocks of 16 scale bytes.
            for q in range(nb * 2 * 64):
                wbuf[q] = wn.unsafe_load(chunks * W_STEP + q)
            for q in range(nb * LANES):
                sbuf[q] = sn.unsafe_load(chunks * S_STEP + q)
        else:
            for i in range(LANES):
                for q in range(nb * 8):
                    wbuf[i * 64 + q] = wn.unsafe_load(i * ws + k0 // 2 + q)
                for q in range(nb):
                    sbuf[i * CHUNK_BLOCKS + q] = sn.unsafe_load(i * ss + k0 // 16 + q)
        for j in range(mr):
            for q in range(K - k0):
                xbuf[j * KCHUNK + q] = xm.unsafe_load(j * xs + k0 + q).cast[F32]()
        var wb = wbuf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
        _chunk[F32, mr, tiled](
            xbuf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
            KCHUNK,
            wb,
            64,
            sbuf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin](),
            CHUNK_BLOCKS,
            wb,
            acc,
        )
    var d = Array[Float32, mr * LANES](fill=0)
    comptime for j in range(mr):
        comptime for i in range(LANES):
            d[j * LANES + i] = acc[j][i]
    _nvfp4_store[sdt, odt, mr, LANES](d, scale_2, s, s_step, u, us, t, r, r, dst, os, m, n)


def nvfp4_lanes_rows[
    xdt: DType, sdt: DType, odt: DType, tiled: Bool = False
](
    x: Ptr[xdt],
    xs: Int,
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
    """Outputs [m0, m1) x [n0, n1) on the calling thread, `n1 - n0` a multiple of 16.

    Up to four input rows at a time share each decoded code. `tiled`: the weight and scales
    are in the layout of `tile_nvfp4` (`n0` then a multiple of 16).
    """
    var n = n0
    while n < n1:
        var m = m0
        while m + 4 <= m1:
            _lanes_tile[xdt, sdt, odt, 4, tiled](
                x, xs, w, ws, scale, ss, scale_2, s, s_step, u, us, t, r, dst, os, K, m, n
            )
            m += 4
        if m + 2 <= m1:
            _lanes_tile[xdt, sdt, odt, 2, tiled](
                x, xs, w, ws, scale, ss, scale_2, s, s_step, u, us, t, r, dst, os, K, m, n
            )
            m += 2
        if m < m1:
            _lanes_tile[xdt, sdt, odt, 1, tiled](
                x, xs, w, ws, scale, ss, scale_2, s, s_step, u, us, t, r, dst, os, K, m, n
            )
        n += LANES
