# attnquant kernels: the CPU GEMM of a projection over many rows (a prefill), over panels of
# its weight written once per call.
#
#   panel[k, c]     = W[n0 + c, k] * s[n0 + c]     (k < K: the shared block with its row scale,
#                                                   or the NVFP4 weight decoded, _nvfp4_cpu)
#   panel[K + q, c] = U[n0 + c, q]                 (q < r: the correction as r more inputs)
#
# A work item fills the panel of PW output columns (a scratch of (K + r) x PW floats that stays
# in L2; 16 x 16 tiles transposed in registers), then register tiles of MRP input rows x PW
# columns accumulate x[m, k] * panel[k, :] (one broadcast and NV vector FMAs per row and k)
# over the K inputs and t[m, q] * panel[K + q, :] over the r of the correction, and are
# stored as they leave the registers. So each weight is read and scaled once per call, not once
# per tile of rows, and each step of a tile is MRP * NV FMAs for NV loads.

from std.collections import Array
from std.math import fma
from std.sys import simd_width_of

from ._common import ADD, F32, GATE_MUL, Ptr, activate

# float32 SIMD lanes (8 on AVX2, 16 on AVX-512, 4 on NEON).
comptime PSW = simd_width_of[F32]()
# Vectors of output columns per register tile: MRP * NV accumulators, NV panel vectors and a
# broadcast fit the 32 vector registers of AVX-512 and NEON, and (NV = 2) AVX2's 16.
comptime NV = 2 if PSW == 8 else 4
# Output columns of a panel: 64 on AVX-512, 16 on AVX2 and NEON (whole 16 x 16 tiles).
comptime PW = NV * PSW
# Input rows of a register tile.
comptime MRP = 6
# Rows from which a projection runs on panels (below: its dot-product tiles): the crossovers
# measured on this project's CPU (AVX-512, `mojo build` drivers) were 24-32 rows for a float
# block and 12-16 for the NVFP4 op, whose tiles decode every weight again per tile of rows.
comptime PANEL_FROM_ROWS = 32
comptime NVFP4_PANEL_FROM_ROWS = 16
# The side of a transposed tile.
comptime TILE = 16


@always_inline
def transpose16(
    var r: Array[SIMD[F32, TILE], TILE]
) -> Array[SIMD[F32, TILE], TILE]:
    """The 16 x 16 tile `r` (one SIMD row each) transposed in registers: log2(16) = 4 perfect
    shuffles, each interleaving row i with row i + 8."""
    comptime for _ in range(4):
        var t = Array[SIMD[F32, TILE], TILE](fill=0)
        comptime for j in range(TILE // 2):
            var both = r[j].interleave(r[j + TILE // 2])
            t[2 * j] = both.slice[TILE, offset=0]()
            t[2 * j + 1] = both.slice[TILE, offset=TILE]()
        r = t^
    return r^


@always_inline
def store_transposed[
    odt: DType
](var rows: Array[SIMD[F32, TILE], TILE], dst: Ptr[odt], ds: Int, at: Int):
    """`dst[at + j * ds + i] = rows[i][j]`: the 16 x 16 tile transposed in registers
    (`transpose16`), then one 16-value store per output row (row stride `ds`)."""
    var cols = transpose16(rows^)
    comptime for j in range(TILE):
        dst.unsafe_store[width=TILE](at + j * ds, cols[j].cast[odt]())


def fill_correction[
    wdt: DType
](u: Ptr[wdt], us: Int, r: Int, K: Int, n0: Int, panel: Ptr[F32]):
    """`panel[K + q, c]` = U[n0 + c, q] for q < r (row stride PW)."""
    for q in range(r):
        for c in range(PW):
            panel.unsafe_store((K + q) * PW + c, u.unsafe_load((n0 + c) * us + q).cast[F32]())


def fill_panel[
    wdt: DType
](
    w0: Ptr[wdt],
    w0s: Int,
    s: Ptr[wdt],
    u: Ptr[wdt],
    us: Int,
    r: Int,
    K: Int,
    n0: Int,
    panel: Ptr[F32],
):
    """The panel of columns [n0, n0 + PW) of a float shared block: `W0[n, k] * s[n]`, then U."""
    comptime assert PW % TILE == 0, "a panel holds whole 16 x 16 tiles"
    var k_main = (K // TILE) * TILE
    for g in range(PW // TILE):
        var c0 = g * TILE
        var f = Array[Float32, TILE](fill=0)
        comptime for i in range(TILE):
            f[i] = s.unsafe_load(n0 + c0 + i).cast[F32]()
        for k0 in range(0, k_main, TILE):
            var rows = Array[SIMD[F32, TILE], TILE](fill=0)
            comptime for i in range(TILE):
                var row = w0.unsafe_offset((n0 + c0 + i) * w0s + k0)
                rows[i] = row.unsafe_load[width=TILE]().cast[F32]() * f[i]
            store_transposed[F32](rows^, panel, PW, k0 * PW + c0)
        for k in range(k_main, K):
            comptime for i in range(TILE):
                var value = w0.unsafe_load((n0 + c0 + i) * w0s + k).cast[F32]() * f[i]
                panel.unsafe_store(k * PW + c0 + i, value)
    fill_correction[wdt](u, us, r, K, n0, panel)


@always_inline
def _panel_tile[
    xdt: DType, odt: DType, combine: Int, act: Int, mr: Int
](
    x: Ptr[xdt],
    xs: Int,
    t: Ptr[F32],
    r: Int,
    panel: Ptr[F32],
    K: Int,
    dst: Ptr[odt],
    os: Int,
):
    """`dst[j, :PW]` = x[j, :] @ panel[:K] + t[j, :] @ panel[K:] for mr rows (x, t and dst at
    the tile's first row and column); GATE_MUL: `act(dst) * that`; ADD: `dst + that`."""
    var acc = Array[SIMD[F32, PSW], mr * NV](fill=0)
    for k in range(K):
        var p = Array[SIMD[F32, PSW], NV](fill=0)
        comptime for v in range(NV):
            p[v] = panel.unsafe_load[width=PSW](k * PW + v * PSW)
        comptime for j in range(mr):
            var a = SIMD[F32, PSW](x.unsafe_load(j * xs + k).cast[F32]())
            comptime for v in range(NV):
                acc[j * NV + v] = fma(a, p[v], acc[j * NV + v])
    for q in range(r):
        var p = Array[SIMD[F32, PSW], NV](fill=0)
        comptime for v in range(NV):
            p[v] = panel.unsafe_load[width=PSW]((K + q) * PW + v * PSW)
        comptime for j in range(mr):
            var a = SIMD[F32, PSW](t.unsafe_load(j * r + q))
            comptime for v in range(NV):
                acc[j * NV + v] = fma(a, p[v], acc[j * NV + v])
    comptime for j in range(mr):
        comptime for v in range(NV):
            var at = dst.unsafe_offset(j * os + v * PSW)
            comptime if combine == GATE_MUL:
                var gate = at.unsafe_load[width=PSW]().cast[F32]()
                var out = SIMD[F32, PSW](0)
                comptime for l in range(PSW):
                    out[l] = activate[act](gate[l]) * acc[j * NV + v][l]
                at.unsafe_store[width=PSW](out.cast[odt]())
            elif combine == ADD:
                var sum = at.unsafe_load[width=PSW]().cast[F32]() + acc[j * NV + v]
                at.unsafe_store[width=PSW](sum.cast[odt]())
            else:
                at.unsafe_store[width=PSW](acc[j * NV + v].cast[odt]())


def panel_rows[
    xdt: DType, odt: DType, combine: Int, act: Int
](
    x: Ptr[xdt],
    xs: Int,
    t: Ptr[F32],
    r: Int,
    panel: Ptr[F32],
    K: Int,
    dst: Ptr[odt],
    os: Int,
    M: Int,
    n0: Int,
):
    """Columns [n0, n0 + PW) of every row from one panel: tiles of MRP rows, then one tile of
    the rows left."""
    var m = 0
    while m + MRP <= M:
        _panel_tile[xdt, odt, combine, act, MRP](
            x.unsafe_offset(m * xs),
            xs,
            t.unsafe_offset(m * r),
            r,
            panel,
            K,
            dst.unsafe_offset(m * os + n0),
            os,
        )
        m += MRP
    comptime for mr in range(1, MRP):
        if M - m == mr:
            _panel_tile[xdt, odt, combine, act, mr](
                x.unsafe_offset(m * xs),
                xs,
                t.unsafe_offset(m * r),
                r,
                panel,
                K,
                dst.unsafe_offset(m * os + n0),
                os,
            )
