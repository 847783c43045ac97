"""The tiny Gemma checkpoints and the numpy Gemma 3 reference forward.

The reference (``gemma3_logits``, batched matmuls over the whole prompt) is checked against an
independent float64 computation written here another way: one query token at a time, complex
rotations, explicit einsums, the window and causal limits as index ranges. Where ``transformers``
and ``torch`` are importable, also against ``Gemma3ForCausalLM`` itself.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from attnquant_core import open_checkpoint
from attnquant_core.gemma_reference import gemma3_layer_types, gemma3_logits, gemma3_rope_configs
from attnquant_core.llama_reference import ReferenceConfigError
from attnquant_core.tiny_gemma import (
    gemma3_conditional_config,
    gemma3_text_config,
    gemma4_config,
    write_tiny_gemma3,
    write_tiny_gemma3_conditional,
    write_tiny_gemma4,
)

IDS = [5, 17, 200, 3, 99, 42, 7, 250, 1, 64, 128, 31]  # 12 tokens > the 8-token window


def _load(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    config = json.loads((path / "config.json").read_text())
    return config, safetensors.numpy.load_file(path / "model.safetensors")


def _independent_logits(config: dict, state: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Gemma 3 in float64, token by token, written apart from the reference."""
    c = config.get("text_config", config)
    W = {k: np.asarray(v, np.float64) for k, v in state.items()}
    pre = next(p for p in ("model", "language_model.model") if f"{p}.embed_tokens.weight" in W)
    H, nh, nkv, d = (
        c["hidden_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
    )
    eps, win = c["rms_norm_eps"], c["sliding_window"]

    def norm(x, w):  # x[..., n]
        return (
            x
            * (1.0 + w)
            / np.sqrt(np.einsum("...i,...i->...", x, x)[..., None] / x.shape[-1] + eps)
        )

    def rotate(x, t, base):  # x[..., d], complex pairs (i, i + d/2)
        half = d // 2
        freq = base ** (-np.arange(half) * 2.0 / d)
        z = (x[..., :half] + 1j * x[..., half:]) * np.exp(1j * t * freq)
        return np.concatenate([z.real, z.imag], axis=-1)

    def gelu(x):
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))

    full_base = c["rope_parameters"]["full_attention"]["rope_theta"]
    local_base = c["rope_parameters"]["sliding_attention"]["rope_theta"]
    T = len(ids)
    h = W[f"{pre}.embed_tokens.weight"][ids] * math.sqrt(H)
    for i, kind in enumerate(c["layer_types"]):
        p = f"{pre}.layers.{i}."
        base = local_base if kind == "sliding_attention" else full_base
        x = norm(h, W[p + "input_layernorm.weight"])
        q = np.einsum("oi,ti->to", W[p + "self_attn.q_proj.weight"], x).reshape(T, nh, d)
        k = np.einsum("oi,ti->to", W[p + "self_attn.k_proj.weight"], x).reshape(T, nkv, d)
        v = np.einsum("oi,ti->to", W[p + "self_attn.v_proj.weight"], x).reshape(T, nkv, d)
        q = norm(q, W[p + "self_attn.q_norm.weight"])
        k = norm(k, W[p + "self_attn.k_norm.weight"])
        q = np.stack([rotate(q[t], t, base) for t in range(T)])
        k = np.stack([rotate(k[t], t, base) for t in range(T)])
        out = np.zeros((T, nh, d))
        for t in range(T):
            first = max(0, t - win + 1) if kind == "sliding_attention" else 0
            for head in range(nh):
                kvh = head * nkv // nh
                s = k[first : t + 1, kvh] @ q[t, head] / math.sqrt(c["query_pre_attn_scalar"])
                if c["attn_logit_softcapping"]:
                    s = c["attn_logit_softcapping"] * np.tanh(s / c["attn_logit_softcapping"])
                e = np.exp(s - s.max())
                out[t, head] = (e / e.sum()) @ v[first : t + 1, kvh]
        a = np.einsum("oi,ti->to", W[p + "self_attn.o_proj.weight"], out.reshape(T, nh * d))
        h = h + norm(a, W[p + "post_attention_layernorm.weight"])
        x = norm(h, W[p + "pre_feedforward_layernorm.weight"])
        g = gelu(np.einsum("oi,ti->to", W[p + "mlp.gate_proj.weight"], x))
        u = np.einsum("oi,ti->to", W[p + "mlp.up_proj.weight"], x)
        m = np.einsum("oi,ti->to", W[p + "mlp.down_proj.weight"], g * u)
        h = h + norm(m, W[p + "post_feedforward_layernorm.weight"])
    h = norm(h, W[f"{pre}.norm.weight"])
    logits = np.einsum("vi,ti->tv", W[f"{pre}.embed_tokens.weight"], h)
    if c["final_logit_softcapping"]:
        logits = c["final_logit_softcapping"] * np.tanh(logits / c["final_logit_softcapping"])
    return logits


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("gemma3"))


# -- the tiny checkpoints --------------------------------------------------------------------


def test_tiny_gemma3_layout(gemma3: Path) -> None:
    config, state = _load(gemma3)
    assert config["architectures"] == ["Gemma3ForCausalLM"]
    assert config["model_type"] == "gemma3_text" and config["dtype"] == "bfloat16"
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 2
    assert {str(v.dtype) for v in state.values()} == {"bfloat16"}
    assert "lm_head.weight" not in state  # tied
    layer0 = {k.removeprefix("model.layers.0.") for k in state if k.startswith("model.layers.0.")}
    assert layer0 == {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        *(f"self_attn.{p}_proj.weight" for p in "qkvo"),
        *(f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    }
    assert len(state) == 4 * len(layer0) + 2
    # Fixed by the seed, changed by another seed.
    again = safetensors.numpy.load_file(
        write_tiny_gemma3(gemma3.parent / "again") / "model.safetensors"
    )
    assert all(np.array_equal(again[k], state[k]) for k in state)
    other = safetensors.numpy.load_file(
        write_tiny_gemma3(gemma3.parent / "other", seed=1) / "model.safetensors"
    )
    assert not np.array_equal(other["model.norm.weight"], state["model.norm.weight"])


def test_tiny_gemma3_conditional_keys_and_weights(gemma3: Path, tmp_path: Path) -> None:
    config, state = _load(write_tiny_gemma3_conditional(tmp_path / "cond"))
    _, text_state = _load(gemma3)
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"]
    assert config["text_config"]["model_type"] == "gemma3_text"
    assert {k.replace("language_model.model.", "model.", 1) for k in state} == set(text_state)
    for key, value in state.items():
        assert np.array_equal(value, text_state[key.replace("language_model.model.", "model.", 1)])
    ckpt = open_checkpoint(tmp_path / "cond")
    assert {info.stack for info in ckpt.families.values()} == {"language_model.model.layers"}


def test_tiny_gemma4_layout(tmp_path: Path) -> None:
    config, state = _load(write_tiny_gemma4(tmp_path / "g4"))
    text = config["text_config"]
    assert config["architectures"] == ["Gemma4ForConditionalGeneration"]
    assert text["layer_types"] == ["sliding_attention", "full_attention"] * 2
    p = "model.language_model.layers."
    # Sliding layer: head_dim 16, two kv heads, v_proj; global layer: 32, one, no v_proj (k = v).
    assert state[p + "0.self_attn.q_proj.weight"].shape == (64, 64)
    assert state[p + "0.self_attn.v_proj.weight"].shape == (32, 64)
    assert state[p + "1.self_attn.q_proj.weight"].shape == (128, 64)
    assert state[p + "1.self_attn.k_proj.weight"].shape == (32, 64)
    assert p + "1.self_attn.v_proj.weight" not in state
    assert state[p + "1.self_attn.k_norm.weight"].shape == (32,)
    assert state[p + "0.layer_scalar"].shape == (1,)
    uniform = write_tiny_gemma4(
        tmp_path / "uniform",
        global_head_dim=16,
        num_global_key_value_heads=None,
        attention_k_eq_v=False,
    )
    _, ustate = _load(uniform)
    assert ustate[p + "1.self_attn.v_proj.weight"].shape == (32, 64)


def test_configs_are_what_transformers_writes() -> None:
    transformers = pytest.importorskip("transformers")
    kw = dict(
        vocab_size=272,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        max_position_embeddings=256,
        query_pre_attn_scalar=16,
        sliding_window_pattern=2,
    )
    ours = gemma3_text_config()
    theirs = json.loads(transformers.Gemma3TextConfig(**kw).to_json_string())
    theirs.pop("transformers_version")
    assert ours == theirs
    vision = transformers.SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
    )
    cond = transformers.Gemma3Config(
        text_config=transformers.Gemma3TextConfig(**kw), vision_config=vision, mm_tokens_per_image=4
    )
    theirs = json.loads(cond.to_json_string())
    ours = gemma3_conditional_config(gemma3_text_config())
    for added in ("architectures", "dtype", "transformers_version"):  # save_pretrained's
        ours.pop(added)
        theirs.pop(added, None)
    assert ours == theirs
    ours4 = gemma4_config()
    text4 = transformers.Gemma4TextConfig(
        **{
            k: v
            for k, v in kw.items()
            if k not in ("query_pre_attn_scalar", "sliding_window_pattern")
        },
        global_head_dim=32,
        num_global_key_value_heads=1,
        attention_k_eq_v=True,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=272,
        layer_types=["sliding_attention", "full_attention"] * 2,
    )
    from transformers.models.gemma4 import Gemma4VisionConfig

    vision4 = Gemma4VisionConfig(
        **{k: v for k, v in ours4["vision_config"].items() if k != "model_type"}
    )
    theirs4 = json.loads(
        transformers.Gemma4Config(text_config=text4, vision_config=vision4).to_json_string()
    )
    assert ours4["text_config"] == theirs4["text_config"]
    assert {k: theirs4["vision_config"][k] for k in ours4["vision_config"]} == ours4[
        "vision_config"
    ]
    for added in ("architectures", "dtype", "transformers_version", "text_config", "vision_config"):
        ours4.pop(added)
        theirs4.pop(added, None)
    assert ours4 == theirs4


# -- the reference forward ------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {"attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0},
        {"sliding_window": 3, "sliding_window_pattern": 3, "num_hidden_layers": 3},
    ],
    ids=["plain", "softcapping", "window3"],
)
def test_reference_matches_independent_float64(tmp_path: Path, fields: dict) -> None:
    config, state = _load(write_tiny_gemma3(tmp_path / "g", **fields))
    ours = gemma3_logits(config, state, IDS)
    theirs = _independent_logits(config, state, IDS)
    assert ours.shape == (len(IDS), 272) and ours.dtype == np.float64
    np.testing.assert_allclose(ours, theirs, rtol=1e-10, atol=1e-10)
    assert np.abs(ours).max() > 0.5  # not a degenerate model


def test_reference_window_and_layer_types_matter(gemma3: Path) -> None:
    config, state = _load(gemma3)
    base = gemma3_logits(config, state, IDS)
    no_window = dict(config, sliding_window=10_000)
    assert np.abs(gemma3_logits(no_window, state, IDS) - base)[8:].max() > 1e-6
    # Within the window the sliding layers see everything: identical logits.
    np.testing.assert_allclose(gemma3_logits(no_window, state, IDS)[:8], base[:8], rtol=1e-12)
    all_global = dict(config, layer_types=["full_attention"] * 4)
    assert np.abs(gemma3_logits(all_global, state, IDS) - base).max() > 1e-6


def test_reference_reads_conditional_and_old_configs(gemma3: Path, tmp_path: Path) -> None:
    config, state = _load(gemma3)
    base = gemma3_logits(config, state, IDS)
    cconfig, cstate = _load(write_tiny_gemma3_conditional(tmp_path / "cond"))
    np.testing.assert_array_equal(gemma3_logits(cconfig, cstate, IDS), base)
    # transformers 4.x keys: rope_theta, rope_local_base_freq, sliding_window_pattern.
    old = {k: v for k, v in config.items() if k not in ("rope_parameters", "layer_types")}
    old.update(rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, rope_scaling=None)
    assert gemma3_layer_types(old) == config["layer_types"]
    assert gemma3_rope_configs(old)["sliding_attention"]["rope_theta"] == 10_000.0
    np.testing.assert_array_equal(gemma3_logits(old, state, IDS), base)


def test_reference_embed_scale_rounding(gemma3: Path) -> None:
    """sqrt(hidden) rounded to the dtype HF scales in: exact for 64 (8.0), not for 1152."""
    config, state = _load(gemma3)
    np.testing.assert_array_equal(
        gemma3_logits(config, state, IDS, embed_scale_dtype="bfloat16"),
        gemma3_logits(config, state, IDS),
    )
    import ml_dtypes

    assert float(np.asarray(math.sqrt(1152), ml_dtypes.bfloat16)) == 34.0


def test_reference_float32_close_to_float64(gemma3: Path) -> None:
    config, state = _load(gemma3)
    f32 = gemma3_logits(config, state, IDS, dtype=np.float32)
    assert f32.dtype == np.float32
    np.testing.assert_allclose(f32, gemma3_logits(config, state, IDS), atol=1e-4)


def test_reference_refuses_what_it_does_not_implement(gemma3: Path) -> None:
    config, state = _load(gemma3)
    with pytest.raises(ReferenceConfigError, match="hidden_activation"):
        gemma3_logits(dict(config, hidden_activation="relu"), state, IDS)
    with pytest.raises(ReferenceConfigError, match="layer_types"):
        gemma3_logits(dict(config, layer_types=["chunked_attention"] * 4), state, IDS)
    with pytest.raises(ReferenceConfigError, match="q_norm"):
        gemma3_logits(
            config, {k: v for k, v in state.items() if "0.self_attn.q_norm" not in k}, IDS
        )
    with pytest.raises(ReferenceConfigError, match="token ids"):
        gemma3_logits(config, state, [272])


def test_reference_against_transformers(gemma3: Path) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    config, state = _load(gemma3)
    model = transformers.Gemma3ForCausalLM.from_pretrained(gemma3, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        theirs = model(torch.tensor([IDS])).logits[0].double().numpy()
    ours = gemma3_logits(config, state, IDS, dtype=np.float32)
    np.testing.assert_allclose(ours, theirs, atol=1e-4)


def test_layer_by_layer_on_a_batch_equals_the_whole_forward(gemma3: Path) -> None:
    """The pieces a calibration pass uses: a batch of windows through gemma3_layer, one layer
    at a time, gives each window's gemma3_logits; capture sees every projection's input."""
    from attnquant_core.gemma_reference import (
        gemma3_embed,
        gemma3_head,
        gemma3_layer,
        gemma3_rope_tables,
        gemma3_spec,
        gemma_norm,
    )

    config, state = _load(gemma3)
    windows = np.array([IDS, IDS[::-1], [3] * len(IDS)])
    spec = gemma3_spec(config)

    def get(key: str) -> np.ndarray:
        return np.asarray(state[key], np.float64)

    seen: dict[str, list[tuple[int, ...]]] = {}

    def capture(projections: tuple[str, ...], x: np.ndarray) -> None:
        for name in projections:
            seen.setdefault(name, []).append(x.shape)

    h = gemma3_embed(spec, get("model.embed_tokens.weight")[windows])
    tables = gemma3_rope_tables(config, spec, windows.shape[1])
    for i in range(4):
        h = gemma3_layer(spec, get, f"model.layers.{i}", h, tables, layer=i, capture=capture)
    norm, head = gemma3_head(get, state.__contains__)
    logits = gemma_norm(h, norm, spec.eps) @ head.T
    for row, ids in zip(logits, windows, strict=True):
        np.testing.assert_allclose(row, gemma3_logits(config, state, ids), rtol=1e-12, atol=1e-12)
    assert seen["self_attn.q_proj"] == [(3, len(IDS), 64)] * 4
    assert seen["self_attn.o_proj"] == [(3, len(IDS), 64)] * 4
    assert seen["mlp.down_proj"] == [(3, len(IDS), 128)] * 4
