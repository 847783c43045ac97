"""The load plan, the rebuilt state and the key checks, without building a MAX model."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import load_file

from attnquant_core import FAMILIES, BandMismatchError, CheckpointError
from attnquant_max import (
    InGraphLayout,
    ServingOptions,
    WeightKeyError,
    check_state_keys,
    log_serving_path,
    plan_serving,
)
from attnquant_max._adapter import model_directory, weight_data_from_numpy
from attnquant_max._keys import expected_llama_keys, expected_uniform_keys
from attnquant_max.testing import gemm_weight_bytes

from .conftest import LAYERS, tiny_llama_tensors


def _hf(**overrides: object) -> SimpleNamespace:
    base = {"num_hidden_layers": LAYERS, "tie_word_embeddings": False}
    return SimpleNamespace(**{**base, **overrides})


def test_theta_at_passthrough_rebuilds_the_dense_weights_exactly(tiny_theta: Path) -> None:
    plan = plan_serving(tiny_theta, ServingOptions(path="precompute-outside"))
    assert (plan.source, plan.blocks, plan.rank, plan.num_layers) == ("theta", LAYERS, 4, LAYERS)
    assert plan.rebuilds and plan.passthrough
    state = dict(plan.state())
    reference = tiny_llama_tensors()
    assert state.keys() == reference.keys()
    for key, array in reference.items():
        assert state[key].dtype == array.dtype
        np.testing.assert_allclose(state[key], array, atol=1e-6, err_msg=key)


def test_dense_defaults_to_passthrough_without_rebuild(tiny_dense: Path) -> None:
    plan = plan_serving(tiny_dense, ServingOptions(path="precompute-outside"))
    assert (plan.source, plan.blocks, plan.rebuilds, plan.passthrough) == (
        "dense",
        "layers",
        False,
        True,
    )
    assert "unchanged" in plan.describe()


def test_dense_with_blocks_is_decomposed_at_load(tiny_dense: Path, tiny_theta_g1: Path) -> None:
    plan = plan_serving(tiny_dense, ServingOptions(path="precompute-outside", blocks=1, rank=8))
    assert (plan.source, plan.blocks, plan.rank, plan.rebuilds) == ("dense", 1, 8, True)
    assert "G=1, r=8" in plan.describe()
    at_load = dict(plan.state())
    from_theta = dict(
        plan_serving(tiny_theta_g1, ServingOptions(path="precompute-outside")).state()
    )
    assert at_load.keys() == from_theta.keys() == tiny_llama_tensors().keys()
    for key in at_load:
        np.testing.assert_allclose(at_load[key], from_theta[key], atol=1e-4, err_msg=key)


def test_theta_missing_a_theta_key_fails_listing_the_layer(theta_missing_v: Path) -> None:
    with pytest.raises(BandMismatchError) as info:
        plan_serving(theta_missing_v, ServingOptions(path="precompute-outside"))
    assert "mlp.up_proj layer 1" in str(info.value)
    assert "theta_V" in str(info.value)
    assert "ATTNQUANT_BLOCKS" in str(info.value)


def test_theta_with_other_blocks_fails_listing_the_layers(theta_other_blocks: Path) -> None:
    with pytest.raises(BandMismatchError, match=r"layers \[1\]"):
        plan_serving(theta_other_blocks, ServingOptions(path="precompute-outside"))


def test_serving_blocks_must_match_the_theta_checkpoint(tiny_theta: Path) -> None:
    plan_serving(tiny_theta, ServingOptions(path="precompute-outside", blocks="layers"))
    with pytest.raises(BandMismatchError, match="ATTNQUANT_BLOCKS"):
        plan_serving(tiny_theta, ServingOptions(path="precompute-outside", blocks=1))


def test_unimplemented_path_refused_before_reading(tmp_path: Path) -> None:
    config = ServingOptions(path="precompute", quant="nvfp4")
    with pytest.raises(NotImplementedError, match="--quant nvfp4"):
        plan_serving(tmp_path / "does-not-exist", config)


@pytest.mark.parametrize(("gemm", "fuse"), [(True, True), (True, False), (False, True)])
def test_in_graph_plan_feeds_the_theta_tensors(tiny_theta_g1: Path, gemm: bool, fuse: bool) -> None:
    config = (
        ServingOptions(path="gemm", qkv_fuse=fuse)
        if gemm
        else ServingOptions(path="precompute", qkv_fuse=fuse)
    )
    plan = plan_serving(tiny_theta_g1, config)
    assert plan.path == ("gemm" if gemm else "precompute") and plan.in_graph and plan.rebuilds
    line = plan.describe()
    assert ("GEMM formulation" if gemm else "in-graph precompute") in line
    assert "G=1, r=8" in line and ("fused" if fuse else "--no-qkv-fuse") in line
    state = dict(plan.theta_state())
    layout = InGraphLayout.from_state(
        {k.removeprefix("model."): v.shape for k, v in state.items()}, FAMILIES, fuse=fuse
    )
    assert layout is not None and layout.gemm is gemm and layout.blocks == 1
    assert layout.fused is fuse and set(layout.ranks.values()) == {8}
    stripped = {k.removeprefix("model.") for k in state}
    assert layout.keys(LAYERS) <= stripped
    assert not any(k.endswith("_proj.weight") for k in state)
    # The served tensors are the checkpoint's tensors, no more (G=1: W0 once).
    ckpt = sum(a.nbytes for f in tiny_theta_g1.glob("*.safetensors") for a in load_file(f).values())
    assert sum(a.nbytes for a in state.values()) == ckpt


def test_dense_passthrough_in_graph_is_the_dense_weight(tiny_dense: Path) -> None:
    plan = plan_serving(tiny_dense, ServingOptions(path="gemm"))
    assert (plan.path, plan.blocks, plan.rank, plan.rebuilds) == ("gemm", "layers", 0, True)
    state = dict(plan.theta_state())
    dense = tiny_llama_tensors()
    band = state["attnquant.gemm.self_attn.qkv_proj.1.W0V"]  # layer 1 is band 1: W0 = W
    qkv = [dense[f"model.layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]
    np.testing.assert_array_equal(band, np.concatenate(qkv))
    np.testing.assert_array_equal(state["model.layers.1.self_attn.q_proj.theta_s"], 1.0)
    assert not any(k.endswith("theta_U") for k in state)


def test_in_graph_refused_for_an_architecture_without_it(tiny_theta: Path) -> None:
    from attnquant_max._adapter import rebuilt_weights

    pipeline_config = SimpleNamespace(model=SimpleNamespace(model_path=str(tiny_theta)))
    with pytest.raises(
        NotImplementedError,
        match="LlamaForCausalLM, MistralForCausalLM, Gemma3ForCausalLM only",
    ):
        rebuilt_weights(
            {},
            pipeline_config,
            options=ServingOptions(path="precompute"),
            name="Qwen2ForCausalLM",
        )


def test_adapter_options_are_its_own_or_the_environments(
    tiny_dense: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An adapter bound to options serves them; one without reads ATTNQUANT_* at each load
    (a max serve child's boundary); plan_serving itself never reads the environment."""
    from attnquant_max._adapter import rebuilt_weights

    monkeypatch.setenv("ATTNQUANT_BLOCKS", "1")
    monkeypatch.setenv("ATTNQUANT_RANK", "2")
    pipeline_config = SimpleNamespace(model=SimpleNamespace(model_path=str(tiny_dense)))
    assert plan_serving(tiny_dense).blocks == "layers"  # the defaults, not the environment
    _, plan = rebuilt_weights({}, pipeline_config)
    assert (plan.blocks, plan.rank) == (1, 2)
    _, plan = rebuilt_weights({}, pipeline_config, options=ServingOptions())
    assert (plan.blocks, plan.rank) == ("layers", 0)


def test_serving_path_is_logged_once(tiny_theta: Path, caplog: pytest.LogCaptureFixture) -> None:
    plan = plan_serving(tiny_theta, ServingOptions(path="precompute-outside"))
    with caplog.at_level(logging.INFO, logger="attnquant_max"):
        line = log_serving_path(plan)
        log_serving_path(plan)
    assert "precompute-outside" in line and "r=4" in line and "G=layers" in line
    assert [r.getMessage() for r in caplog.records].count(line) <= 1


def test_expected_llama_keys() -> None:
    keys = expected_llama_keys(_hf())
    assert "lm_head.weight" in keys
    assert "layers.1.mlp.down_proj.weight" in keys
    assert len(keys) == 3 + LAYERS * 9
    tied = expected_llama_keys(_hf(tie_word_embeddings=True, attention_bias=True))
    assert "lm_head.weight" not in tied
    assert "layers.0.self_attn.k_proj.bias" in tied


def test_expected_uniform_keys_catch_one_missing_layer() -> None:
    keys = ["language_model.layers.0.self_attn.q_norm.weight", "language_model.embed.weight"]
    expected = expected_uniform_keys(keys, 2)
    assert "language_model.layers.1.self_attn.q_norm.weight" in expected
    assert "language_model.layers.1.mlp.down_proj.weight" in expected
    assert "language_model.embed.weight" not in expected


def test_check_state_keys_lists_missing_and_leftover() -> None:
    state = {k.removeprefix("model."): None for k in tiny_llama_tensors()}
    check_state_keys(state, expected_llama_keys(_hf()))
    del state["layers.1.post_attention_layernorm.weight"]
    state["layers.0.self_attn.q_proj.theta_U"] = None
    state["attnquant.shared.mlp.up_proj.0.W0"] = None
    with pytest.raises(WeightKeyError) as info:
        check_state_keys(state, expected_llama_keys(_hf()), model_path="/ckpt")
    message = str(info.value)
    assert message.startswith("/ckpt: ")
    assert "layers.1.post_attention_layernorm.weight" in message
    assert "zeros" in message
    assert "layers.0.self_attn.q_proj.theta_U" in message
    assert "attnquant.shared.mlp.up_proj.0.W0" in message
    assert isinstance(info.value, CheckpointError)


def test_model_directory(tiny_dense: Path) -> None:
    local = SimpleNamespace(model=SimpleNamespace(model_path=str(tiny_dense)))
    assert model_directory(local) == tiny_dense
    weights = [tiny_dense / "model.safetensors"]
    repo = SimpleNamespace(
        model=SimpleNamespace(model_path="org/model", resolved_weight_paths=lambda: weights)
    )
    assert model_directory(repo) == tiny_dense.resolve()
    nowhere = SimpleNamespace(
        model=SimpleNamespace(model_path="org/model", resolved_weight_paths=lambda: [])
    )
    with pytest.raises(CheckpointError, match="org/model"):
        model_directory(nowhere)


@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_weight_data_from_numpy_keeps_values_and_order(dtype: type) -> None:
    from max.dtype import DType

    array = np.arange(12, dtype=np.float32).reshape(3, 4).T.astype(dtype)  # not C-contiguous
    data = weight_data_from_numpy(array, "w")
    assert data.name == "w"
    assert [int(d) for d in data.shape] == [4, 3]
    # What MAX holds, read back on the host: no cast, so no graph to compile (a MAX-side
    # astype(float32) of a bfloat16 buffer compiles one, ~30 s cold, for the same check).
    held = data.data
    if dtype is ml_dtypes.bfloat16:
        held = np.from_dlpack(held.view(DType.uint16, [4, 3])).view(ml_dtypes.bfloat16)
        assert data.dtype == DType.bfloat16
    np.testing.assert_array_equal(np.asarray(held), array)


def test_budget_checkpoint_serves_every_form_on_precompute_outside(tiny_budget: Path) -> None:
    from attnquant_core import ThetaCheckpoint

    ckpt = ThetaCheckpoint.open(tiny_budget)
    plan = plan_serving(tiny_budget, ServingOptions(path="precompute-outside"))
    assert plan.forms == ckpt.forms and plan.rebuilds and not plan.passthrough
    line = plan.describe()
    assert "forms:" in line and "precompute-outside" in line
    state = dict(plan.state())
    for name in ckpt.families:
        for layer in range(LAYERS):
            key = f"model.layers.{layer}.{name}.weight"
            np.testing.assert_array_equal(state[key], ckpt.rebuild(name, layer))
    assert not any(".theta_" in k or k.startswith("attnquant.") for k in state)


def test_in_graph_precompute_refuses_forms_it_does_not_serve(tiny_budget: Path) -> None:
    """In-graph precompute serves banded families only: one line naming each family in
    another form, pointing at the GEMM path and the custom op."""
    from attnquant_core import ThetaCheckpoint

    forms = ThetaCheckpoint.open(tiny_budget).forms
    if all(f == "banded" for f in forms.values()):
        pytest.skip("the budget chose banded theta for every family")  # pragma: no cover
    config = ServingOptions.from_env(
        {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_PRECOMPUTE": "1"}
    )
    with pytest.raises(NotImplementedError) as info:
        plan_serving(tiny_budget, config)
    message = str(info.value)
    assert "\n" not in message and "the precompute path" in message
    assert "--path gemm" in message and "--path custom-op" in message
    assert "--path precompute-outside" in message
    for name, form in forms.items():
        assert (f"{name} ({form})" in message) is (form != "banded")


def test_budget_checkpoint_feeds_every_form_on_the_custom_op(tiny_budget: Path) -> None:
    """``ATTNQUANT_GEMM=0`` serves a budget checkpoint: banded families as ``W0`` blocks for
    ``generated_linear``, the others as their factors for ``generated_lowrank`` (never
    stacked), holding the same bytes as the GEMM path (the checkpoint's)."""
    from attnquant_core import ThetaCheckpoint
    from attnquant_core.serving import served_layers

    ckpt = ThetaCheckpoint.open(tiny_budget)
    if all(f == "banded" for f in ckpt.forms.values()):
        pytest.skip("the budget chose banded theta for every family")  # pragma: no cover
    plan = plan_serving(tiny_budget, ServingOptions(path="custom-op"))
    assert plan.path == "custom-op" and plan.in_graph
    assert "generated_lowrank" in plan.describe()
    state = {k.removeprefix("model."): v for k, v in plan.theta_state()}
    assert not any(k.endswith((".theta_in", ".W0V")) for k in state)
    layout = InGraphLayout.from_state({k: v.shape for k, v in state.items()}, FAMILIES, fuse=True)
    assert layout is not None
    banded = [n for n, f in ckpt.forms.items() if f == "banded"]
    assert sorted(m for members in layout.groups.values() for m in members) == sorted(banded)
    factored = {n: served_layers(ckpt.family_theta(n)) for n in ckpt.families if n not in banded}
    assert layout.served == factored
    assert layout.keys(LAYERS) <= set(state)
    assert sum(a.nbytes for a in state.values()) == gemm_weight_bytes(tiny_budget)


def test_budget_checkpoint_feeds_every_form_on_the_gemm_path(tiny_budget: Path) -> None:
    """The GEMM plan of a budget checkpoint: its tensors are the checkpoint's, plus the dense
    weights of layers whose factors are not smaller, and read back as the same forms."""
    from attnquant_core import ThetaCheckpoint
    from attnquant_core.serving import served_layers

    ckpt = ThetaCheckpoint.open(tiny_budget)
    plan = plan_serving(tiny_budget, ServingOptions(path="gemm"))
    assert plan.path == "gemm" and plan.in_graph
    state = {k.removeprefix("model."): v for k, v in plan.theta_state()}
    layout = InGraphLayout.from_state({k: v.shape for k, v in state.items()}, FAMILIES, fuse=True)
    assert layout is not None and layout.gemm
    served = {name: served_layers(ckpt.family_theta(name)) for name in ckpt.families}
    assert layout.served == served
    assert layout.keys(LAYERS) <= set(state)
    # The checkpoint's tensors (copied and theta), dense weights for layers served dense.
    assert sum(a.nbytes for a in state.values()) == gemm_weight_bytes(tiny_budget)


def test_auto_selection_on_the_cpu_takes_the_custom_op_for_forms_without_w0(
    tiny_budget: Path, tiny_theta: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Measured faster at decode (docs/serving-paths.md): the CPU serves a budget checkpoint on
    the custom op and says why; an accelerator nobody measured it on keeps the GEMM path."""
    import attnquant_max._plan as plan_module

    auto = ServingOptions(path="in-graph")
    banded = plan_serving(tiny_theta, auto)
    if banded.path != "custom-op":
        pytest.skip(f"auto selection picks {banded.path} here")  # pragma: no cover
    budget = plan_serving(tiny_budget, auto)
    assert budget.path == "custom-op"
    assert "generated_lowrank) decodes them faster" in budget.describe()
    monkeypatch.setattr(plan_module, "_accelerator_api", lambda: "metal")
    metal = plan_serving(tiny_budget, auto)
    assert metal.path == "gemm" and "measured on the CPU only" in metal.describe()


def test_in_graph_tensors_pad_per_layer_ranks_exactly() -> None:
    from attnquant_core import FamilyTheta, LayerTheta
    from attnquant_core.serving import InGraphLayout, ingraph_tensors

    rng = np.random.default_rng(0)
    shapes = {"self_attn.q_proj": (8, 16), "self_attn.k_proj": (4, 16)}
    families = {}
    for (name, (o, i)), ranks in zip(shapes.items(), [(1, 3), (2, 0)], strict=True):
        W0 = rng.normal(size=(o, i)).astype(np.float32)
        layers = tuple(
            LayerTheta(
                s=rng.normal(size=o).astype(np.float32),
                U=rng.normal(size=(o, r)).astype(np.float32),
                V=rng.normal(size=(i, r)).astype(np.float32),
            )
            for r in ranks
        )
        families[name] = FamilyTheta(name=name, shared=(W0,), bands=(0, 0), layers=layers)
    tensors = dict(ingraph_tensors(families, stack="layers", gemm=False, fuse=False))
    layout = InGraphLayout.from_state(
        {k: v.shape for k, v in tensors.items()}, list(shapes), fuse=False
    )
    assert layout is not None and layout.ranks == {"self_attn.q_proj": 3, "self_attn.k_proj": 2}
    for name, fam in families.items():
        for layer in range(2):
            U = tensors[f"layers.{layer}.{name}.theta_U"]
            V = tensors[f"layers.{layer}.{name}.theta_V"]
            t = fam.layers[layer]
            np.testing.assert_array_equal(U @ V.T, t.U @ t.V.T)


def test_custom_op_refuses_a_rank_above_64_naming_the_gemm_path(tiny_dense: Path) -> None:
    from attnquant_kernels import RankError

    env = {"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_GEMM": "0", "ATTNQUANT_BLOCKS": "1"}
    ok = plan_serving(tiny_dense, ServingOptions.from_env({**env, "ATTNQUANT_RANK": "16"}))
    assert ok.path == "custom-op" and ok.in_graph
    assert "generated_mlp" in ok.describe()
    with pytest.raises(RankError, match=r"r=65 is above 64.*ATTNQUANT_GEMM=1"):
        plan_serving(tiny_dense, ServingOptions.from_env({**env, "ATTNQUANT_RANK": "65"}))
