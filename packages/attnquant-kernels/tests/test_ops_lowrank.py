"""generated_lowrank on the CPU through MAX, against the float64 ``(x V) U^T``.

One compiled graph for the module (every dimension symbolic): the float32 op and the op on
bfloat16 copies of its inputs. It runs ``t = x V`` (tiles of 6 rows x 64 columns of ``V``),
then ``t U^T`` on the dot-product tiles below 32 rows and on panels from there on, so the
shapes below cross both, with ranks past one slab of ``V`` and past the custom ops'
correction limit of 64, which does not bind here.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnquant_kernels.testing import OpModel, build_lowrank, check_lowrank, theta

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def lowrank() -> OpModel:
    return build_lowrank("cpu")


@pytest.mark.parametrize(
    ("M", "K", "N", "R"),
    [
        (1, 1, 1, 1),  # smallest
        (1, 7, 3, 2),  # K below one SIMD vector
        (3, 33, 70, 17),  # a rank with a tail past one vector
        (1, 1024, 1024, 256),  # decode, a budget-0.5 rank of a square projection
        (1, 1024, 4096, 409),  # decode, several slabs of V and a tail of 25
        (6, 64, 80, 64),  # one whole tile of rows, one slab
        (31, 96, 130, 65),  # the last row count on the dot-product tiles, above MAX_RANK
        (32, 96, 130, 65),  # the first on panels
        (70, 100, 200, 130),  # panels of U with a tail, tiles of 6 rows and a tile of 4
        (512, 256, 192, 16),  # a prefill
        (40, 64, 48, 128),  # V's rows 512 bytes apart: slabs packed before the tiles
        (33, 20, 30, 100),  # 400-byte rows: read in place, a tail vector of 4
    ],
)
@pytest.mark.xdist_group("lowrank")
def test_lowrank_shapes(lowrank: OpModel, M: int, K: int, N: int, R: int):
    check_lowrank(lowrank, M, K, N, R)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    M=st.integers(1, 80),
    K=st.integers(1, 160),
    N=st.integers(1, 140),
    R=st.integers(1, 200),
    seed=st.integers(0, 2**16),
)
@pytest.mark.xdist_group("lowrank")
def test_lowrank_random_shapes(lowrank: OpModel, M: int, K: int, N: int, R: int, seed: int):
    check_lowrank(lowrank, M, K, N, R, seed)


@pytest.mark.xdist_group("lowrank")
def test_lowrank_empty_batch(lowrank: OpModel):
    rng = np.random.default_rng(1)
    _, _, U, V = theta(rng, 6, 8, 3)
    y, yb = lowrank(np.zeros((0, 8), np.float32), U, V)
    assert y.shape == yb.shape == (0, 6)


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        ([(2, 8), (4, 3), (9, 3)], r"V rows are 9, expected 8"),
        ([(2, 8), (4, 3), (8, 2)], r"V columns are 2, expected 3"),
        ([(2, 8), (4, 0), (8, 0)], r"rank 0 .* zero projection"),
        ([(2, 8), (4,), (8, 3)], r"U must be \[out, r\]"),
    ],
)
def test_lowrank_wrapper_refuses_static_shapes(shapes, message):
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType

    from attnquant_kernels.graph import generated_lowrank

    types = [TensorType(DType.float32, list(s), device=DeviceRef.CPU()) for s in shapes]
    with Graph("aq_lowrank_bad", input_types=types) as g:
        with pytest.raises(ValueError, match=message):
            generated_lowrank(*(v.tensor for v in g.inputs))
        g.output(g.inputs[0].tensor)
