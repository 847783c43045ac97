# attnquant kernels: a Mojo package that MAX compiles from source.
# generated_*.mojo and nvfp4_dequantize.mojo register the custom ops; _cpu.mojo and
# _gpu.mojo hold the implementations, _common.mojo what they share.
