# attnquant kernels: what the CPU and GPU implementations share.
#
# The one formula of the project, per output element:
#     y[m, n] = s[n] * <W0[n, :], x[m, :]> + <U[n, :], t[m, :]>,   t = x @ V
# accumulated in float32 whatever the input dtype.

from std.math import exp, tanh

from extensibility import InputTensor

# Largest correction rank the custom ops accept; above it the GEMM formulation
# (ATTNQUANT_GEMM=1) is the in-graph path. Mirrored by attnquant_kernels.MAX_RANK.
comptime MAX_RANK = 64

# Element-wise activations of generated_mlp, chosen at compile time.
comptime ACT_NONE = 0
comptime ACT_SILU = 1
comptime ACT_GELU_TANH = 2

# How a tile of results reaches the output.
comptime STORE = 0  # out[m, n] = value
comptime GATE_MUL = 1  # out[m, n] = act(out[m, n]) * value (out holds the gate)
comptime ADD = 2  # out[m, n] += value (a later block of the inputs)

comptime F32 = DType.float32

# A raw pointer to the elements of a tensor of dtype `dt`.
comptime Ptr[dt: DType] = Pointer[Scalar[dt], MutAnyOrigin]


def activation_code[name: StaticString]() -> Int:
    """The ACT_* code of an activation named in the graph ("silu", "gelu_tanh").
    """
    comptime assert (
        name == "silu" or name == "gelu_tanh"
    ), "generated_mlp: activation must be 'silu' or 'gelu_tanh'"
    comptime if name == "silu":
        return ACT_SILU
    else:
        return ACT_GELU_TANH


@always_inline
def activate[act: Int](g: Float32) -> Float32:
    """SiLU, tanh-approximated GELU, or the identity, in float32."""
    comptime if act == ACT_SILU:
        return g / (1.0 + exp(-g))
    elif act == ACT_GELU_TANH:
        # sqrt(2 / pi) = 0.7978845608028654
        var inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return 0.5 * g * (1.0 + tanh(inner))
    else:
        return g


def check_rank(op: StaticString, what: StaticString, r: Int) raises:
    """Refuse a correction rank above MAX_RANK, naming the GEMM path."""
    if r > MAX_RANK:
        raise Error(
            op,
            ": ",
            what,
            " rank r=",
            r,
            " is above ",
            MAX_RANK,
            (
                ", the largest rank the custom op supports; use the GEMM"
                " formulation (ATTNQUANT_GEMM=1)"
            ),
        )


def check_dim(
    op: StaticString, name: StaticString, axis: Int, got: Int, want: Int
) raises:
    if got != want:
        raise Error(
            op,
            ": ",
            name,
            " has size ",
            got,
            " along axis ",
            axis,
            ", expected ",
            want,
        )


def row_stride(
    op: StaticString, name: StaticString, t: InputTensor[rank=2, ...]
) raises -> Int:
    """The row stride of a rank-2 input whose rows must be contiguous."""
    if t.dim_size(0) > 0 and t.dim_size(1) > 1 and t.stride_length(1) != 1:
        raise Error(
            op,
            ": ",
            name,
            " rows are not contiguous (inner stride ",
            t.stride_length(1),
            ")",
        )
    return t.stride_length(0)


def vector_stride(
    op: StaticString, name: StaticString, t: InputTensor[rank=1, ...]
) raises:
    if t.dim_size(0) > 1 and t.stride_length(0) != 1:
        raise Error(
            op,
            ": ",
            name,
            " is not contiguous (stride ",
            t.stride_length(0),
            ")",
        )
