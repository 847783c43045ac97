# attnquant kernels: the GPU implementation (NVIDIA, AMD, Apple Metal).
#
# Instantiated only when a graph places the op on a GPU (the ops check
# `is_gpu[target]()` at compile time), so a CPU-only build never compiles it.
# A straightforward, correct formulation, not a tuned one:
#   1. one thread per (m, j):  t[m, j] = <x[m, :], V[:, j]>            (float32)
#   2. one thread per (m, n):  y[m, n] = s[n] <W0[n, :], x[m, :]> + <U[n, :], t[m, :]>
# Neither kernel forms the [out, in] weight; all sums are float32.

from std.math import ceildiv

from max.gpu import global_idx
from max.gpu.host import DeviceContext

from ._common import F32, GATE_MUL, STORE, Ptr, activate

comptime BLOCK = 256


def _project_kernel[
    xdt: DType, wdt: DType
](
    x: Ptr[xdt],
    xs: Int64,
    M: Int64,
    K: Int64,
    v: Ptr[wdt],
    vs: Int64,
    r: Int64,
    t: Ptr[F32],
    ts: Int64,
):
    # Sizes arrive as Int64: Int is not DevicePassable.
    var i = Int64(global_idx.x)
    if i >= M * r:
        return
    var m = i // r
    var j = i % r
    var acc = Float32(0)
    for k in range(K):
        acc += (
            x.unsafe_load(Int(m * xs + k)).cast[F32]()
            * v.unsafe_load(Int(k * vs + j)).cast[F32]()
        )
    t.unsafe_store(Int(m * ts + j), acc)


def _theta_kernel[
    xdt: DType, wdt: DType, odt: DType, combine: Int, act: Int
](
    x: Ptr[xdt],
    xs: Int64,
    w0: Ptr[wdt],
    w0s: Int64,
    s: Ptr[wdt],
    u: Ptr[wdt],
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
    for k in range(K):
        acc += (
            x.unsafe_load(Int(m * xs + k)).cast[F32]()
            * w0.unsafe_load(Int(n * w0s + k)).cast[F32]()
        )
    var value = s.unsafe_load(Int(n)).cast[F32]() * acc
    for j in range(r):
        value += u.unsafe_load(Int(n * us + j)).cast[F32]() * t.unsafe_load(
            Int(m * ts + j)
        )
    var o = Int(m * os + n)
    comptime if combine == GATE_MUL:
        var gate = dst.unsafe_load(o).cast[F32]()
        dst.unsafe_store(o, (activate[act](gate) * value).cast[odt]())
    else:
        dst.unsafe_store(o, value.cast[odt]())


def _project_gpu[
    xdt: DType, wdt: DType
](
    ctx: DeviceContext,
    x: Ptr[xdt],
    xs: Int,
    M: Int,
    K: Int,
    v: Ptr[wdt],
    vs: Int,
    r: Int,
    t: Ptr[F32],
) raises:
    if M * r == 0:
        return
    ctx.enqueue_function[_project_kernel[xdt, wdt]](
        x,
        Int64(xs),
        Int64(M),
        Int64(K),
        v,
        Int64(vs),
        Int64(r),
        t,
        Int64(r),
        grid_dim=ceildiv(M * r, BLOCK),
        block_dim=BLOCK,
    )


def _theta_gpu[
    xdt: DType, wdt: DType, odt: DType, combine: Int, act: Int
](
    ctx: DeviceContext,
    x: Ptr[xdt],
    xs: Int,
    w0: Ptr[wdt],
    w0s: Int,
    s: Ptr[wdt],
    u: Ptr[wdt],
    us: Int,
    t: Ptr[F32],
    r: Int,
    dst: Ptr[odt],
    os: Int,
    M: Int,
    N: Int,
    K: Int,
) raises:
    if M * N == 0:
        return
    ctx.enqueue_function[_theta_kernel[xdt, wdt, odt, combine, act]](
        x,
        Int64(xs),
        w0,
        Int64(w0s),
        s,
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


def theta_linear_gpu[
    xdt: DType, wdt: DType, odt: DType
](
    ctx: DeviceContext,
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
) raises:
    """`dst = s * (x @ W0^T) + (x @ V) @ U^T` on the GPU of `ctx`."""
    var t_buf = ctx.enqueue_create_buffer[F32](max(M * r, 1))
    var t = t_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    _project_gpu[xdt, wdt](ctx, x, xs, M, K, v, vs, r, t)
    _theta_gpu[xdt, wdt, odt, STORE, 0](
        ctx, x, xs, w0, w0s, s, u, us, t, r, dst, os, M, N, K
    )
    _ = t_buf^


def _lowrank_kernel[
    wdt: DType, odt: DType
](
    t: Ptr[F32],
    r: Int64,
    u: Ptr[wdt],
    us: Int64,
    dst: Ptr[odt],
    os: Int64,
    M: Int64,
    N: Int64,
):
    var i = Int64(global_idx.x)
    if i >= M * N:
        return
    var m = i // N
    var n = i % N
    var acc = Float32(0)
    for j in range(r):
        acc += u.unsafe_load(Int(n * us + j)).cast[F32]() * t.unsafe_load(
            Int(m * r + j)
        )
    dst.unsafe_store(Int(m * os + n), acc.cast[odt]())


def lowrank_linear_gpu[
    xdt: DType, wdt: DType, odt: DType
](
    ctx: DeviceContext,
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
) raises:
    """`dst = (x @ V) @ U^T` on the GPU of `ctx`: one thread per (m, j) of `t = x @ V`, then
    one per output."""
    if M * N == 0:
        return
    var t_buf = ctx.enqueue_create_buffer[F32](max(M * r, 1))
    var t = t_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    _project_gpu[xdt, wdt](ctx, x, xs, M, K, v, vs, r, t)
    ctx.enqueue_function[_lowrank_kernel[wdt, odt]](
        t,
        Int64(r),
        u,
        Int64(us),
        dst,
        Int64(os),
        Int64(M),
        Int64(N),
        grid_dim=ceildiv(M * N, BLOCK),
        block_dim=BLOCK,
    )
    _ = t_buf^


def theta_mlp_gpu[
    xdt: DType, wdt: DType, odt: DType, act: Int
](
    ctx: DeviceContext,
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
) raises:
    """`dst = down(act(gate(x)) * up(x))` on the GPU, the intermediate in float32.
    """
    var h_buf = ctx.enqueue_create_buffer[F32](max(M * F, 1))
    var t_g_buf = ctx.enqueue_create_buffer[F32](max(M * r_g, 1))
    var t_u_buf = ctx.enqueue_create_buffer[F32](max(M * r_u, 1))
    var t_d_buf = ctx.enqueue_create_buffer[F32](max(M * r_d, 1))
    var h = h_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var t_g = t_g_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var t_u = t_u_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var t_d = t_d_buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    _project_gpu[xdt, wdt](ctx, x, xs, M, H, v_g, v_gs, r_g, t_g)
    _project_gpu[xdt, wdt](ctx, x, xs, M, H, v_u, v_us, r_u, t_u)
    _theta_gpu[xdt, wdt, F32, STORE, 0](
        ctx, x, xs, w0_g, w0_gs, s_g, u_g, u_gs, t_g, r_g, h, F, M, F, H
    )
    _theta_gpu[xdt, wdt, F32, GATE_MUL, act](
        ctx, x, xs, w0_u, w0_us, s_u, u_u, u_us, t_u, r_u, h, F, M, F, H
    )
    _project_gpu[F32, wdt](ctx, h, F, M, F, v_d, v_ds, r_d, t_d)
    _theta_gpu[F32, wdt, odt, STORE, 0](
        ctx, h, F, w0_d, w0_ds, s_d, u_d, u_ds, t_d, r_d, dst, os, M, H, F
    )
    _ = h_buf^
    _ = t_g_buf^
    _ = t_u_buf^
    _ = t_d_buf^
