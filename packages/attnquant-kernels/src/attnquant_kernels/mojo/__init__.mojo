# attnquant kernels: a Mojo package that MAX compiles from source.
# generated_linear.mojo and generated_mlp.mojo register the custom ops; _cpu.mojo and
# _gpu.mojo hold the implementations, _common.mojo what they share.
