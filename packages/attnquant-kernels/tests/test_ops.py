"""generated_linear and generated_mlp on the CPU through MAX, against the numpy identity.

Two compiled graphs for the whole module (each a minute or two cold on two cores, seconds
once MAX has cached them): every dimension is symbolic (batch, in, out, ranks), so one
compile serves every shape and rank below. Each graph computes the float32 op, the rank-0
form of the wrapper (no U, V) where it applies, and the op on bfloat16 copies of its inputs.
The graphs, the float64 references and the checks are in :mod:`attnquant_kernels.testing`,
shared with the GPU variant of these checks (``tests/test_gpu.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnquant_kernels import MAX_RANK, RankError, kernels_path
from attnquant_kernels.testing import (
    OpModel,
    build_linear,
    build_mlp,
    check_linear,
    check_mlp,
    theta,
)

# Each op graph is one xdist group: under the noxfile's ``-n`` the two compile side by side.
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def linear() -> OpModel:
    """Outputs: the op (float32), the rank-0 wrapper form, the op on bfloat16 inputs."""
    return build_linear("cpu")


@pytest.fixture(scope="session")
def mlp() -> OpModel:
    """Outputs: SiLU (float32), tanh-GELU (float32), SiLU on bfloat16 inputs."""
    return build_mlp("cpu")


# ---------------------------------------------------------------- generated_linear


@pytest.mark.parametrize("rank", [0, 1, 7, 16, 63, 64])
@pytest.mark.parametrize("batch", [1, 3, 16, 64])
@pytest.mark.xdist_group("linear")
def test_linear_matches_the_identity_over_ranks_and_batches(linear: OpModel, rank: int, batch: int):
    check_linear(linear, batch, 96, 72, rank, seed=rank * 100 + batch)


@pytest.mark.parametrize(
    ("M", "K", "N", "R"),
    [
        (1, 1, 1, 0),  # smallest
        (1, 7, 3, 2),  # K below one SIMD vector
        (2, 9, 5, 9),  # rank above K is still the identity
        (5, 257, 33, 17),  # K and r with SIMD tails, N odd
        (4, 1024, 256, 64),  # a real projection width
        (64, 300, 130, 64),  # largest batch, several parallel blocks
        (1, 1024, 4096, 16),  # decode, MLP-sized output
        # From 32 rows on: panels of 64 (AVX-512) or 16 output columns written once, register
        # tiles of 6 rows; the columns past the last whole panel as above.
        (32, 32, 64, 0),  # one whole panel
        (70, 100, 130, 5),  # K with a tail of 4 past its 16 x 16 tiles, a 2-column tail
        (512, 256, 192, 16),  # a prefill
    ],
)
@pytest.mark.xdist_group("linear")
def test_linear_shapes(linear: OpModel, M: int, K: int, N: int, R: int):
    check_linear(linear, M, K, N, R)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    M=st.integers(1, 64),
    K=st.integers(1, 160),
    N=st.integers(1, 140),
    R=st.integers(0, MAX_RANK),
    seed=st.integers(0, 2**16),
)
@pytest.mark.xdist_group("linear")
def test_linear_random_shapes(linear: OpModel, M: int, K: int, N: int, R: int, seed: int):
    check_linear(linear, M, K, N, R, seed)


@pytest.mark.xdist_group("linear")
def test_linear_empty_batch(linear: OpModel):
    rng = np.random.default_rng(1)
    W0, s, U, V = theta(rng, 6, 8, 3)
    y, y0, yb = linear(np.zeros((0, 8), np.float32), W0, s, U, V)
    assert y.shape == y0.shape == yb.shape == (0, 6)


@pytest.mark.xdist_group("linear")
def test_linear_kernel_refuses_rank_65(linear: OpModel):
    """A symbolic rank reaches the kernel, which refuses it with the same advice."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 8)).astype(np.float32)
    W0, s, U, V = theta(rng, 4, 8, MAX_RANK + 1)
    with pytest.raises(Exception, match=r"r=65 is above 64.*ATTNQUANT_GEMM=1"):
        linear(x, W0, s, U, V)


# ---------------------------------------------------------------- generated_mlp


@pytest.mark.parametrize("rank", [0, 1, 7, 16, 63, 64])
@pytest.mark.parametrize("batch", [1, 16, 64])
@pytest.mark.xdist_group("mlp")
def test_mlp_matches_silu_and_gelu_references(mlp: OpModel, rank: int, batch: int):
    check_mlp(mlp, batch, 64, 160, (rank, rank, rank), seed=rank * 100 + batch)


@pytest.mark.parametrize(
    ("M", "H", "F", "ranks"),
    [
        (1, 1, 1, (0, 0, 0)),
        (3, 33, 70, (1, 7, 16)),  # a different rank per projection
        (5, 128, 512, (64, 0, 5)),
        (2, 256, 1024, (16, 16, 16)),
        (40, 96, 200, (3, 64, 0)),  # panels for gate/up and down, tails, a tile of 4 rows
        (512, 128, 256, (16, 16, 16)),  # a prefill
    ],
)
@pytest.mark.xdist_group("mlp")
def test_mlp_shapes(mlp: OpModel, M: int, H: int, F: int, ranks: tuple[int, int, int]):
    check_mlp(mlp, M, H, F, ranks)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    M=st.integers(1, 64),
    H=st.integers(1, 96),
    F=st.integers(1, 200),
    ranks=st.tuples(*[st.integers(0, MAX_RANK)] * 3),
    seed=st.integers(0, 2**16),
)
@pytest.mark.xdist_group("mlp")
def test_mlp_random_shapes(mlp: OpModel, M: int, H: int, F: int, ranks, seed: int):
    check_mlp(mlp, M, H, F, ranks, seed)


@pytest.mark.parametrize("which", [0, 1, 2])
@pytest.mark.xdist_group("mlp")
def test_mlp_kernel_refuses_rank_65(mlp: OpModel, which: int):
    rng = np.random.default_rng(3)
    ranks = [2, 2, 2]
    ranks[which] = MAX_RANK + 1
    x = rng.standard_normal((2, 8)).astype(np.float32)
    weights = theta(rng, 12, 8, ranks[0]) + theta(rng, 12, 8, ranks[1])
    weights += theta(rng, 8, 12, ranks[2])
    name = ("gate", "up", "down")[which]
    with pytest.raises(Exception, match=rf"{name} rank r=65 is above 64.*ATTNQUANT_GEMM=1"):
        mlp(x, *weights)


# ---------------------------------------------------------------- the Python wrapper


def _static_graph(build: Callable[..., Any], shapes: Sequence[Sequence[int]]) -> None:
    """Build (never compile) a graph with static input shapes around ``build``."""
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType

    types = [TensorType(DType.float32, list(s), device=DeviceRef.CPU()) for s in shapes]
    with Graph("aq_static", input_types=types) as g:
        g.output(build(*(v.tensor for v in g.inputs)))


def test_wrapper_refuses_rank_65_before_any_compile():
    from attnquant_kernels.graph import generated_linear

    shapes = [(2, 8), (4, 8), (4,), (4, MAX_RANK + 1), (8, MAX_RANK + 1)]
    with pytest.raises(RankError, match=r"generated_linear: rank r=65 .*ATTNQUANT_GEMM=1"):
        _static_graph(generated_linear, shapes)


def test_mlp_wrapper_names_the_projection_over_the_limit():
    from attnquant_kernels.graph import generated_mlp

    def build(x, *w):
        return generated_mlp(x, w[0:4], w[4:8], w[8:12])

    shapes = [(2, 8)]
    shapes += [(12, 8), (12,), (12, 4), (8, 4)] * 2
    shapes += [(8, 12), (8,), (8, 65), (12, 65)]
    with pytest.raises(RankError, match=r"generated_mlp: down rank r=65 .*ATTNQUANT_GEMM=1"):
        _static_graph(build, shapes)


def test_wrapper_rejects_mixed_dtypes_and_unknown_activations():
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType, ops

    from attnquant_kernels.graph import generated_linear, generated_mlp

    dev = DeviceRef.CPU()
    types = [TensorType(DType.float32, s, device=dev) for s in ([2, 8], [4, 8], [4])]
    with Graph("aq_bad", input_types=types) as g:
        x, W0, s = (v.tensor for v in g.inputs)
        with pytest.raises(TypeError, match="W0 is bfloat16"):
            generated_linear(x, ops.cast(W0, DType.bfloat16), s)
        with pytest.raises(ValueError, match="pass both U and V"):
            generated_linear(x, W0, s, U=ops.unsqueeze(s, 1))
        with pytest.raises(ValueError, match="activation 'relu' is not supported"):
            generated_mlp(
                x, (W0, s, None, None), (W0, s, None, None), (W0, s, None, None), activation="relu"
            )
        g.output(x)


def test_wrapper_takes_weights_in_a_graph_under_the_default_extensions_scope():
    """How a model's layers call it: Weights, a graph created in the kernels' scope."""
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType, Weight, default_custom_extensions_scope

    from attnquant_kernels.graph import generated_linear

    dev = DeviceRef.CPU()

    def build() -> Any:
        with Graph(
            "aq_weights", input_types=[TensorType(DType.float32, ["M", 8], device=dev)]
        ) as g:
            x = g.inputs[0].tensor
            W0 = Weight("W0", DType.float32, [4, 8], device=dev)
            s = Weight("s", DType.float32, [4], device=dev)
            U = Weight("U", DType.float32, [4, 2], device=dev)
            V = Weight("V", DType.float32, [8, 2], device=dev)
            y = generated_linear(x, W0, s, U, V)
            g.output(y)
        return y

    with pytest.raises(
        ValueError, match=r"has not loaded the attnquant kernels.*custom_extensions"
    ):
        build()
    with default_custom_extensions_scope(kernels_path()):
        y = build()
    assert [str(d) for d in y.shape] == ["M", "4"]
