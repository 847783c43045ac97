# generated_linear_nvfp4_tiled: generated_linear_nvfp4 on the CPU with `w` and `scale` in the
# tiled layout that `attnquant_kernels.layout.tile_nvfp4` writes at load: the same shapes and
# bytes, each tile of 16 weight rows stored transposed (_nvfp4_lanes.mojo), so a decode step
# reads one contiguous stream per tile. Operands and formula as generated_linear_nvfp4.mojo;
# the CPU only (a GPU reads Model Optimizer's row-major layout).

import extensibility as compiler
from extensibility import InputTensor, OutputTensor
from max.gpu.host import DeviceContext

from .generated_linear_nvfp4 import execute_nvfp4


@compiler.register("generated_linear_nvfp4_tiled")
struct GeneratedLinearNVFP4Tiled:
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
        execute_nvfp4[target, True](y, x, w, scale, scale_2, s, u, v, ctx)

