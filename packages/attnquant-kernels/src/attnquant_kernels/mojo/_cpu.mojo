# attnquant kernels: the CPU implementation.
#
# Two steps per projection, never forming the [out, in] weight:
#   1. t = x @ V            ([M, r] float32: _project.mojo, tiles of rows in parallel)
#   2. y[m, n] = s[n] * <W0[n, :], x[m, :]> + <U[n, :], t[m, :]>
#      register-tiled: a tile of MR input rows x NR weight rows shares every
#      SIMD load of W0 and x along K; tiles of N_BLOCK weight rows x M_BLOCK
#      input rows are the parallel work items, split across cores.
# Everything accumulates in float32; inputs of any float dtype are widened on load.

from std.collections import Array
from std.math import ceildiv, fma
from std.sys import simd_width_of

from max.algorithm import parallelize

from ._common import F32, GATE_MUL, STORE, Ptr, activate
from ._panel import PANEL_FROM_ROWS, PW, fill_panel, panel_rows
from ._project import project_cpu

# SIMD lanes of float32 on this CPU (8 on AVX2, 16 on AVX-512).
comptime SW = simd_width_of[F32]()
# Register tile: MR input rows x NR weight rows (MR * NR vector accumulators).
comptime MR = 4
comptime NR = 2
# Decode tile (fewer than MR input rows left): 1 input row x NR1 weight rows.
comptime NR1 = 4
# Parallel work item: N_BLOCK weight rows x M_BLOCK input rows.
comptime N_BLOCK = 16
comptime M_BLOCK = 64


@always_inline
def _dot_tile[
    xdt: DType, wdt: DType, mr: Int, nr: Int
](x: Ptr[xdt], xs: Int, w: Ptr[wdt], ws: Int, K: Int) -> Array[
    Float32, mr * nr
]:
    """`res[j * nr + i] = <x[j, :K], w[i, :K]>` for mr rows of x and nr rows of w.
    """
    var acc = Array[SIMD[F32, SW], mr * nr](fill=0)
    var k = 0
    while k + SW <= K:
        var wv = Array[SIMD[F32, SW], nr](fill=0)
        comptime for i in range(nr):
            wv[i] = w.unsafe_load[width=SW](i * ws + k).cast[F32]()
        comptime for j in range(mr):
            var xv = x.unsafe_load[width=SW](j * xs + k).cast[F32]()
            comptime for i in range(nr):
                acc[j * nr + i] = fma(xv, wv[i], acc[j * nr + i])
        k += SW
    var res = Array[Float32, mr * nr](fill=0)
    comptime for q in range(mr * nr):
        res[q] = acc[q].reduce_add()
    while k < K:
        comptime for j in range(mr):
            var xk = x.unsafe_load(j * xs + k).cast[F32]()
            comptime for i in range(nr):
                res[j * nr + i] = fma(
                    xk, w.unsafe_load(i * ws + k).cast[F32](), res[j * nr + i]
                )
        k += 1
    return res^


@always_inline
def _dot_rank[wdt: DType](u: Ptr[wdt], t: Ptr[F32], r: Int) -> Float32:
    """`<u[:r], t[:r]>` in float32 (the rank-r correction of one output)."""
    var acc = SIMD[F32, SW](0)
    var j = 0
    while j + SW <= r:
        acc = fma(
            u.unsafe_load[width=SW](j).cast[F32](),
            t.unsafe_load[width=SW](j),
            acc,
        )
        j += SW
    var res = acc.reduce_add()
    while j < r:
        res = fma(u.unsafe_load(j).cast[F32](), t.unsafe_load(j), res)
        j += 1
    return res


@always_inline
def _theta_tile[
    xdt: DType,
    wdt: DType,
    odt: DType,
    combine: Int,
    act: Int,
    mr: Int,
    nr: Int,
](
    x: Ptr[xdt],
    xs: Int,
    w0: Ptr[wdt],
    w0s: Int,
    s: Ptr[wdt],
    u: Ptr[wdt],
    us: Int,
    t: Ptr[F32],
    ts: Int,
    r: Int,
    dst: Ptr[odt],
    os: Int,
    K: Int,
    m: Int,
    n: Int,
):
    """Outputs [m, m + mr) x [n, n + nr): scaled shared-block dot plus correction.
    """
    var d = _dot_tile[xdt, wdt, mr, nr](
        x.unsafe_offset(m * xs), xs, w0.unsafe_offset(n * w0s), w0s, K
    )
    comptime for j in range(mr):
        comptime for i in range(nr):
            var value = s.unsafe_load(n + i).cast[F32]() * d[j * nr + i]
            if r > 0:
                value += _dot_rank[wdt](
                    u.unsafe_offset((n + i) * us),
                    t.unsafe_offset((m + j) * ts),
                    r,
                )
            var o = (m + j) * os + n + i
            comptime if combine == GATE_MUL:
                var gate = dst.unsafe_load(o).cast[F32]()
                dst.unsafe_store(o, (activate[act](gate) * value).cast[odt]())
            else:
                dst.unsafe_store(o, value.cast[odt]())


@always_inline
def theta_block[
    xdt: DType, wdt: DType, odt: DType, combine: Int, act: Int
](
    x: Ptr[xdt],
    xs: Int,
    w0: Ptr[wdt],
    w0s: Int,
    s: Ptr[wdt],
    u: Ptr[wdt],
    us: Int,
    t: Ptr[F32],
    ts: Int,
    r: Int,
    dst: Ptr[odt],
    os: Int,
    K: Int,
    m0: Int,
    m1: Int,
    n0: Int,
    n1: Int,
):
    """Outputs [m0, m1) x [n0, n1) of one projection, on the calling thread."""
    var m_main = m0 + ((m1 - m0) // MR) * MR
    if m_main > m0:
        var n = n0
        while n < n1:
            if n + NR <= n1:
                var m = m0
                while m < m_main:
                    _theta_tile[xdt, wdt, odt, combine, act, MR, NR](
                        x, xs, w0, w0s, s, u, us, t, ts, r, dst, os, K, m, n
                    )
                    m += MR
                n += NR
            else:
                var m = m0
                while m < m_main:
                    _theta_tile[xdt, wdt, odt, combine, act, MR, 1](
                        x, xs, w0, w0s, s, u, us, t, ts, r, dst, os, K, m, n
                    )
                    m += MR
                n += 1
    if m_main < m1:
        var n = n0
        while n < n1:
            if n + NR1 <= n1:
                for m in range(m_main, m1):
                    _theta_tile[xdt, wdt, odt, combine, act, 1, NR1](
                        x, xs, w0, w0s, s, u, us, t, ts, r, dst, os, K, m, n
                    )
                n += NR1
            else:
                for m in range(m_main, m1):
                    _theta_tile[xdt, wdt, odt, combine, act, 1, 1](
                        x, xs, w0, w0s, s, u, us, t, ts, r, dst, os, K, m, n
                    )
                n += 1


def theta_panels[
    xdt: DType, wdt: DType, odt: DType, combine: Int, act: Int
](
    x: Ptr[xdt],
    xs: Int,
    M: Int,
    K: Int,
    w0: Ptr[wdt],
    w0s: Int,
    s: Ptr[wdt],
    u: Ptr[wdt],
    us: Int,
    t: Ptr[F32],
    r: Int,
    N: Int,
    dst: Ptr[odt],
    os: Int,
) -> Int:
    """From PANEL_FROM_ROWS rows on, `theta_block`'s outputs for the columns of every whole
    panel (_panel.mojo: one work item per PW columns, the block and U written into a scratch
    once); returns the first column left to the dot-product tiles (0 below PANEL_FROM_ROWS)."""
    if M < PANEL_FROM_ROWS:
        return 0
    var panels = N // PW

    def item(i: Int) {var}:
        var buf = List[Float32](unsafe_uninit_length=(K + r) * PW)
        var panel = buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
        fill_panel[wdt](w0, w0s, s, u, us, r, K, i * PW, panel)
        panel_rows[xdt, odt, combine, act](x, xs, t, r, panel, K, dst, os, M, i * PW)
        _ = buf^

    if panels > 0:
        parallelize(item, panels)
    return panels * PW


def theta_linear_cpu[
    xdt: DType, wdt: DType, odt: DType
](
    x: Ptr[xdt],
    xs: Int,
    M: Int,
    K: Int,
    w0: Ptr[wdt],
    w0s: Int,
    s: Ptr[wdt],
    u: Ptr[wdt],
    us: Int,
    v: Ptr[wdt],
    vs: Int,
    r: Int,
    N: Int,
    dst: Ptr[odt],
    os: Int,
):
    """`dst = s * (x @ W0^T) + (x @ V) @ U^T` for one projection: panels from PANEL_FROM_ROWS
    rows on, the dot-product tiles for the columns past the last whole panel (or every column
    below)."""
    if M == 0 or N == 0:
        return
    var t_buf = List[Float32](length=max(M * r, 1), fill=0)
    var t = t_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    project_cpu[xdt, wdt](x, xs, M, K, v, vs, r, t, r)
    var n_tail = theta_panels[xdt, wdt, odt, STORE, 0](
        x, xs, M, K, w0, w0s, s, u, us, t, r, N, dst, os
    )

    var m_blocks = ceildiv(M, M_BLOCK)
    var n_blocks = ceildiv(N - n_tail, N_BLOCK)

    def item(i: Int) {var}:
        var bn = i // m_blocks
        var bm = i % m_blocks
        theta_block[xdt, wdt, odt, STORE, 0](
            x,
            xs,
            w0,
            w0s,
            s,
            u,
            us,
            t,
            r,
            r,
            dst,
            os,
            K,
            bm * M_BLOCK,
            min(M, (bm + 1) * M_BLOCK),
            n_tail + bn * N_BLOCK,
            min(N, n_tail + (bn + 1) * N_BLOCK),
        )

    if n_tail < N:
        parallelize(item, n_blocks * m_blocks)
    _ = t_buf^


def lowrank_linear_cpu[
    xdt: DType, wdt: DType, odt: DType
](
    x: Ptr[xdt],
    xs: Int,
    M: Int,
    K: Int,
    u: Ptr[wdt],
    us: Int,
    v: Ptr[wdt],
    vs: Int,
    r: Int,
    N: Int,
    dst: Ptr[odt],
    os: Int,
):
    """`dst = (x @ V) @ U^T`, any rank `r`: `t = x @ V` (project_cpu), then `t @ U^T` as a
    projection whose block is `U` and whose inputs are `t` (panels from PANEL_FROM_ROWS rows
    on, the dot-product tiles below), with a unit scale and no correction."""
    if M == 0 or N == 0:
        return
    var t_buf = List[Float32](length=max(M * r, 1), fill=0)
    var t = t_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    project_cpu[xdt, wdt](x, xs, M, K, v, vs, r, t, r)
    var ones_buf = List[Scalar[wdt]](length=N, fill=1)
    var ones = ones_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    theta_linear_cpu[F32, wdt, odt](
        t, r, M, r, u, us, ones, u, us, v, vs, 0, N, dst, os
    )
    _ = t_buf^
    _ = ones_buf^


def theta_mlp_cpu[
    xdt: DType, wdt: DType, odt: DType, act: Int
](
    x: Ptr[xdt],
    xs: Int,
    M: Int,
    H: Int,
    F: Int,
    w0_g: Ptr[wdt],
    w0_gs: Int,
    s_g: Ptr[wdt],
    u_g: Ptr[wdt],
    u_gs: Int,
    v_g: Ptr[wdt],
    v_gs: Int,
    r_g: Int,
    w0_u: Ptr[wdt],
    w0_us: Int,
    s_u: Ptr[wdt],
    u_u: Ptr[wdt],
    u_us: Int,
    v_u: Ptr[wdt],
    v_us: Int,
    r_u: Int,
    w0_d: Ptr[wdt],
    w0_ds: Int,
    s_d: Ptr[wdt],
    u_d: Ptr[wdt],
    u_ds: Int,
    v_d: Ptr[wdt],
    v_ds: Int,
    r_d: Int,
    dst: Ptr[odt],
    os: Int,
):
    """`dst = down(act(gate(x)) * up(x))`, the [M, F] intermediate in float32 scratch.
    """
    if M == 0 or H == 0:
        return
    var h_buf = List[Float32](length=max(M * F, 1), fill=0)
    var t_g_buf = List[Float32](length=max(M * r_g, 1), fill=0)
    var t_u_buf = List[Float32](length=max(M * r_u, 1), fill=0)
    var t_d_buf = List[Float32](length=max(M * r_d, 1), fill=0)
    var h = h_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var t_g = t_g_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var t_u = t_u_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var t_d = t_d_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()

    project_cpu[xdt, wdt](x, xs, M, H, v_g, v_gs, r_g, t_g, r_g)
    project_cpu[xdt, wdt](x, xs, M, H, v_u, v_us, r_u, t_u, r_u)

    # Panels (from PANEL_FROM_ROWS rows on): gate into h, then up times act(h) in a second
    # pass; the columns left as below.
    var f_tail = theta_panels[xdt, wdt, F32, STORE, 0](
        x, xs, M, H, w0_g, w0_gs, s_g, u_g, u_gs, t_g, r_g, F, h, F
    )
    _ = theta_panels[xdt, wdt, F32, GATE_MUL, act](
        x, xs, M, H, w0_u, w0_us, s_u, u_u, u_us, t_u, r_u, F, h, F
    )
    var m_blocks = ceildiv(M, M_BLOCK)
    # gate then up over the same block of F: h = act(gate) * up, block-local.
    var f_blocks = ceildiv(F - f_tail, N_BLOCK)

    def gate_up(i: Int) {var}:
        var bn = i // m_blocks
        var bm = i % m_blocks
        var m0 = bm * M_BLOCK
        var m1 = min(M, (bm + 1) * M_BLOCK)
        var n0 = f_tail + bn * N_BLOCK
        var n1 = min(F, f_tail + (bn + 1) * N_BLOCK)
        theta_block[xdt, wdt, F32, STORE, 0](
            x,
            xs,
            w0_g,
            w0_gs,
            s_g,
            u_g,
            u_gs,
            t_g,
            r_g,
            r_g,
            h,
            F,
            H,
            m0,
            m1,
            n0,
            n1,
        )
        theta_block[xdt, wdt, F32, GATE_MUL, act](
            x,
            xs,
            w0_u,
            w0_us,
            s_u,
            u_u,
            u_us,
            t_u,
            r_u,
            r_u,
            h,
            F,
            H,
            m0,
            m1,
            n0,
            n1,
        )

    if f_tail < F:
        parallelize(gate_up, f_blocks * m_blocks)

    project_cpu[F32, wdt](h, F, M, F, v_d, v_ds, r_d, t_d, r_d)
    var h_tail = theta_panels[F32, wdt, odt, STORE, 0](
        h, F, M, F, w0_d, w0_ds, s_d, u_d, u_ds, t_d, r_d, H, dst, os
    )
    var h_blocks = ceildiv(H - h_tail, N_BLOCK)

    def down(i: Int) {var}:
        var bn = i // m_blocks
        var bm = i % m_blocks
        theta_block[F32, wdt, odt, STORE, 0](
            h,
            F,
            w0_d,
            w0_ds,
            s_d,
            u_d,
            u_ds,
            t_d,
            r_d,
            r_d,
            dst,
            os,
            F,
            bm * M_BLOCK,
            min(M, (bm + 1) * M_BLOCK),
            h_tail + bn * N_BLOCK,
            min(H, h_tail + (bn + 1) * N_BLOCK),
        )

    if h_tail < H:
        parallelize(down, h_blocks * m_blocks)
    _ = h_buf^
    _ = t_g_buf^
    _ = t_u_buf^
    _ = t_d_buf^
