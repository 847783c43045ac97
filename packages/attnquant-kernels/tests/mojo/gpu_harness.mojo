# Instantiates every GPU variant of the kernels (float32 and bfloat16, SiLU and tanh-GELU,
# the NVFP4 linear, the low-rank projection)
# so `mojo build --target-accelerator <gpu> --emit asm` compiles them on a machine without a
# GPU. test_gpu_build.py copies the kernel package next to this file as `aqk`; nothing runs.

from max.gpu.host import DeviceContext

from aqk._common import ACT_GELU_TANH, ACT_SILU
from aqk._gpu import lowrank_linear_gpu, theta_linear_gpu, theta_mlp_gpu
from aqk._nvfp4 import nvfp4_linear_gpu


def instantiate[dt: DType](ctx: DeviceContext) raises:
    var buf = ctx.enqueue_create_buffer[dt](64)
    var p = buf.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    theta_linear_gpu[dt, dt, dt](
        ctx, p, 4, 1, 4, p, 4, p, p, 1, p, 1, 1, 4, p, 4
    )
    lowrank_linear_gpu[dt, dt, dt](ctx, p, 4, 1, 4, p, 1, p, 1, 1, 4, p, 4)
    theta_mlp_gpu[dt, dt, dt, ACT_SILU](
        ctx,
        p,
        4,
        1,
        4,
        4,
        p,
        4,
        p,
        p,
        1,
        p,
        1,
        1,
        p,
        4,
        p,
        p,
        1,
        p,
        1,
        1,
        p,
        4,
        p,
        p,
        1,
        p,
        1,
        1,
        p,
        4,
    )
    theta_mlp_gpu[dt, dt, dt, ACT_GELU_TANH](
        ctx,
        p,
        4,
        1,
        4,
        4,
        p,
        4,
        p,
        p,
        1,
        p,
        1,
        1,
        p,
        4,
        p,
        p,
        1,
        p,
        1,
        1,
        p,
        4,
        p,
        p,
        1,
        p,
        1,
        1,
        p,
        4,
    )
    var packed = ctx.enqueue_create_buffer[DType.uint8](64)
    var scale_2 = ctx.enqueue_create_buffer[DType.float32](1)
    var q = packed.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    var g = scale_2.unsafe_ptr().unsafe_origin_cast[MutAnyOrigin]()
    nvfp4_linear_gpu[dt, dt, dt](
        ctx, p, 16, 1, 16, q, 8, q, 1, g, p, 1, p, 1, p, 1, 1, 4, p, 4
    )
    ctx.synchronize()
    _ = buf^
    _ = packed^
    _ = scale_2^


def main() raises:
    var ctx = DeviceContext()
    instantiate[DType.float32](ctx)
    instantiate[DType.bfloat16](ctx)
