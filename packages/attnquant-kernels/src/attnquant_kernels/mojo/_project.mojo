# attnquant kernels: the CPU down-projection of a low-rank term, t = x @ V.
#
#   t[m, :r] = x[m, :K] @ V[:K, :r]          (V row-major [K, r], read in place)
#
# A narrow GEMM: work items are register tiles of up to MRP input rows x one slab of up to PW
# columns of V (NV vectors of PSW floats). Each step over k loads the slab's row of V once
# and broadcasts x[m, k] for each row of the tile, MRP * NV FMAs held in registers and
# stored once at the end. The columns past the last whole vector (r not a multiple of PSW)
# run as scalar FMAs in the same pass. So a decode step reads V once at memory speed and a
# prefill reuses each load of V across MRP rows (before: one row per task, t read and
# written back on every k, about 7 GMAC/s for 512 x 1024 x 16).

from std.collections import Array
from std.math import ceildiv, fma

from max.algorithm import parallelize

from ._common import F32, Ptr
from ._panel import MRP, NV, PSW, PW


@always_inline
def _project_tile[
    xdt: DType, wdt: DType, mr: Int, nv: Int
](
    x: Ptr[xdt],
    xs: Int,
    K: Int,
    v: Ptr[wdt],
    vs: Int,
    tail: Int,
    t: Ptr[F32],
    ts: Int,
):
    """`t[j, :nv * PSW + tail] = x[j, :K] @ v[:K, :nv * PSW + tail]` for mr rows (x, v and t
    at the tile's first row and column)."""
    var acc = Array[SIMD[F32, PSW], mr * nv](fill=0)
    var rest = Array[Float32, mr * PSW](fill=0)
    comptime w = nv * PSW
    for k in range(K):
        var row = v.unsafe_offset(k * vs)
        var p = Array[SIMD[F32, PSW], nv](fill=0)
        comptime for c in range(nv):
            p[c] = row.unsafe_load[width=PSW](c * PSW).cast[F32]()
        comptime for j in range(mr):
            var a = x.unsafe_load(j * xs + k).cast[F32]()
            comptime for c in range(nv):
                acc[j * nv + c] = fma(SIMD[F32, PSW](a), p[c], acc[j * nv + c])
            for c in range(tail):
                rest[j * PSW + c] = fma(
                    a, row.unsafe_load(w + c).cast[F32](), rest[j * PSW + c]
                )
    comptime for j in range(mr):
        comptime for c in range(nv):
            t.unsafe_store[width=PSW](j * ts + c * PSW, acc[j * nv + c])
        for c in range(tail):
            t.unsafe_store(j * ts + w + c, rest[j * PSW + c])


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
    t: Ptr[F32],
    ts: Int,
):
    """One slab of `width` <= PW columns for mr rows: NV, ..., 1 or 0 whole vectors plus the
    columns left, as one tile."""
    var tail = width % PSW
    comptime for nv in range(NV, -1, -1):
        if width // PSW == nv:
            _project_tile[xdt, wdt, mr, nv](x, xs, K, v, vs, tail, t, ts)


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
    in parallel (a decode step: one tile per PW columns)."""
    if r == 0 or M == 0:
        return
    var slabs = ceildiv(r, PW)
    var tiles = ceildiv(M, MRP)

    def item(i: Int) {var}:
        var j0 = (i % slabs) * PW
        var m0 = (i // slabs) * MRP
        var width = min(PW, r - j0)
        var rows = min(MRP, M - m0)
        var xi = x.unsafe_offset(m0 * xs)
        var vi = v.unsafe_offset(j0)
        var ti = t.unsafe_offset(m0 * ts + j0)
        comptime for mr in range(1, MRP + 1):
            if rows == mr:
                _project_rows[xdt, wdt, mr](xi, xs, K, vi, vs, width, ti, ts)

    parallelize(item, slabs * tiles)
