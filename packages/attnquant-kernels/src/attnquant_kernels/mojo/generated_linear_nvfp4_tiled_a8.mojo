# generated_linear_nvfp4_tiled_a8: generated_linear_nvfp4_tiled that rounds x to int8 per group
# of 64 inputs and multiplies integers (_nvfp4_a8.mojo: AVX-512 VNNI where the CPU has it, the
# same integers lane by lane elsewhere), at every row count: decode steps, batches, prompts.
# The correction `(x V) U^T` and the outputs past the last whole tile take float x. Operands as
# generated_linear_nvfp4.mojo; the CPU only. Its result is the projection of the rounded x, not
# the float one (docs/decode-speed.md).

import extensibility as compiler
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext

from .generated_linear_nvfp4 import execute_nvfp4


@compiler.register("generated_linear_nvfp4_tiled_a8")
struct GeneratedLinearNVFP4TiledA8:
    """The tiled op with int8 activations at every row count (_nvfp4_a8.mojo)."""

    @staticmethod
    def execute[
        target: StaticString,
    ](
        y: OutputTensor[rank=2, ...],
        x: InputTensor[dtype=y.dtype, rank=2, ...],
        w: InputTensor[dtype=DType.uint8, rank=2, ...],
        scale: InputTensor[dtype=DType.uint8, rank=2, ...],
        scale_2: InputTensor[dtype=DType.float32, rank=1, ...],
        s: InputTensor[dtype=y.dtype, rank=1, ...],
        u: InputTensor[dtype=y.dtype, rank=2, ...],
        v: InputTensor[dtype=y.dtype, rank=2, ...],
        ctx: DeviceContext,
    ) raises:
        execute_nvfp4[target, True, True](y, x, w, scale, scale_2, s, u, v, ctx)
