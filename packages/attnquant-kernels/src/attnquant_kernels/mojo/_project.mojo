# attnquant kernels: the CPU down-projection of a low-rank term, t = x @ V.
#
#   t[m, :r] = x[m, :K] @ V[:K, :r]          (V row-major [K, r])
#
# A narrow GEMM: work items are register tiles of up to MRP input rows x one slab of up to PW
# columns of V (NV vectors of PSW floats). Each step over k loads the slab's row of V once
# and broadcasts x[m, k] for each row of the tile, MRP * NV FMAs held in registers and
# stored once at the end. The columns past the last whole vector (r not a multiple of PSW)
# take one more vector, loaded whole where reading past them stays inside V. Items run slab
# by slab, so the tiles of one slab find it in L2; V is read in place, except at many rows
# when its row stride aliases in the caches (then each item packs its slab first). So a
# decode step reads V once at memory speed and a prefill reuses each load of V across MRP
# rows (before: one row per task, t read and written back on every k, about 7 GMAC/s for
# 512 x 1024 x 16; now about 90).

from std.collections import Array
from std.math import ceildiv, fma
from std.sys import size_of

from max.algorithm import parallelize

from ._common import F32, Ptr
from ._panel import MRP, NV, PANEL_FROM_ROWS, PSW, PW

# Tiles of MRP rows per work item over one packed slab of V (many rows).
comptime PACKED_TILES = 8


@always_inline
def _tail_vector[
    wdt: DType
](row: Ptr[wdt], w: Int, tail: Int, whole: Bool) -> SIMD[F32, PSW]:
    """The `tail` values of `row` from `w` in the first lanes of a vector: one load where
    `whole` (reading past them stays inside V), else one element at a time."""
    if whole:
        return row.unsafe_load[width=PSW](w).cast[F32]()
    var q = SIMD[F32, PSW](0)
    for c in range(tail):
        q[c] = row.unsafe_load(w + c).cast[F32]()
    return q


@always_inline
def _project_tile[
    xdt: DType, wdt: DType, mr: Int, nv: Int, partial: Bool
](
    x: Ptr[xdt],
    xs: Int,
    K: Int,
    v: Ptr[wdt],
    vs: Int,
    tail: Int,
    readable: Int,
    t: Ptr[F32],
    ts: Int,
):
    """`t[j, :nv * PSW + tail] = x[j, :K] @ v[:K, :nv * PSW + tail]` for mr rows (x, v and t
    at the tile's first row and column); `partial`: one more vector holds the `tail` columns
    (`0 < tail < PSW`), loaded whole on the rows where that stays within the `readable`
    elements from `v` (the values past the tail are multiplied but never stored)."""
    comptime nw = nv + 1 if partial else nv
    comptime w = nv * PSW
    var acc = Array[SIMD[F32, PSW], mr * nw](fill=0)
    # Rows k < k_whole can load the tail vector whole: k * vs + w + PSW <= readable.
    var k_whole = 0
    comptime if partial:
        k_whole = min(K, max(0, (readable - w - PSW) // vs + 1))
    for k in range(K):
        var row = v.unsafe_offset(k * vs)
        var p = Array[SIMD[F32, PSW], nw](fill=0)
        comptime for c in range(nv):
            p[c] = row.unsafe_load[width=PSW](c * PSW).cast[F32]()
        comptime if partial:
            p[nv] = _tail_vector[wdt](row, w, tail, k < k_whole)
        comptime for j in range(mr):
            var a = SIMD[F32, PSW](x.unsafe_load(j * xs + k).cast[F32]())
            comptime for c in range(nw):
                acc[j * nw + c] = fma(a, p[c], acc[j * nw + c])
    comptime for j in range(mr):
        comptime for c in range(nv):
            t.unsafe_store[width=PSW](j * ts + c * PSW, acc[j * nw + c])
        comptime if partial:
            for c in range(tail):
                t.unsafe_store(j * ts + w + c, acc[j * nw + nv][c])


@always_inline
def _project_rows[
    xdt: DType, wdt: DType, mr: Int
](
    x: Ptr[xdt],
    xs: Int,
    K: Int,
    v: Ptr[wdt],
    vs: Int,
    width: Int,
    readable: Int,
    t: Ptr[F32],
    ts: Int,
):
    """One slab of `width` <= PW columns for mr rows: its whole vectors, and the columns left
    in one more, as one tile."""
    var tail = width % PSW
    comptime for nv in range(NV + 1):
        if width // PSW == nv:
            if tail == 0:
                _project_tile[xdt, wdt, mr, nv, False](
                    x, xs, K, v, vs, 0, readable, t, ts
                )
            else:
                comptime if nv < NV:
                    _project_tile[xdt, wdt, mr, nv, True](
                        x, xs, K, v, vs, tail, readable, t, ts
                    )


@always_inline
def _tiles_of_slab[
    xdt: DType, wdt: DType
](
    x: Ptr[xdt],
    xs: Int,
    M: Int,
    K: Int,
    v: Ptr[wdt],
    vs: Int,
    width: Int,
    readable: Int,
    t: Ptr[F32],
    ts: Int,
    tile0: Int,
    tile1: Int,
):
    """Tiles [tile0, tile1) of MRP rows over one slab of `width` columns (v and t at its
    first column)."""
    for tile in range(tile0, tile1):
        var m0 = tile * MRP
        var rows = min(MRP, M - m0)
        comptime for mr in range(1, MRP + 1):
            if rows == mr:
                _project_rows[xdt, wdt, mr](
                    x.unsafe_offset(m0 * xs),
                    xs,
                    K,
                    v,
                    vs,
                    width,
                    readable,
                    t.unsafe_offset(m0 * ts),
                    ts,
                )


def _project_packed[
    xdt: DType, wdt: DType
](
    x: Ptr[xdt],
    xs: Int,
    M: Int,
    K: Int,
    v: Ptr[wdt],
    vs: Int,
    r: Int,
    t: Ptr[F32],
    ts: Int,
):
    """Many rows, V's rows a multiple of 512 bytes apart: each work item copies one slab into a
    contiguous [K, PW] float32 scratch (zero past the slab's columns) and runs
    PACKED_TILES tiles of rows over it. Read in place, a slab of a long V (K = 4096) is K rows
    at V's row stride, which at strides that are multiples of 512 bytes fall into a few cache
    sets: at 512 x 4096, r = 256, 39-48 GMAC/s in place against 61-72 packed."""
    var slabs = ceildiv(r, PW)
    var chunks = ceildiv(ceildiv(M, MRP), PACKED_TILES)
    var tiles = ceildiv(M, MRP)

    def item(i: Int) {var}:
        var j0 = (i // chunks) * PW
        var chunk = i % chunks
        var width = min(PW, r - j0)
        var buf = List[Float32](length=K * PW, fill=0)
        var packed = buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
        var whole = width // PSW
        for k in range(K):
            var row = v.unsafe_offset(k * vs + j0)
            for c in range(whole):
                packed.unsafe_store[width=PSW](
                    k * PW + c * PSW, row.unsafe_load[width=PSW](c * PSW).cast[F32]()
                )
            for c in range(whole * PSW, width):
                packed.unsafe_store(k * PW + c, row.unsafe_load(c).cast[F32]())
        _tiles_of_slab[xdt, F32](
            x,
            xs,
            M,
            K,
            packed,
            PW,
            width,
            K * PW,
            t.unsafe_offset(j0),
            ts,
            chunk * PACKED_TILES,
            min(tiles, (chunk + 1) * PACKED_TILES),
        )
        _ = buf^

    parallelize(item, slabs * chunks)


def project_cpu[
    xdt: DType, wdt: DType
](
    x: Ptr[xdt],
    xs: Int,
    M: Int,
    K: Int,
    v: Ptr[wdt],
    vs: Int,
    r: Int,
    t: Ptr[F32],
    ts: Int,
):
    """`t[m, :r] = x[m, :K] @ V[:K, :r]` in float32, any `r`: tiles of MRP rows x PW columns
    in parallel, V read in place (a decode step: one tile per PW columns), or from
    PANEL_FROM_ROWS rows on for a V of aliasing row stride, over slabs packed once per
    PACKED_TILES tiles."""
    if r == 0 or M == 0:
        return
    var slabs = ceildiv(r, PW)
    var tiles = ceildiv(M, MRP)
    # Packed slabs only where reading in place is slow: several slabs of a V whose rows are a
    # multiple of 512 bytes apart, at many rows (measured, 512 x 4096: r = 256 39-48 GMAC/s in
    # place, 61-69 packed; r = 409 89-97 in place, 81-82 packed; r = 16 in place 2x faster).
    var aliased = (vs * size_of[wdt]()) % 512 == 0
    if M >= PANEL_FROM_ROWS and r > PW and aliased:
        _project_packed[xdt, wdt](x, xs, M, K, v, vs, r, t, ts)
        return
    # Elements of V from its first: the last row holds r, not vs.
    var readable = (K - 1) * vs + r

    # Slab-major: consecutive items read the same slab of V (in L2), not a slab each.
    def item(i: Int) {var}:
        var j0 = (i // tiles) * PW
        var tile = i % tiles
        _tiles_of_slab[xdt, wdt](
            x,
            xs,
            M,
            K,
            v.unsafe_offset(j0),
            vs,
            min(PW, r - j0),
            readable - j0,
            t.unsafe_offset(j0),
            ts,
            tile,
            tile + 1,
        )

    parallelize(item, slabs * tiles)
