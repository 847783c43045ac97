# attnquant kernels: the fused NVFP4 projection on the CPU, for any number of rows.
#
#   y[m, n] = s[n] * scale_2 * <W'[n, :], x[m, :]> + <U[n, :], t[m, :]>,   t = x @ V
#
# Few rows (a decode step): on AVX-512 below LANES_BELOW_ROWS rows, `nvfp4_lanes_rows`
# (_nvfp4_lanes.mojo), sixteen weight rows in the lanes; else `_nvfp4_block` (_nvfp4.mojo),
# each weight block decoded in registers inside the dot products. Either way a step reads 4.5
# bits per weight.
#
# From NVFP4_PANEL_FROM_ROWS (16) rows on (a prefill) the op is the panel GEMM of _panel.mojo:
# the weight is decoded once per call, a panel of PW output columns at a time, into a scratch
# that stays in L2 (`panel[k, c] = W[n0 + c, k] * s[n0 + c]`, then U's rows). Nothing the
# size of W is ever written: the prefill pays no float weight in memory, only its FMAs.
#
# With int8 activations (`a8`, the tiled layout) every whole tile runs on the integer tiles of
# _nvfp4_a8.mojo at any row count: a decode step, a batch of streams and a prefill alike.

from std.collections import Array
from std.math import ceildiv
from std.memory import bitcast

from max.algorithm import parallelize

from ._common import ADD, F32, STORE, Ptr
from ._cpu import M_BLOCK, N_BLOCK, project_cpu
from ._nvfp4 import QBLOCK, U8, _nvfp4_block, e2m1_x2_block, e4m3, e4m3_half_table
from ._nvfp4_a8 import nvfp4_a8_linear
from ._nvfp4_lanes import (
    LANES,
    LANES_BELOW_ROWS,
    LANES_GROUPS,
    NVFP4_LANES,
    U32,
    lookup_e2m1,
    nvfp4_lanes_rows,
)
from ._panel import (
    NV,
    NVFP4_PANEL_FROM_ROWS,
    PSW,
    PW,
    fill_correction,
    panel_rows,
    store_transposed,
)

# Inputs of a panel at a time: 2048 x 64 float32 (512 KiB) stays in a 2 MiB L2 beside the rows
# of x; a whole K of 8192 (2 MiB) did not: 512 x 2048 x 8192 ran at 77-90 GMAC/s against
# 109-152 for K = 2048 (standalone driver, best of 6 calls).
comptime KC = 2048


def _fill_panel[
    sdt: DType
](
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
    r: Int,
    K: Int,
    n0: Int,
    panel: Ptr[F32],
    k0: Int,
):
    """`panel[k, c]` = W[n0 + c, k0 + k] * s[n0 + c] for k < K (k0 a multiple of 16), then
    `panel[K + q, c]` = U[n0 + c, q] for q < r (row stride PW)."""
    comptime assert PW % QBLOCK == 0, "a panel holds whole 16 x 16 tiles"
    for g in range(PW // QBLOCK):
        var c0 = g * QBLOCK
        # Per column: s * scale_2 * 2 (the table holds half of each E4M3 value, the codes twice
        # their E2M1 value: the product is the weight itself).
        var f = Array[Float32, QBLOCK](fill=0)
        comptime for i in range(QBLOCK):
            f[i] = s.unsafe_load((n0 + c0 + i) * s_step).cast[F32]() * scale_2
        var b0 = k0 // QBLOCK
        for b in range(K // QBLOCK):
            var rows = Array[SIMD[F32, QBLOCK], QBLOCK](fill=0)
            comptime for i in range(QBLOCK):
                var n = n0 + c0 + i
                var step = table.unsafe_load(Int(scale.unsafe_load(n * ss + b0 + b))) * f[i]
                rows[i] = e2m1_x2_block(w.unsafe_offset(n * ws), b0 + b) * step
            store_transposed[F32](rows^, panel, PW, b * QBLOCK * PW + c0)
    fill_correction[sdt](u, us, r, K, n0, panel)


def _fill_panel_tiled[
    sdt: DType
](
    w: Ptr[U8],
    ws: Int,
    scale: Ptr[U8],
    ss: Int,
    scale_2: Float32,
    s: Ptr[sdt],
    s_step: Int,
    u: Ptr[sdt],
    us: Int,
    r: Int,
    K: Int,
    n0: Int,
    panel: Ptr[F32],
    k0: Int,
):
    """`_fill_panel` from the tiled layout (`tile_nvfp4`): each word of a tile holds one input's
    codes of its 16 rows, so a decoded word is 8 rows of the panel as they are stored, with
    no transpose."""
    comptime assert PW % LANES == 0, "a panel holds whole tiles"
    for g in range(PW // LANES):
        var n = n0 + g * LANES
        var wt = w.unsafe_offset(n * ws)
        var st = scale.unsafe_offset(n * ss)
        var f = SIMD[F32, LANES](0)
        comptime for i in range(LANES):
            f[i] = s.unsafe_load((n + i) * s_step).cast[F32]() * scale_2
        var b0 = k0 // QBLOCK
        for b in range(K // QBLOCK):
            var step = e4m3[LANES](st.unsafe_load[width=LANES]((b0 + b) * LANES).cast[U32]()) * f
            comptime for half in range(2):
                var words = bitcast[U32, LANES](
                    wt.unsafe_load[width=64](((b0 + b) * 2 + half) * 64)
                )
                comptime for i in range(8):
                    panel.unsafe_store[width=LANES](
                        (b * QBLOCK + half * 8 + i) * PW + g * LANES,
                        lookup_e2m1(words >> UInt32(4 * i)) * step,
                    )
    fill_correction[sdt](u, us, r, K, n0, panel)


def nvfp4_linear_cpu[
    xdt: DType, sdt: DType, odt: DType, tiled: Bool = False, a8: Bool = False
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
    v: Ptr[sdt],
    vs: Int,
    r: Int,
    N: Int,
    dst: Ptr[odt],
    os: Int,
):
    """`dst = s * (x @ W^T) + (x @ V) @ U^T`, `W` the NVFP4 weight; `K` a multiple of 16.

    Below NVFP4_PANEL_FROM_ROWS rows, work items of N_BLOCK x M_BLOCK outputs decoded in
    registers; from there on, one work item per panel of PW columns over every row (the
    columns past the last whole panel as below). `tiled`: `w` and `scale` in the layout of
    `tile_nvfp4`; every whole tile of 16 rows then runs on the lane tiles (below the panel
    rows, and past the last whole panel), the rows past the last tile as row-major.
    `a8` (tiled only): at any row count the whole tiles take x rounded to int8 per group of 64
    inputs (_nvfp4_a8.mojo, no panels); the row-major rows past them take float x.
    """
    comptime assert tiled or not a8, "int8 activations read the tiled layout"
    if M == 0 or N == 0:
        return
    # The E4M3 table serves the row-major layout and the rows past the last whole tile only.
    var table_buf = e4m3_half_table() if not tiled or N % LANES != 0 else List[Float32]()
    var table = table_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var t_buf = List[Float32](length=max(M * r, 1), fill=0)
    var t = t_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    project_cpu[xdt, sdt](x, xs, M, K, v, vs, r, t, r)

    # Tiled: the rows of whole tiles; the last N % 16 are row-major.
    var n_tiles = (N // LANES) * LANES if tiled else N
    # int8 activations take every whole tile at any row count: no float panels then.
    var panels = n_tiles // PW if M >= NVFP4_PANEL_FROM_ROWS and not a8 else 0
    var n_tail = panels * PW

    def panel_item(i: Int) {var}:
        var n0 = i * PW
        if K <= KC:
            var buf = List[Float32](unsafe_uninit_length=(K + r) * PW)
            var panel = buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
            comptime if tiled:
                _fill_panel_tiled[sdt](
                    w, ws, scale, ss, scale_2, s, s_step, u, us, r, K, n0, panel, 0
                )
            else:
                _fill_panel[sdt](
                    w, ws, scale, ss, table, scale_2, s, s_step, u, us, r, K, n0, panel, 0
                )
            panel_rows[xdt, odt, STORE, 0](x, xs, t, r, panel, K, dst, os, M, n0)
            _ = buf^
            return
        # A long K: KC inputs at a time, the correction with the last block, the sums in a
        # float32 [M, PW] scratch (the output may be bfloat16), then written out.
        var buf = List[Float32](unsafe_uninit_length=(KC + r) * PW)
        var panel = buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
        var sums_buf = List[Float32](unsafe_uninit_length=M * PW)
        var sums = sums_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
        for k0 in range(0, K, KC):
            var kk = min(KC, K - k0)
            var rr = r if k0 + kk == K else 0
            var xk = x.unsafe_offset(k0)
            comptime if tiled:
                _fill_panel_tiled[sdt](
                    w, ws, scale, ss, scale_2, s, s_step, u, us, rr, kk, n0, panel, k0
                )
            else:
                _fill_panel[sdt](
                    w, ws, scale, ss, table, scale_2, s, s_step, u, us, rr, kk, n0, panel, k0
                )
            if k0 == 0:
                panel_rows[xdt, F32, STORE, 0](xk, xs, t, rr, panel, kk, sums, PW, M, 0)
            else:
                panel_rows[xdt, F32, ADD, 0](xk, xs, t, rr, panel, kk, sums, PW, M, 0)
        for m in range(M):
            comptime for c in range(NV):
                dst.unsafe_store[width=PSW](
                    m * os + n0 + c * PSW,
                    sums.unsafe_load[width=PSW](m * PW + c * PSW).cast[odt](),
                )
        _ = buf^
        _ = sums_buf^

    if panels > 0:
        parallelize(panel_item, panels)

    comptime if a8:
        if n_tiles - n_tail >= LANES:
            nvfp4_a8_linear[xdt, sdt, odt](
                x, xs, M, K, w, ws, scale, ss, scale_2, s, s_step, u, us, t, r, dst, os,
                n_tail, n_tiles,
            )
            n_tail = n_tiles

    comptime if NVFP4_LANES or tiled:
        if (tiled or M < LANES_BELOW_ROWS) and n_tiles - n_tail >= LANES:
            # A decode step on AVX-512: sixteen weight rows in the lanes (_nvfp4_lanes.mojo);
            # tiled, every whole tile the panels left.
            var n_lanes = n_tail
            var groups = (n_tiles - n_tail) // LANES

            def lanes_item(i: Int) {var}:
                nvfp4_lanes_rows[xdt, sdt, odt, tiled](
                    x,
                    xs,
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
                    0,
                    M,
                    n_lanes + i * LANES_GROUPS * LANES,
                    n_lanes + min(groups, (i + 1) * LANES_GROUPS) * LANES,
                )

            parallelize(lanes_item, ceildiv(groups, LANES_GROUPS))
            n_tail += groups * LANES

    if n_tail < N:
        var m_blocks = ceildiv(M, M_BLOCK)
        var n_blocks = ceildiv(N - n_tail, N_BLOCK)

        def item(i: Int) {var}:
            var bn = i // m_blocks
            var bm = i % m_blocks
            _nvfp4_block[xdt, sdt, odt](
                x,
                xs,
                w,
                ws,
                scale,
                ss,
                table,
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
                bm * M_BLOCK,
                min(M, (bm + 1) * M_BLOCK),
                n_tail + bn * N_BLOCK,
                min(N, n_tail + (bn + 1) * N_BLOCK),
            )

        parallelize(item, n_blocks * m_blocks)
    _ = t_buf^
    _ = table_buf^
