"""A theta checkpoint whose ``W0`` is NVFP4 (format version 4) served in the graph, packed.

``attnquant decompose --quant nvfp4`` writes each band's ``W0`` as packed E2M1 codes, E4M3 block
scales and a float32 scale, plus each layer's ``s``, ``U``, ``V``. With
``ATTNQUANT_PRECOMPUTE_OUTSIDE=0`` (or ``ATTNQUANT_QUANT=nvfp4``, which must not quantize it a
second time) the served graph holds exactly those bytes and runs each projection as one
``generated_linear_nvfp4`` dispatch (or ``W0`` dequantized in the graph). The served model must
be the stock model on the checkpoint's dense rebuild ``W_eff = s * dequantize(W0) + U V^T``
(precompute-outside, the numpy identity on the dequantized ``W0``).

Plans, states, refusals and layouts build no graph; the decoders are traced, not compiled, from
the checkpoint loaded on precompute-outside (the stock graph, cached with the dense model's);
one whole-model graph (fused, passthrough, rank 16) is compiled, in its own xdist group, and one
small layer graph (the dequantize form, a band shared by two layers) in another.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from attnquant_core import FAMILIES, ThetaCheckpoint, decompose_checkpoint, save_theta
from attnquant_core.forms import FamilyTheta
from attnquant_max import AttnquantConfig, LoadedModel, count_matmuls, decoder_graph
from attnquant_max._nvfp4_theta import NVFP4ThetaLayout
from attnquant_max._weights import plan_serving

from .conftest import LAYERS, PROJECTIONS, load_tiny
from .test_nvfp4_serving import assert_serves_like

pytestmark = pytest.mark.xdist_group("nvfp4-theta")  # one worker: the graph, and its fixtures

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# The kernel named explicitly, so that CI compiles one known graph (auto times both forms).
FUSED = AttnquantConfig(precompute_outside=False, nvfp4_kernel="fused")
DEQUANTIZE = replace(FUSED, nvfp4_kernel="dequantize")
RANK = 16  # the tiny k/v projections [32, 64] allow up to 32


@pytest.fixture(scope="module")
def tiny_v4(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama at passthrough with each ``W0`` in NVFP4 and a rank-16 correction of its
    quantization error: ``s != 1`` and ``U V^T`` at work in every projection."""
    out = tmp_path_factory.mktemp("ckpt") / "v4"
    decompose_checkpoint(tiny_dense, out, blocks="layers", rank=RANK, quant="nvfp4")
    return out


@pytest.fixture(scope="module")
def tiny_v4_g1(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One NVFP4 ``W0`` shared by both layers of each family (G = 1), rank 8."""
    out = tmp_path_factory.mktemp("ckpt") / "v4_g1"
    decompose_checkpoint(tiny_dense, out, blocks=1, rank=8, quant="nvfp4")
    return out


@pytest.fixture(scope="module")
def tiny_v4_mixed(tiny_v4: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``tiny_v4`` with ``mlp.down_proj`` stored with a float W0 (its dequantization)."""
    model = ThetaCheckpoint.open(tiny_v4).load()
    down = model.families["mlp.down_proj"]
    assert isinstance(down, FamilyTheta)
    families = dict(model.families)
    families["mlp.down_proj"] = FamilyTheta(
        name=down.name, shared=down.shared, bands=down.bands, layers=down.layers
    )
    config = json.loads((tiny_v4 / "config.json").read_text())
    out = tmp_path_factory.mktemp("ckpt") / "v4_mixed"
    save_theta(replace(model, families=families), out, config=config)
    return out


def stored_bytes(directory: Path) -> int:
    """Bytes of every tensor a checkpoint stores, read from the safetensors headers (numpy's
    safetensors reader has no float8, which the NVFP4 block scales are)."""
    total = 0
    for file in directory.glob("*.safetensors"):
        with open(file, "rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            header = json.loads(handle.read(size))
        total += sum(
            end - begin
            for key, entry in header.items()
            if key != "__metadata__"
            for begin, end in [entry["data_offsets"]]
        )
    return total


# -- plans and refusals (no graph) ---------------------------------------------------------------


def test_in_graph_plan_serves_the_packed_w0_and_says_so(tiny_v4: Path) -> None:
    plan = plan_serving(tiny_v4, FUSED)
    assert plan.nvfp4_w0 and plan.in_graph and plan.path == "gemm" and not plan.quantized
    line = plan.describe()
    assert "NVFP4 W0 held packed as stored" in line and "one copy per band" in line
    assert "generated_linear_nvfp4(x, W0_packed, W0_scale, W0_scale_2, s, U, V)" in line
    assert "ATTNQUANT_NVFP4_KERNEL=fused" in line and f"r={RANK}" in line
    assert "dequantized in the graph" in plan_serving(tiny_v4, DEQUANTIZE).describe()


def test_quant_nvfp4_on_a_quantized_checkpoint_serves_it_as_stored(tiny_v4: Path) -> None:
    """``ATTNQUANT_QUANT=nvfp4`` asks for a 4-bit model; the checkpoint is one. Quantizing its
    ``W_eff = s Q(W0) + U V^T`` again would quantize the correction of Q's error away, so the
    stored ``W0`` is served packed with ``s``, ``U``, ``V``: the same plan as in the graph."""
    quant = AttnquantConfig(quant="nvfp4", nvfp4_kernel="fused")
    plan = plan_serving(tiny_v4, quant)
    assert plan.nvfp4_w0 and plan.path == "gemm" and not plan.quantized
    assert "not quantized twice" in plan.describe()
    in_graph = dict(plan_serving(tiny_v4, FUSED).nvfp4_theta_state())
    state = dict(plan.nvfp4_theta_state())
    assert state.keys() == in_graph.keys()
    assert all(np.array_equal(state[k], in_graph[k]) for k in state)


def test_precompute_outside_still_rebuilds_dense(tiny_v4: Path) -> None:
    plan = plan_serving(tiny_v4, AttnquantConfig())
    assert not plan.nvfp4_w0 and not plan.in_graph and plan.path == "precompute-outside"
    assert "rebuilt once at load" in plan.describe()


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (
            AttnquantConfig(precompute_outside=False, gemm=False),
            r"stores W0 in NVFP4 \(.*self_attn\.q_proj.*\); the custom-op path \(ATTNQUANT_GEMM=0"
            r".*Unset ATTNQUANT_GEMM \(or set it to 1\)",
        ),
        (
            AttnquantConfig(precompute=True),
            r"stores W0 in NVFP4.*ATTNQUANT_PRECOMPUTE=1.*Set ATTNQUANT_PRECOMPUTE=0 and "
            r"ATTNQUANT_PRECOMPUTE_OUTSIDE=0",
        ),
        (
            AttnquantConfig(quant="nvfp4", precompute=True),
            r"in-graph precompute \(ATTNQUANT_PRECOMPUTE=1\)",
        ),
    ],
    ids=["custom-op", "precompute", "quant-precompute"],
)
def test_paths_that_would_dequantize_w0_are_refused(
    tiny_v4: Path, config: AttnquantConfig, match: str
) -> None:
    with pytest.raises(NotImplementedError, match=match) as info:
        plan_serving(tiny_v4, config)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("config", [FUSED, AttnquantConfig(quant="nvfp4")], ids=["gemm", "quant"])
def test_families_without_an_nvfp4_w0_are_refused(
    tiny_v4_mixed: Path, config: AttnquantConfig
) -> None:
    with pytest.raises(
        NotImplementedError,
        match=r"but not mlp\.down_proj \(banded, float W0\).*ATTNQUANT_PRECOMPUTE_OUTSIDE=1 and "
        r"ATTNQUANT_QUANT unset",
    ):
        plan_serving(tiny_v4_mixed, config)
    assert not plan_serving(tiny_v4_mixed, AttnquantConfig()).nvfp4_w0  # the dense rebuild


# -- the state and its layout (no graph) ---------------------------------------------------------


@pytest.mark.parametrize("which", ["passthrough", "g1"])
def test_state_holds_the_stored_bytes_and_nothing_dequantized(
    which: str, tiny_v4: Path, tiny_v4_g1: Path
) -> None:
    path = tiny_v4 if which == "passthrough" else tiny_v4_g1
    G = LAYERS if which == "passthrough" else 1
    state = {k.removeprefix("model."): v for k, v in plan_serving(path, FUSED).nvfp4_theta_state()}
    assert sum(a.nbytes for a in state.values()) == stored_bytes(path)
    assert not any(k.endswith(tuple(f"{f}.weight" for f in FAMILIES)) for k in state)
    ckpt = ThetaCheckpoint.open(path)
    for family, (out_dim, in_dim) in PROJECTIONS.items():
        for band in range(G):
            packed, scale, scale_2 = (
                state[f"attnquant.shared.{family}.{band}.W0_{part}"]
                for part in ("packed", "scale", "scale_2")
            )
            assert (packed.dtype, packed.shape) == (np.uint8, (out_dim, in_dim // 2))
            assert (scale.dtype, scale.shape) == (np.uint8, (out_dim, in_dim // 16))
            assert (scale_2.dtype, scale_2.shape) == (np.float32, (1,))
            q = ckpt.nvfp4(family, band)
            np.testing.assert_array_equal(packed, q.weight)
            np.testing.assert_array_equal(scale, q.weight_scale.view(np.uint8))
        assert f"attnquant.shared.{family}.{G}.W0_packed" not in state
    layout = NVFP4ThetaLayout.from_state({k: v.shape for k, v in state.items()}, FAMILIES)
    assert layout is not None
    assert layout.blocks == dict.fromkeys(FAMILIES, G)
    assert layout.ranks["mlp.up_proj"] == (RANK if G == LAYERS else 8,) * LAYERS
    theta = {k for k in state if k.startswith("attnquant.") or ".theta_" in k}
    assert layout.keys() == theta


def test_layout_refuses_a_state_without_every_family() -> None:
    shapes = {
        "attnquant.shared.self_attn.q_proj.0.W0_packed": (64, 32),
        "layers.0.self_attn.q_proj.theta_s": (64,),
    }
    with pytest.raises(ValueError, match=r"missing \['self_attn\.k_proj'"):
        NVFP4ThetaLayout.from_state(shapes, FAMILIES)
    assert NVFP4ThetaLayout.from_state({"layers.0.x.weight": (4, 4)}, FAMILIES) is None


# -- traced decoders (no compile) -------------------------------------------------------------


@pytest.fixture(scope="module")
def outside_v4(tiny_v4: Path) -> Iterator[LoadedModel]:
    """The checkpoint rebuilt dense at load (the reference): the stock graph, cached."""
    with load_tiny(tiny_v4) as model:
        yield model


def _text(loaded: LoadedModel, config: AttnquantConfig) -> tuple[str, int]:
    graph, nbytes = decoder_graph(loaded, config)
    return str(graph), nbytes


@pytest.mark.slow
def test_traced_decoders_hold_the_checkpoint_bytes(
    outside_v4: LoadedModel, tiny_v4: Path, tiny_dense: Path, dense_model: LoadedModel
) -> None:
    """Fused: one generated_linear_nvfp4 per projection, no matmul but the head; dequantize:
    one matmul per group plus two per correction; both hold the checkpoint's bytes, and
    ``ATTNQUANT_QUANT=nvfp4`` builds the very graph of the in-graph path."""
    fused, fused_bytes = _text(outside_v4, FUSED)
    assert fused.count('"generated_linear_nvfp4"') == len(PROJECTIONS) * LAYERS
    assert sum(count_matmuls(fused).values()) == 1  # the LM head
    deq, deq_bytes = _text(outside_v4, DEQUANTIZE)
    assert '"generated_linear_nvfp4"' not in deq
    per_layer = 4 + 2 * len(PROJECTIONS)  # qkv, o, gate_up, down + (x V) U^T each
    assert sum(count_matmuls(deq).values()) == 1 + per_layer * LAYERS
    quant, quant_bytes = _text(outside_v4, AttnquantConfig(quant="nvfp4", nvfp4_kernel="fused"))
    assert quant == fused
    stored = stored_bytes(tiny_v4)
    assert fused_bytes == deq_bytes == quant_bytes == stored
    dense = dense_model.model.pipeline._pipeline_model.weight_bytes
    assert dense == stored_bytes(tiny_dense)
    print(f"tiny Llama, NVFP4 W0 + r={RANK} in the graph: {stored} B held, dense {dense} B")


@pytest.mark.slow
def test_traced_decoder_holds_each_band_once(tiny_v4_g1: Path) -> None:
    with load_tiny(tiny_v4_g1) as outside:  # the stock graph, cached
        text, nbytes = _text(outside, FUSED)
    assert nbytes == stored_bytes(tiny_v4_g1)
    for family in FAMILIES:
        for part in ("packed", "scale", "scale_2"):
            assert text.count(f'"attnquant.shared.{family}.0.W0_{part}"') == 1, (family, part)
    assert text.count('"generated_linear_nvfp4"') == len(PROJECTIONS) * LAYERS


# -- the served model (one whole-model graph) ----------------------------------------------------


@pytest.mark.slow
def test_served_v4_on_the_fused_op_is_the_stock_model_on_the_dense_rebuild(
    tiny_v4: Path, outside_v4: LoadedModel
) -> None:
    """Greedy tokens equal and log-probs to 1e-4 against ``s * dequantize(W0) + U V^T`` rebuilt
    in numpy at load (precompute-outside), holding the checkpoint's bytes."""
    from attnquant_max import ThetaLlama3Model

    with load_tiny(tiny_v4, FUSED) as model:
        pm = model.model.pipeline._pipeline_model
        assert isinstance(pm, ThetaLlama3Model)
        assert pm.weight_bytes == stored_bytes(tiny_v4)
        assert not any(k.endswith("q_proj.weight") for k in pm.state_dict)
        assert "attnquant.shared.self_attn.q_proj.1.W0_packed" in pm.state_dict
        assert "layers.1.mlp.down_proj.theta_U" in pm.state_dict
        assert_serves_like(model, outside_v4)


# -- the layers (one small graph, no custom op) ------------------------------------------------

#: (out, in, rank) of the layer graph: a stacked pair (one layer with a correction, one without)
#: and one band shared by two layers, one of a rank above the fused op's limit (64).
LAYER_SHAPES = {"a": (48, 96, 4), "b": (32, 96, 0), "c": (80, 96, 72)}


def _layers(fused_c: bool) -> tuple[Any, dict[str, Any], dict[str, np.ndarray]]:
    """The layer graph's modules (under one root), their weights and the numpy references."""
    from max.dtype import DType
    from max.graph import DeviceRef
    from max.nn import Module

    from attnquant_max import dequantize_nvfp4, quantize_nvfp4
    from attnquant_max._layers import ThetaSharedBlocks
    from attnquant_max._nvfp4_layers import NVFP4Linear, NVFP4StackedLinear
    from attnquant_max._weights import weight_data_from_numpy

    class Holder(Module):
        def __call__(self) -> None:  # pragma: no cover - holds modules
            raise TypeError

    cpu, rng = DeviceRef.CPU(), np.random.default_rng(3)
    root, bank = Holder(), ThetaSharedBlocks()
    state: dict[str, Any] = {}
    reference: dict[str, np.ndarray] = {}
    root.bank = bank

    def band(name: str, out_dim: int, in_dim: int) -> tuple[Any, ...]:
        W = rng.normal(0.0, in_dim**-0.5, (out_dim, in_dim)).astype(np.float32)
        q = quantize_nvfp4(W)
        arrays = (q.weight, q.weight_scale.view(np.uint8), q.weight_scale_2.reshape(1))
        weights = []
        for part, a in zip(("packed", "scale", "scale_2"), arrays, strict=True):
            key = f"attnquant.shared.{name}.0.W0_{part}"
            dt = DType.float32 if part == "scale_2" else DType.uint8
            weights.append(bank.add(key, dt, a.shape, cpu))
            state[key] = weight_data_from_numpy(a, key)
        reference[name] = dequantize_nvfp4(q)
        return tuple(weights)

    def theta(prefix: str, name: str, fused: bool, packed: tuple[Any, ...]) -> Any:
        out_dim, in_dim, rank = LAYER_SHAPES[name]
        layer = NVFP4Linear(
            in_dim, out_dim, dtype=DType.float32, device=cpu, fused=fused, band=packed,
            theta=True, rank=rank,
        )  # fmt: skip
        arrays = {"theta_s": (1 + rng.normal(0, 0.1, out_dim)).astype(np.float32)}
        if rank:
            arrays["theta_U"] = rng.normal(0, 0.3 * in_dim**-0.5, (out_dim, rank))
            arrays["theta_V"] = rng.normal(0, rank**-0.5, (in_dim, rank))
        for k, a in arrays.items():
            key = f"{prefix}.{k}"
            state[key] = weight_data_from_numpy(np.ascontiguousarray(a, np.float32), key)
            reference[key] = np.asarray(a, np.float32)
        return layer

    packed = {n: band(n, o, i) for n, (o, i, _) in LAYER_SHAPES.items()}
    # NVFP4StackedLinear leaves its own name out of its members' weight names: "a.theta_s".
    root.stacked = NVFP4StackedLinear([theta(n, n, False, packed[n]) for n in "ab"], ["a", "b"])
    root.c_first = theta("c_first", "c", False, packed["c"])
    root.c_second = theta("c_second", "c", fused_c, packed["c"])
    root.load_state_dict(state, strict=True)
    return root, state, reference


def test_fused_layer_above_the_kernel_rank_adds_its_correction_as_two_matmuls() -> None:
    """Traced: ``r = 72 > 64`` runs the fused op without ``U``, ``V`` and two matmuls after it."""
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType

    from attnquant_kernels import kernels_path

    root, _, _ = _layers(fused_c=True)
    x_type = TensorType(DType.float32, [5, 96], DeviceRef.CPU())
    graph = Graph(
        "nvfp4_theta_rank72",
        lambda x: root.c_second(x.tensor),
        [x_type],
        custom_extensions=[kernels_path()],
    )
    text = str(graph)
    assert text.count('"generated_linear_nvfp4"') == 1
    assert sum(count_matmuls(text).values()) == 2
    assert text.count('"c_second.theta_U"') == text.count('"c_second.theta_V"') == 1


@pytest.mark.slow
@pytest.mark.xdist_group("nvfp4-theta-layers")  # its own worker, beside the whole model's compile
def test_dequantized_nvfp4_theta_layers_match_the_numpy_identity() -> None:
    """``s * (x dequantize(W0)^T) + (x V) U^T`` (numpy) from a stacked pair and from two layers
    reading one band weight, W0 dequantized in the graph (the fused op is checked by the whole
    model above and by attnquant-kernels' tests)."""
    from max.driver import CPU, Buffer
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType

    root, _, reference = _layers(fused_c=False)
    tokens = 5
    x_type = TensorType(DType.float32, [tokens, 96], DeviceRef.CPU())

    def forward(x: Any) -> list[Any]:
        x = x.tensor
        return [root.stacked(x), root.c_first(x), root.c_second(x)]

    graph = Graph("nvfp4_theta_layers", forward, [x_type])
    text = str(graph)
    for part in ("packed", "scale", "scale_2"):  # one weight for the two layers of band c
        assert text.count(f'"attnquant.shared.c.0.W0_{part}"') == 1
    model = InferenceSession(devices=[CPU()]).load(graph, weights_registry=root.state_dict())
    x = np.random.default_rng(4).normal(size=(tokens, 96)).astype(np.float32)
    ab, c_first, c_second = (np.from_dlpack(o) for o in model.execute(Buffer.from_numpy(x)))

    def identity(prefix: str, name: str) -> np.ndarray:
        y = (x @ reference[name].T) * reference[f"{prefix}.theta_s"]
        if LAYER_SHAPES[name][2]:
            y = y + (x @ reference[f"{prefix}.theta_V"]) @ reference[f"{prefix}.theta_U"].T
        return y

    want_ab = np.concatenate([identity("a", "a"), identity("b", "b")], axis=1)
    for got, want in (
        (ab, want_ab),
        (c_first, identity("c_first", "c")),
        (c_second, identity("c_second", "c")),
    ):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
