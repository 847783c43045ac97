"""The theta layers in a MAX graph against the numpy identity of attnquant-core.

One graph holds every variant (GEMM fused, GEMM unfused, in-graph precompute) of two layers in
one band, in float32 and in bfloat16 (each dtype its own inputs and weights), so slots, shared
band weights and both dtypes cost one compile (~1-3 min cold on two cores: keep it small).
The NVFP4 linears (a lone ``NVFP4Linear`` and a stacked pair) ride in the same graph: a graph
of their own cost another compile (~80 s cold) for what one more branch of this one proves.
So do the NVFP4-``W0`` theta layers (``s * (x dequantize(W0)^T) + (x V) U^T``, the dequantize
form: a stacked pair, and two layers reading one band of rank 72, above the fused op's limit).
So do the GEMM path's other forms (:func:`mixed_families`: low rank, a shared basis on either
side, layers served dense or zero, stacked q/k/v first matmuls, banded groups with per-layer
ranks and different ``G``), in float32, fused (three layers) and unfused (one).
Several bands are covered by the layout test (numpy) and by the whole tiny model of
``test_ingraph.py`` (two bands over three layers).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import ml_dtypes
import numpy as np
import pytest

from attnquant_core import (
    FamilyTheta,
    decompose_family,
)
from attnquant_core.serving import InGraphLayout, gemm_band_key, ingraph_tensors
from attnquant_core.testing import MIXED_SHAPES, mixed_families

pytestmark = pytest.mark.xdist_group("layers")  # one worker builds the one layer graph

HIDDEN, Q_OUT, KV_OUT, FFL, LAYERS, BLOCKS, RANK, TOKENS = 32, 48, 16, 64, 3, 2, 4, 5
#: The layers of the graph test: band 0 holds layers 0 and 1; slot 1 is the offset one.
GRAPH_LAYERS = {"fused": (0, 1), "unfused": (1,), "precompute": (1,)}
SHAPES = {
    "self_attn.q_proj": (Q_OUT, HIDDEN),
    "self_attn.k_proj": (KV_OUT, HIDDEN),
    "self_attn.v_proj": (KV_OUT, HIDDEN),
    "self_attn.o_proj": (HIDDEN, Q_OUT),
    "mlp.gate_proj": (FFL, HIDDEN),
    "mlp.up_proj": (FFL, HIDDEN),
    "mlp.down_proj": (HIDDEN, FFL),
}
QKV = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
VARIANTS = {"fused": (True, True), "unfused": (True, False), "precompute": (False, True)}
assert SHAPES == MIXED_SHAPES  # the forms branch runs attnquant_core.testing.mixed_families
#: The forms branch (GEMM, float32): fuse, and the layers in the graph.
FORM_VARIANTS = {"forms_fused": (True, (0, 1, 2)), "forms_unfused": (False, (1,))}


@pytest.fixture(scope="module")
def families() -> dict[str, FamilyTheta]:
    rng = np.random.default_rng(7)
    out = {}
    for name, (o, i) in SHAPES.items():
        base = rng.normal(0.0, i**-0.5, (o, i))
        weights = [base + rng.normal(0.0, 0.3 * i**-0.5, (o, i)) for _ in range(LAYERS)]
        theta, _ = decompose_family(
            [w.astype(np.float32) for w in weights], blocks=BLOCKS, rank=RANK, name=name
        )
        out[name] = theta
    return out


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def _references(
    families: dict[str, FamilyTheta], x: np.ndarray, x_o: np.ndarray, layers: tuple[int, ...]
) -> Iterator[np.ndarray]:
    """Per layer: q|k|v, o_proj, MLP, from FamilyTheta.apply (float32)."""
    for layer in layers:
        yield np.concatenate([families[f].apply(layer, x) for f in QKV], axis=-1)
        yield families["self_attn.o_proj"].apply(layer, x_o)
        gate = families["mlp.gate_proj"].apply(layer, x)
        up = families["mlp.up_proj"].apply(layer, x)
        yield families["mlp.down_proj"].apply(layer, _silu(gate) * up)


def _round(families: dict[str, FamilyTheta], dtype: type) -> dict[str, FamilyTheta]:
    """The same bundles with every tensor rounded through ``dtype`` (float32 kept for numpy)."""
    from attnquant_core import LayerTheta

    def r(a: np.ndarray) -> np.ndarray:
        return a.astype(dtype).astype(np.float32)

    return {
        name: FamilyTheta(
            name=name,
            shared=tuple(r(W0) for W0 in fam.shared),
            bands=fam.bands,
            layers=tuple(LayerTheta(s=r(t.s), U=r(t.U), V=r(t.V)) for t in fam.layers),
        )
        for name, fam in families.items()
    }


class _Holder:
    """A ``max.nn.Module`` that only holds sub-modules (made lazily: max imports on first use)."""

    cls: Any = None

    @classmethod
    def make(cls) -> Any:
        if cls.cls is None:
            from max.nn import Module

            class Holder(Module):
                def __call__(self) -> None:  # pragma: no cover
                    raise TypeError

            cls.cls = Holder
        return cls.cls()


def _add_variants(
    root: Any, state: dict[str, Any], families: dict[str, FamilyTheta], dtype_name: str
) -> dict[str, list[Any]]:
    """Hang every variant's layers in ``dtype_name`` under ``root.<dtype_name>``; their weights
    go into ``state``. Returns the layer blocks of each variant, in call order."""
    from max.dtype import DType
    from max.graph import DeviceRef

    from attnquant_max._adapter import weight_data_from_numpy
    from attnquant_max._layers import ThetaBuilder

    dtype = {"float32": DType.float32, "bfloat16": DType.bfloat16}[dtype_name]
    np_dtype = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[dtype_name]
    cpu = DeviceRef.CPU()
    branch = _Holder.make()
    setattr(root, dtype_name, branch)
    calls = {}
    for variant, (gemm, fuse) in VARIANTS.items():
        tensors = dict(
            ingraph_tensors(
                families,
                stack="layers",
                gemm=gemm,
                fuse=fuse,
                dtype=dict.fromkeys(SHAPES, np_dtype),
            )
        )
        shapes = {k: v.shape for k, v in tensors.items()}
        layout = InGraphLayout.from_state(shapes, list(SHAPES), fuse=fuse)
        assert layout is not None and layout.gemm is gemm and layout.blocks == BLOCKS
        assert layout.fused is fuse
        builder = ThetaBuilder(layout, num_layers=LAYERS, shapes=SHAPES, dtype=dtype, device=cpu)
        sub = _Holder.make()
        sub.bank = builder.bank
        layers, holder = [], _Holder.make()
        for layer in GRAPH_LAYERS[variant]:
            block, attn = _Holder.make(), _Holder.make()
            attn.qkv_proj = builder.stacked(QKV, layer)
            attn.o_proj = builder.linear("self_attn.o_proj", layer)
            block.self_attn = attn
            block.mlp = builder.mlp(layer)
            setattr(holder, str(layer), block)  # weight names read layers.<i>....
            layers.append(block)
        sub.layers = holder
        setattr(branch, variant, sub)
        calls[variant] = layers
        # Only the weights of the layers in the graph (layer 2 is in another band).
        used = set(sub.raw_state_dict())
        prefix = f"{dtype_name}.{variant}"
        state.update(
            {
                f"{prefix}.{k}": weight_data_from_numpy(v, f"{prefix}.{k}")
                for k, v in tensors.items()
                if k in used
            }
        )
    return calls


def _add_forms(root: Any, state: dict[str, Any], families: dict[str, Any]) -> dict[str, list[Any]]:
    """Hang the forms branch (float32, GEMM, fused and unfused) under ``root.forms``; its
    weights go into ``state``. Returns the layer blocks of each variant, in call order."""
    from max.dtype import DType
    from max.graph import DeviceRef

    from attnquant_max._adapter import weight_data_from_numpy
    from attnquant_max._layers import ThetaBuilder

    branch = _Holder.make()
    root.forms = branch
    calls = {}
    for variant, (fuse, graph_layers) in FORM_VARIANTS.items():
        tensors = dict(ingraph_tensors(families, stack="layers", gemm=True, fuse=fuse))
        layout = InGraphLayout.from_state(
            {k: v.shape for k, v in tensors.items()}, list(SHAPES), fuse=fuse
        )
        assert layout is not None and layout.gemm and layout.blocks is None
        builder = ThetaBuilder(
            layout, num_layers=LAYERS, shapes=SHAPES, dtype=DType.float32, device=DeviceRef.CPU()
        )
        sub, holder, layers = _Holder.make(), _Holder.make(), []
        sub.bank = builder.bank
        for layer in graph_layers:
            block, attn = _Holder.make(), _Holder.make()
            attn.qkv_proj = builder.stacked(QKV, layer)
            attn.o_proj = builder.linear("self_attn.o_proj", layer)
            block.self_attn = attn
            block.mlp = builder.mlp(layer)
            setattr(holder, str(layer), block)
            layers.append(block)
        sub.layers = holder
        setattr(branch, variant, sub)
        calls[variant] = layers
        used = set(sub.raw_state_dict())
        assert used <= set(tensors), sorted(used - set(tensors))
        prefix = f"forms.{variant}"
        state.update(
            {
                f"{prefix}.{k}": weight_data_from_numpy(v, f"{prefix}.{k}")
                for k, v in tensors.items()
                if k in used
            }
        )
    return calls


#: The NVFP4 branch: (out, in) of a stacked pair (a, b) and of a lone linear (c).
NVFP4_SHAPES = {"a": (48, HIDDEN), "b": (16, HIDDEN), "c": (HIDDEN, FFL)}


def _nvfp4_weights() -> dict[str, Any]:
    """The NVFP4 branch's quantized weights; ``a`` starts with an all-zero block."""
    from attnquant_core.forms import quantize_nvfp4

    rng = np.random.default_rng(3)
    quantized = {}
    for name, shape in NVFP4_SHAPES.items():
        W = rng.normal(0.0, 1.0, shape).astype(np.float32)
        W[0, :16] = 0.0
        quantized[name] = quantize_nvfp4(W, name=name)
    return quantized


def _add_nvfp4(root: Any, state: dict[str, Any], quantized: dict[str, Any]) -> Any:
    """Hang ``NVFP4StackedLinear([a, b])`` and ``NVFP4Linear(c)`` under ``root.nvfp4``."""
    from max.dtype import DType
    from max.graph import DeviceRef

    from attnquant_max._adapter import weight_data_from_numpy
    from attnquant_max._nvfp4_layers import NVFP4Linear, NVFP4StackedLinear

    cpu = DeviceRef.CPU()
    branch = _Holder.make()
    linears = {
        n: NVFP4Linear(i, o, dtype=DType.float32, device=cpu) for n, (o, i) in NVFP4_SHAPES.items()
    }
    branch.stacked = NVFP4StackedLinear([linears["a"], linears["b"]], ["a", "b"])
    branch.c = linears["c"]
    root.nvfp4 = branch
    for name, q in quantized.items():
        arrays = {
            "weight": q.weight,
            "weight_scale": q.weight_scale.view(np.uint8),
            "weight_scale_2": q.weight_scale_2.reshape(1),
        }
        for k, v in arrays.items():
            key = f"nvfp4.{name}.{k}"
            state[key] = weight_data_from_numpy(v, key)
    return branch


#: The NVFP4-W0 theta branch: (out, in, rank) of a stacked pair (one layer with a correction, one
#: without) and of one band ``c`` shared by two layers, of a rank above the fused op's limit (64).
NVFP4_THETA_SHAPES = {"a": (48, FFL, 4), "b": (32, FFL, 0), "c": (80, FFL, 72)}


def _nvfp4_theta_branch(
    *, fused_c: bool, prefix: str, fused_ab: bool = False, dense_from_rows: int | None = None
) -> tuple[Any, dict[str, Any], dict[str, np.ndarray]]:
    """The NVFP4-``W0`` theta layers (``NVFP4Linear`` with ``theta``, ``band``, ``rank``), their
    weights under ``prefix`` and the numpy references (dequantized ``W0``, ``s``, ``U``, ``V``).

    ``stacked`` (a, b: dequantize form, fused when ``fused_ab``), ``c_first`` (dequantize) and
    ``c_second`` (fused when ``fused_c``) read one band weight ``c``, owned by the branch's
    ``bank``. The fused layers take ``dense_from_rows`` (``None``, the CPU's default: the op
    at every batch).
    """
    from max.dtype import DType
    from max.graph import DeviceRef

    from attnquant_core.forms import dequantize_nvfp4, quantize_nvfp4
    from attnquant_max._adapter import weight_data_from_numpy
    from attnquant_max._layers import ThetaSharedBlocks
    from attnquant_max._nvfp4_layers import NVFP4Linear, NVFP4StackedLinear

    cpu, rng = DeviceRef.CPU(), np.random.default_rng(3)
    branch, bank = _Holder.make(), ThetaSharedBlocks()
    branch.bank = bank
    state: dict[str, Any] = {}
    reference: dict[str, np.ndarray] = {}

    def band(name: str, out_dim: int, in_dim: int) -> tuple[Any, ...]:
        W = rng.normal(0.0, in_dim**-0.5, (out_dim, in_dim)).astype(np.float32)
        q = quantize_nvfp4(W)
        arrays = (q.weight, q.weight_scale.view(np.uint8), q.weight_scale_2.reshape(1))
        weights = []
        for part, a in zip(("packed", "scale", "scale_2"), arrays, strict=True):
            key = f"attnquant.shared.{name}.0.W0_{part}"
            dt = DType.float32 if part == "scale_2" else DType.uint8
            weights.append(bank.add(key, dt, a.shape, cpu))
            state[f"{prefix}.{key}"] = weight_data_from_numpy(a, f"{prefix}.{key}")
        reference[name] = dequantize_nvfp4(q)
        return tuple(weights)

    def theta(module: str, name: str, fused: bool, packed: tuple[Any, ...]) -> Any:
        out_dim, in_dim, rank = NVFP4_THETA_SHAPES[name]
        layer = NVFP4Linear(
            in_dim, out_dim, dtype=DType.float32, device=cpu, fused=fused, band=packed,
            theta=True, rank=rank, dense_from_rows=dense_from_rows,
        )  # fmt: skip
        arrays = {"theta_s": (1 + rng.normal(0, 0.1, out_dim)).astype(np.float32)}
        if rank:
            arrays["theta_U"] = rng.normal(0, 0.3 * in_dim**-0.5, (out_dim, rank))
            arrays["theta_V"] = rng.normal(0, rank**-0.5, (in_dim, rank))
        for k, a in arrays.items():
            key = f"{prefix}.{module}.{k}"
            state[key] = weight_data_from_numpy(np.ascontiguousarray(a, np.float32), key)
            reference[f"{module}.{k}"] = np.asarray(a, np.float32)
        return layer

    packed = {n: band(n, o, i) for n, (o, i, _) in NVFP4_THETA_SHAPES.items()}
    # NVFP4StackedLinear leaves its own name out of its members' weight names: "a.theta_s".
    branch.stacked = NVFP4StackedLinear(
        [theta(n, n, fused_ab, packed[n]) for n in "ab"], ["a", "b"]
    )
    branch.c_first = theta("c_first", "c", False, packed["c"])
    branch.c_second = theta("c_second", "c", fused_c, packed["c"])
    return branch, state, reference


def test_fused_nvfp4_theta_layer_above_the_kernel_rank_adds_its_correction_as_two_matmuls() -> None:
    """Traced: ``r = 72 > 64`` runs the fused op without ``U``, ``V`` and two matmuls after it."""
    from max.dtype import DType
    from max.graph import DeviceRef, Graph, TensorType

    from attnquant_kernels import kernels_path
    from attnquant_max import count_matmuls

    branch, state, _ = _nvfp4_theta_branch(fused_c=True, prefix="nvfp4_theta")
    root = _Holder.make()
    root.nvfp4_theta = branch
    root.load_state_dict(state, strict=True)
    x_type = TensorType(DType.float32, [TOKENS, FFL], DeviceRef.CPU())
    graph = Graph(
        "nvfp4_theta_rank72",
        lambda x: branch.c_second(x.tensor),
        [x_type],
        custom_extensions=[kernels_path()],
    )
    text = str(graph)
    assert text.count('"generated_linear_nvfp4"') == 1
    assert sum(count_matmuls(text).values()) == 2
    assert text.count('"nvfp4_theta.c_second.theta_U"') == 1
    assert text.count('"nvfp4_theta.c_second.theta_V"') == 1


@pytest.mark.slow
def test_fused_nvfp4_theta_layers_branch_on_the_rows_and_match_the_identity() -> None:
    """Symbolic rows, one compiled graph, the branch an accelerator takes by default
    (``dense_from_rows=DENSE_FROM_ROWS``; the CPU's op serves every batch, and the served model
    tests cover it): the fused stacked a (r = 4) and b (r = 0) run the op
    at 3 rows and, from DENSE_FROM_ROWS rows on, nvfp4_dequantize's W^T and the stock matmul;
    c (r = 72, above the op's limit) runs the op and its correction's two matmuls at every
    batch. All against ``s * (x W0^T) + (x V) U^T`` in numpy. Each on its own input: matmuls on
    one input inside and outside a cond do not compile in MAX 26.7 (see ``by_rows``), and no
    model feeds one input to both."""
    from max.driver import CPU, Buffer
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType

    from attnquant_kernels import kernels_path
    from attnquant_max._nvfp4_layers import DENSE_FROM_ROWS

    branch, state, ref = _nvfp4_theta_branch(
        fused_c=True, fused_ab=True, prefix="nvfp4_rows", dense_from_rows=DENSE_FROM_ROWS
    )
    root = _Holder.make()
    root.nvfp4_rows = branch
    root.load_state_dict(state, strict=True)
    x_type = TensorType(DType.float32, ["rows", FFL], DeviceRef.CPU())
    graph = Graph(
        "nvfp4_theta_rows",
        lambda x, x2: (branch.stacked(x.tensor), branch.c_second(x2.tensor)),
        [x_type, x_type],
        custom_extensions=[kernels_path()],
    )
    text = str(graph)
    assert text.count('"nvfp4_dequantize"') == 2 and text.count("mo.if") == 1  # a and b
    model = InferenceSession(devices=[CPU()]).load(graph, weights_registry=root.state_dict())

    def identity(x: np.ndarray, W0: np.ndarray, p: str) -> np.ndarray:
        y = ref[f"{p}.theta_s"] * (x.astype(np.float64) @ W0.T)
        return y + (x @ ref[f"{p}.theta_V"]) @ ref[f"{p}.theta_U"].T if f"{p}.theta_U" in ref else y

    rng = np.random.default_rng(9)
    for rows in (3, DENSE_FROM_ROWS + 6):
        x = rng.standard_normal((rows, FFL)).astype(np.float32)
        ab, c = (o.to_numpy() for o in model.execute(Buffer.from_numpy(x), Buffer.from_numpy(x)))
        want_ab = np.concatenate([identity(x, ref[n], n) for n in "ab"], axis=1)
        for got, want in ((ab, want_ab), (c, identity(x, ref["c"], "c_second"))):
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def _run(
    families_by_dtype: dict[str, dict[str, FamilyTheta]], forms: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    """Build, compile and run the one graph of every variant in every dtype; outputs float32.

    float32 and bfloat16 share the graph (one compile for both): each dtype takes its own two
    inputs and owns its own weights. The NVFP4 branch takes the float32 ``x`` and one more
    input of ``FFL`` features; its results are under ``"nvfp4"``. The forms branch
    (``forms``, float32) takes the float32 inputs; its results are under ``"forms"``.
    """
    from max.driver import CPU, Buffer
    from max.dtype import DType
    from max.engine import InferenceSession
    from max.graph import DeviceRef, Graph, TensorType, ops

    cpu = DeviceRef.CPU()
    root = _Holder.make()
    state: dict[str, Any] = {}
    calls = {
        name: _add_variants(root, state, fams, name) for name, fams in families_by_dtype.items()
    }
    form_calls = _add_forms(root, state, forms)
    quantized = _nvfp4_weights()
    nvfp4 = _add_nvfp4(root, state, quantized)
    theta_branch, theta_state, theta_reference = _nvfp4_theta_branch(
        fused_c=False, prefix="nvfp4_theta"
    )
    root.nvfp4_theta = theta_branch
    state.update(theta_state)
    root.load_state_dict(state, strict=True)
    dtypes = {"float32": DType.float32, "bfloat16": DType.bfloat16}
    np_dtypes = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}

    def forward(*inputs):
        outs = []
        for n, name in enumerate(calls):
            x, x_o = inputs[2 * n].tensor, inputs[2 * n + 1].tensor
            for variant in VARIANTS:
                for block in calls[name][variant]:
                    outs.append(block.self_attn.qkv_proj(x))
                    outs.append(block.self_attn.o_proj(x_o))
                    outs.append(block.mlp(x))
        for variant in FORM_VARIANTS:
            for block in form_calls[variant]:
                outs.append(block.self_attn.qkv_proj(inputs[0].tensor))
                outs.append(block.self_attn.o_proj(inputs[1].tensor))
                outs.append(block.mlp(inputs[0].tensor))
        outs.append(nvfp4.stacked(inputs[0].tensor))  # the float32 x
        outs.append(nvfp4.c(inputs[-1].tensor))
        y = inputs[-1].tensor  # the NVFP4-W0 theta branch reads the FFL-wide input
        outs += [theta_branch.stacked(y), theta_branch.c_first(y), theta_branch.c_second(y)]
        return [ops.cast(o, DType.float32) for o in outs]

    input_types = []
    for name in calls:
        input_types += [
            TensorType(dtypes[name], [TOKENS, HIDDEN], cpu),
            TensorType(dtypes[name], [TOKENS, Q_OUT], cpu),
        ]
    input_types.append(TensorType(DType.float32, [TOKENS, FFL], cpu))
    graph = Graph("theta_layers", forward, input_types=input_types)
    # Shared band weights: one graph weight for the two layers of the band.
    text = str(graph)
    for name in calls:
        band = f'"{name}.fused.{gemm_band_key("self_attn.qkv_proj", 0)}"'
        assert text.count(band) == 1, [line for line in text.splitlines() if band in line]
    # A shared basis: one graph weight for the layers of its band (o_proj band 0: layers 0, 1).
    basis = '"forms.forms_fused.attnquant.shared.self_attn.o_proj.0.basis"'
    assert text.count(basis) == 1, [line for line in text.splitlines() if basis in line]
    for part in ("packed", "scale", "scale_2"):  # one NVFP4 W0 for the two layers of band c
        assert text.count(f'"nvfp4_theta.attnquant.shared.c.0.W0_{part}"') == 1, part
    session = InferenceSession(devices=[CPU()])
    model = session.load(graph, weights_registry=root.state_dict())
    rng = np.random.default_rng(1)

    def buf(a: np.ndarray, name: str) -> Buffer:
        if a.dtype == np.float32:
            return Buffer.from_numpy(a)
        return Buffer.from_numpy(a.view(np.uint16)).view(dtypes[name], list(a.shape))

    arrays, buffers = {}, []
    for name in calls:
        x = rng.normal(size=(TOKENS, HIDDEN)).astype(np_dtypes[name])
        x_o = rng.normal(size=(TOKENS, Q_OUT)).astype(np_dtypes[name])
        arrays[name] = [x.astype(np.float32), x_o.astype(np.float32)]
        buffers += [buf(x, name), buf(x_o, name)]
    y = rng.normal(size=(TOKENS, FFL)).astype(np.float32)
    outs = [np.from_dlpack(o) for o in model.execute(*buffers, Buffer.from_numpy(y))]
    results: dict[str, dict[str, Any]] = {}
    for name in calls:
        result: dict[str, Any] = {"x": arrays[name]}
        for variant in VARIANTS:
            n = 3 * len(GRAPH_LAYERS[variant])
            result[variant], outs = outs[:n], outs[n:]
        results[name] = result
    results["forms"] = {"x": arrays["float32"]}
    for variant, (_, graph_layers) in FORM_VARIANTS.items():
        n = 3 * len(graph_layers)
        results["forms"][variant], outs = outs[:n], outs[n:]
    got_ab, got_c, theta_ab, theta_c_first, theta_c_second = outs
    results["nvfp4"] = {"x": arrays["float32"][0], "y": y, "ab": got_ab, "c": got_c}
    results["nvfp4"]["quantized"] = quantized
    results["nvfp4_theta"] = {
        "y": y,
        "ab": theta_ab,
        "c_first": theta_c_first,
        "c_second": theta_c_second,
        "reference": theta_reference,
    }
    return results


@pytest.fixture(scope="module")
def outputs(families: dict[str, FamilyTheta]) -> dict[str, dict[str, Any]]:
    """Every variant's outputs in float32 and bfloat16, from the one compiled graph."""
    return _run(
        {"float32": families, "bfloat16": _round(families, ml_dtypes.bfloat16)}, mixed_families()
    )


def _max_rel(got: np.ndarray, ref: np.ndarray) -> float:
    """Max abs error over max abs reference; the max abs error for an all-zero reference."""
    scale = np.abs(ref).max()
    return float(np.abs(got - ref).max() / (scale if scale else 1.0))


def test_band_weight_layout(families: dict[str, FamilyTheta]) -> None:
    tensors = dict(ingraph_tensors(families, stack="layers", gemm=True, fuse=True))
    band0 = tensors[gemm_band_key("self_attn.qkv_proj", 0)]
    # q, k, v W0 rows, then V^T of layers 0 and 1 (band 0 holds two layers), q/k/v each.
    assert band0.shape == (Q_OUT + 2 * KV_OUT + 2 * 3 * RANK, HIDDEN)
    np.testing.assert_array_equal(band0[:Q_OUT], families["self_attn.q_proj"].shared[0])
    v1 = families["self_attn.k_proj"].layers[1].V.T
    start = Q_OUT + 2 * KV_OUT + 3 * RANK + RANK
    np.testing.assert_array_equal(band0[start : start + RANK], v1)
    assert tensors[gemm_band_key("self_attn.qkv_proj", 1)].shape[0] == Q_OUT + 2 * KV_OUT + 3 * RANK
    assert "layers.2.mlp.down_proj.theta_U" in tensors
    assert not any(k.endswith("theta_V") for k in tensors)
    pre = dict(ingraph_tensors(families, stack="layers", gemm=False, fuse=True))
    assert "attnquant.shared.mlp.up_proj.1.W0" in pre and "layers.0.mlp.up_proj.theta_V" in pre
    stored = sum(f.stored_parameters() for f in families.values())
    assert sum(a.size for a in tensors.values()) == stored  # the GEMM state is the theta size


@pytest.mark.slow
def test_layers_match_the_numpy_identity_float32(
    families: dict[str, FamilyTheta], outputs: dict[str, dict[str, Any]]
) -> None:
    result = outputs["float32"]
    for variant in VARIANTS:
        refs = list(_references(families, *result["x"], GRAPH_LAYERS[variant]))
        for i, (got, ref) in enumerate(zip(result[variant], refs, strict=True)):
            assert got.shape == ref.shape
            assert _max_rel(got, ref) < 1e-4, (variant, i, _max_rel(got, ref))


@pytest.mark.slow
def test_layers_match_the_numpy_identity_bfloat16(
    families: dict[str, FamilyTheta], outputs: dict[str, dict[str, Any]]
) -> None:
    rounded = _round(families, ml_dtypes.bfloat16)
    result = outputs["bfloat16"]
    for variant in VARIANTS:
        refs = list(_references(rounded, *result["x"], GRAPH_LAYERS[variant]))
        for i, (got, ref) in enumerate(zip(result[variant], refs, strict=True)):
            # bf16 keeps 8 bits of mantissa; a few roundings (x V, the sum) -> ~1e-2.
            assert _max_rel(got, ref) < 3e-2, (variant, i, _max_rel(got, ref))


@pytest.mark.slow
def test_every_form_matches_the_numpy_identity(outputs: dict[str, dict[str, Any]]) -> None:
    """Low rank, shared basis (both sides), dense- and zero-served layers, stacked first
    matmuls and banded groups with per-layer ranks, on the GEMM path, against each family's
    numpy identity (``apply``), float32 within 1e-4 relative."""
    families = mixed_families()
    result = outputs["forms"]
    for variant, (_, graph_layers) in FORM_VARIANTS.items():
        refs = list(_references(families, *result["x"], graph_layers))
        for i, (got, ref) in enumerate(zip(result[variant], refs, strict=True)):
            assert got.shape == ref.shape
            assert _max_rel(got, ref) < 1e-4, (variant, i, _max_rel(got, ref))


@pytest.mark.slow
def test_nvfp4_linears_match_the_reference(outputs: dict[str, dict[str, Any]]) -> None:
    """A stacked NVFP4 pair and a lone NVFP4Linear against ``x @ dequantize(q).T`` (numpy)."""
    from attnquant_core.forms import dequantize_nvfp4

    result = outputs["nvfp4"]
    q = result["quantized"]
    W_ab = np.concatenate([dequantize_nvfp4(q["a"]), dequantize_nvfp4(q["b"])])
    np.testing.assert_allclose(result["ab"], result["x"] @ W_ab.T, rtol=1e-5, atol=1e-5)
    W_c = dequantize_nvfp4(q["c"])
    np.testing.assert_allclose(result["c"], result["y"] @ W_c.T, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_dequantized_nvfp4_theta_layers_match_the_numpy_identity(
    outputs: dict[str, dict[str, Any]],
) -> None:
    """``s * (x dequantize(W0)^T) + (x V) U^T`` (numpy) from a stacked pair and from two layers
    reading one band weight (rank 72), W0 dequantized in the graph (the fused op is checked by
    the whole model of ``test_nvfp4_theta.py`` and by attnquant-kernels' tests)."""
    result = outputs["nvfp4_theta"]
    y, reference = result["y"], result["reference"]

    def identity(module: str, name: str) -> np.ndarray:
        out = (y @ reference[name].T) * reference[f"{module}.theta_s"]
        if NVFP4_THETA_SHAPES[name][2]:
            out = out + (y @ reference[f"{module}.theta_V"]) @ reference[f"{module}.theta_U"].T
        return out

    want_ab = np.concatenate([identity("a", "a"), identity("b", "b")], axis=1)
    for got, want in (
        (result["ab"], want_ab),
        (result["c_first"], identity("c_first", "c")),
        (result["c_second"], identity("c_second", "c")),
    ):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * float(np.abs(want).max()))
