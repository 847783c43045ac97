"""Every form in the graph, without a graph: the per-layer choice, the tensors and the layout.

attnquant-max's layer graph (its ``test_layers.py``) runs these tensors against the numpy identity; here the
names, shapes and bytes are checked, and the layout read back from them.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from attnquant_core import LowRankFamily, SharedBasisFamily
from attnquant_core.serving import InGraphLayout, Served, ingraph_tensors, served_layers
from attnquant_core.testing import MIXED_SHAPES as SHAPES
from attnquant_core.testing import mixed_families

LAYERS = 3  # mixed_families' layers


def _tensors(fuse: bool) -> dict[str, np.ndarray]:
    return dict(ingraph_tensors(mixed_families(), stack="layers", gemm=True, fuse=fuse))


def test_lowrank_layers_not_smaller_than_dense_are_served_dense() -> None:
    # [16, 32]: dense 512 numbers; rank r stores 48 r: r = 10 is smaller, r = 11 is not.
    fam = LowRankFamily(
        name="k",
        U=[np.zeros((16, r), np.float32) for r in (10, 11, 0)],
        V=[np.zeros((32, r), np.float32) for r in (10, 11, 0)],
    )
    assert served_layers(fam) == (Served("lowrank", 10), Served("dense"), Served("zero"))
    zero = LowRankFamily(name="z", U=[np.zeros((4, 0))] * 2, V=[np.zeros((8, 0))] * 2)
    assert served_layers(zero) == (Served("dense"),) * 2  # seen in the state at all


@pytest.mark.parametrize("side", ["in", "out"])
def test_shared_basis_not_smaller_than_dense_is_served_dense(side: str) -> None:
    # [16, 32] over 2 layers, one band: 1024 dense numbers.
    basis_dim, coef_dim = (32, 16) if side == "in" else (16, 32)

    def fam(k: int) -> SharedBasisFamily:
        return SharedBasisFamily(
            name="v",
            side=side,  # type: ignore[arg-type]
            bases=[np.zeros((basis_dim, k), np.float32)],
            bands=(0, 0),
            coefs=[np.zeros((coef_dim, k), np.float32)] * 2,
        )

    small = 1024 // (basis_dim + 2 * coef_dim)  # the widest basis that is still smaller
    small -= (basis_dim + 2 * coef_dim) * small == 1024
    assert served_layers(fam(small)) == (Served(f"basis_{side}", small, 0),) * 2
    assert served_layers(fam(small + 1)) == (Served("dense"),) * 2


@pytest.mark.parametrize("fuse", [True, False])
def test_the_layout_reads_every_form_back_from_the_names(fuse: bool) -> None:
    families = mixed_families()
    tensors = _tensors(fuse)
    layout = InGraphLayout.from_state(
        {k: v.shape for k, v in tensors.items()}, list(SHAPES), fuse=fuse
    )
    assert layout is not None and layout.gemm
    for name, fam in families.items():
        assert layout.served[name] == served_layers(fam), name
    assert layout.keys(LAYERS) == set(tensors)
    # gate/up share band weights when fused; down has its own G (1 against 2).
    assert layout.blocks is None and layout.group_blocks("mlp.down_proj") == 1
    gate_up = ("mlp.gate_proj", "mlp.up_proj")
    assert (layout.groups.get("mlp.gate_up_proj") == gate_up) is fuse
    # q/k/v stack their first matmul where every member reads a per-layer tensor (layer 2: k
    # has rank 0 and is served as zero).
    assert layout.stacked == ({"self_attn.qkv_proj": (0, 1)} if fuse else {})


def test_the_held_tensors_are_the_stored_factors() -> None:
    """No padding, each basis and band W0 once: what is held is what is stored, except the
    layer served dense (k, layer 1) and the width-0 basis band served as one zero column."""
    families = mixed_families()
    stored = sum(f.stored_parameters() for f in families.values())
    k = families["self_attn.k_proj"]
    out_dim, in_dim = k.shape
    dense_served = out_dim * in_dim - 12 * (out_dim + in_dim)
    o_pad = sum(SHAPES["self_attn.o_proj"])  # basis [in, 1] + one layer's U [out, 1]
    for fuse in (True, False):
        tensors = _tensors(fuse)
        assert sum(a.size for a in tensors.values()) == stored + dense_served + o_pad
        bases = [key for key in tensors if key.endswith(".basis")]
        assert sorted(bases) == [
            "attnquant.shared.self_attn.o_proj.0.basis",
            "attnquant.shared.self_attn.o_proj.1.basis",
            "attnquant.shared.self_attn.v_proj.0.basis",
        ]
    fused = _tensors(True)
    # Layer 1's stacked rows: q's V^T (5), k's dense W (16), v's V^T (3).
    stacked = fused["layers.1.self_attn.qkv_proj.theta_in"]
    assert stacked.shape == (5 + 16 + 3, in_dim)
    np.testing.assert_array_equal(stacked[5:21], k.reconstruct(1))
    assert "layers.1.self_attn.k_proj.weight" not in fused
    assert "layers.1.self_attn.k_proj.weight" in _tensors(False)


def test_the_custom_op_tensors_hold_every_form_unstacked() -> None:
    """Off the GEMM path (custom op): banded families as ``W0`` blocks with ``s``, ``U``, ``V``
    (ranks padded per group), every other form as the GEMM path holds it unfused (never
    stacked), read back as the same forms."""
    families = {n: f for n, f in mixed_families().items() if n != "mlp.down_proj"}  # one G
    tensors = dict(ingraph_tensors(families, stack="layers", gemm=False, fuse=True))
    assert not any(k.endswith((".theta_in", ".W0V")) for k in tensors)
    layout = InGraphLayout.from_state(
        {k: v.shape for k, v in tensors.items()}, list(families), fuse=True
    )
    assert layout is not None and not layout.gemm and layout.blocks == 2
    assert layout.groups == {"mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
    factored = {n: served_layers(f) for n, f in families.items() if f.form != "banded"}
    assert layout.served == factored
    assert layout.keys(LAYERS) == set(tensors)
    unfused = dict(ingraph_tensors(families, stack="layers", gemm=True, fuse=False))
    for key, value in tensors.items():
        if key.split(".")[-1] in ("W0", "theta_s") or ".mlp." in key:
            continue  # banded: W0 blocks here, W0V band weights there
        np.testing.assert_array_equal(value, unfused[key], err_msg=key)
    assert tensors["layers.1.mlp.up_proj.theta_U"].shape[1] == 4  # up's rank 1, gate's 4


def test_the_in_graph_precompute_tensors_refuse_an_nvfp4_w0() -> None:
    families = mixed_families()
    families["mlp.down_proj"] = SimpleNamespace(form="banded", quant="nvfp4")
    with pytest.raises(ValueError, match=r"read a float W0; mlp.down_proj .*ATTNQUANT_GEMM=1"):
        list(ingraph_tensors(families, stack="layers", gemm=False, fuse=True))
