"""The calibration forward and eval on Gemma 3 text decoders, against independent computations.

Tiny Gemma 3 checkpoints from :mod:`attnquant_core.tiny_gemma` (bf16 as released, both the
``Gemma3ForCausalLM`` and the ``Gemma3ForConditionalGeneration`` layouts). The grams are checked
against a float64 Gemma 3 written out here token by token (complex rotations, the window as an
index range), itself checked against :func:`attnquant_core.gemma_reference.gemma3_logits`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from scipy.special import log_softmax

from attnquant_core import ThetaCheckpoint, decompose_budget, open_checkpoint
from attnquant_core.calib import calibrate, evaluate, open_source, read_stats
from attnquant_core.gemma_reference import gemma3_logits
from attnquant_core.llama_reference import ReferenceConfigError
from attnquant_core.tiny_gemma import (
    write_tiny_gemma3,
    write_tiny_gemma3_conditional,
    write_tiny_gemma4,
)

# hidden 48: sqrt(48) = 6.928 rounds to 6.9375 in bf16, so the embedding scale's rounding shows.
FIELDS = {"hidden_size": 48}
WRITERS = {"causal": write_tiny_gemma3, "conditional": write_tiny_gemma3_conditional}
PREFIXES = {"causal": "model", "conditional": "language_model.model"}
BF16 = ml_dtypes.bfloat16


def _load(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    config = json.loads((path / "config.json").read_text())
    return config, safetensors.numpy.load_file(path / "model.safetensors")


def _logits(config: dict, state: dict[str, np.ndarray], ids: np.ndarray) -> np.ndarray:
    """The reference's logits as transformers computes them in the stored dtype's scale."""
    return gemma3_logits(config, state, ids, embed_scale_dtype=BF16)


def _independent_inputs(config: dict, state: dict, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Each projection's input rows ``[T, in]`` (and ``"logits"``) for one sequence: Gemma 3 in
    float64, one query at a time, written apart from the reference."""
    c = config.get("text_config", config)
    W = {k: np.asarray(v, np.float64) for k, v in state.items()}
    pre = "language_model.model" if "text_config" in config else "model"
    H, nh, nkv, d = (
        c["hidden_size"],
        c["num_attention_heads"],
        c["num_key_value_heads"],
        c["head_dim"],
    )
    eps, window, scaling = (
        c["rms_norm_eps"],
        c["sliding_window"],
        c["query_pre_attn_scalar"] ** -0.5,
    )
    bases = {kind: p["rope_theta"] for kind, p in c["rope_parameters"].items()}

    def norm(x, w):
        return x * (1.0 + w) / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + eps)

    def rotate(x, t, base):  # pairs (i, i + d/2) as complex numbers
        half = d // 2
        z = (x[:half] + 1j * x[half:]) * np.exp(1j * t * base ** (-2.0 * np.arange(half) / d))
        return np.concatenate([z.real, z.imag])

    def gelu(x):
        return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))

    T = len(ids)
    scale = float(np.float32(BF16(math.sqrt(H))))  # rounded to the stored (bf16) dtype
    h = W[f"{pre}.embed_tokens.weight"][ids] * scale
    inputs: dict[str, np.ndarray] = {}
    for i, kind in enumerate(c["layer_types"]):
        p = f"{pre}.layers.{i}."
        base = bases[kind]
        x = norm(h, W[p + "input_layernorm.weight"])
        for name in ("q_proj", "k_proj", "v_proj"):
            inputs[p + f"self_attn.{name}"] = x
        q, k, v = (x @ W[p + f"self_attn.{n}.weight"].T for n in ("q_proj", "k_proj", "v_proj"))
        q = norm(q.reshape(T, nh, d), W[p + "self_attn.q_norm.weight"])
        k = norm(k.reshape(T, nkv, d), W[p + "self_attn.k_norm.weight"])
        v = v.reshape(T, nkv, d)
        out = np.zeros((T, nh * d))
        for t in range(T):
            first = max(0, t - window + 1) if kind == "sliding_attention" else 0
            for head in range(nh):
                g = head // (nh // nkv)
                qt = rotate(q[t, head], t, base)
                keys = np.stack([rotate(k[u, g], u, base) for u in range(first, t + 1)])
                scores = keys @ qt * scaling
                w = np.exp(scores - scores.max())
                out[t, head * d : (head + 1) * d] = (w / w.sum()) @ v[first : t + 1, g]
        inputs[p + "self_attn.o_proj"] = out
        h = h + norm(
            out @ W[p + "self_attn.o_proj.weight"].T, W[p + "post_attention_layernorm.weight"]
        )
        x = norm(h, W[p + "pre_feedforward_layernorm.weight"])
        inputs[p + "mlp.gate_proj"] = inputs[p + "mlp.up_proj"] = x
        inner = gelu(x @ W[p + "mlp.gate_proj.weight"].T) * (x @ W[p + "mlp.up_proj.weight"].T)
        inputs[p + "mlp.down_proj"] = inner
        mlp = inner @ W[p + "mlp.down_proj.weight"].T
        h = h + norm(mlp, W[p + "post_feedforward_layernorm.weight"])
    inputs["logits"] = norm(h, W[f"{pre}.norm.weight"]) @ W[f"{pre}.embed_tokens.weight"].T
    return inputs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The same text weights (same seed) in both layouts."""
    tmp = tmp_path_factory.mktemp("gemma3")
    return {name: write(tmp / name, **FIELDS) for name, write in WRITERS.items()}


@pytest.mark.parametrize("layout", sorted(WRITERS))
def test_grams_equal_an_independent_forward(tiny, tmp_path: Path, layout: str) -> None:
    directory = tiny[layout]
    config, state = _load(directory)
    source = open_source(directory)
    assert source.prefix == PREFIXES[layout] and source.num_layers == 4
    # Windows of 12 tokens > the 8-token sliding window.
    windows = np.random.default_rng(1).integers(0, 272, size=(3, 12))
    loaded: list[str] = []

    def get(key: str) -> np.ndarray:
        loaded.append(key)
        return source.get(key)

    report = calibrate(
        dataclasses.replace(source, get=get),
        windows,
        tmp_path / "stats.safetensors",
        dtype=np.float64,
        stats_dtype=np.float64,
        batch=2,  # two batches: the grams accumulate across them
    )
    assert (report.tokens, report.sequences, report.seq_len, report.grams) == (36, 3, 12, 28)
    # One layer at a time: every layer's weights are read once, in layer order.
    layer_keys = [k for k in loaded if ".layers." in k]
    layers = [int(k.split(".layers.")[1].split(".")[0]) for k in layer_keys]
    assert layers == sorted(layers) and len(layer_keys) == len(set(layer_keys))
    assert set(layers) == {0, 1, 2, 3}
    stats = read_stats(report.path)
    assert stats.tokens == 36
    expected: dict[str, np.ndarray] = {}
    for ids in windows:
        inputs = _independent_inputs(config, state, ids)
        # The independent forward is itself the model: its logits are the reference's.
        np.testing.assert_allclose(inputs.pop("logits"), _logits(config, state, ids), atol=1e-10)
        for key, x in inputs.items():
            expected[key] = expected.get(key, 0) + x.T @ x
    assert stats.keys == sorted(f"{k}.weight" for k in expected)
    for key, G in expected.items():
        np.testing.assert_allclose(stats.gram(f"{key}.weight"), G, rtol=1e-10, atol=1e-10)
    # float32 forward and file (the defaults) stay close.
    f32 = read_stats(calibrate(source, windows, tmp_path / "f32.safetensors").path)
    for key, G in expected.items():
        np.testing.assert_allclose(f32.gram(f"{key}.weight"), G, rtol=1e-4, atol=1e-3)


def test_eval_perplexity_is_exact_and_the_layouts_agree(tiny) -> None:
    config, state = _load(tiny["causal"])
    windows = np.random.default_rng(3).integers(0, 272, size=(2, 12))
    base, conditional = evaluate(
        [open_source(tiny["causal"]), open_source(tiny["conditional"])], windows, dtype=np.float64
    )
    nll = 0.0
    for ids in windows:
        lp = log_softmax(_logits(config, state, ids), axis=-1)
        nll -= sum(lp[t, ids[t + 1]] for t in range(11))
    assert base.tokens == 22
    assert base.perplexity == pytest.approx(math.exp(nll / 22), rel=1e-12)
    assert conditional.perplexity == pytest.approx(base.perplexity, rel=1e-12)
    assert conditional.top1 == 1.0 and conditional.kl == pytest.approx(0.0, abs=1e-12)


def test_decompose_budget_with_gemma_statistics(tiny, tmp_path: Path) -> None:
    directory = tiny["causal"]
    config, _ = _load(directory)
    windows = np.random.default_rng(0).integers(0, 272, size=(8, 16))
    stats = calibrate(open_source(directory), windows, tmp_path / "stats.safetensors").path
    report = decompose_budget(directory, tmp_path / "theta", budget=0.6, calibration=stats)
    assert report.manifest["calibration"]["digest"] == read_stats(stats).digest
    ckpt = open_checkpoint(directory)
    rebuilt = dict(ThetaCheckpoint.open(tmp_path / "theta").rebuilt_state())
    assert set(rebuilt) == set(ckpt.keys())
    for key, array in rebuilt.items():
        source = ckpt.get(key)
        assert (array.dtype, array.shape) == (source.dtype, source.shape), key
    # The theta checkpoint is evaluated as its rebuilt dense model.
    theta = open_source(tmp_path / "theta")
    assert theta.theta and theta.num_layers == 4
    _, got = evaluate([open_source(directory), theta], windows[:1, :12], dtype=np.float64)
    ids = windows[0, :12]
    lp = log_softmax(_logits(config, rebuilt, ids), axis=-1)[:-1]
    assert got.nll == pytest.approx(-np.mean(lp[np.arange(11), ids[1:]]), rel=1e-12)
    assert got.kl > 0


def test_what_the_forward_does_not_compute_is_refused(tmp_path: Path) -> None:
    gemma4 = write_tiny_gemma4(tmp_path / "g4")
    with pytest.raises(
        ReferenceConfigError, match=r"\['Gemma4ForConditionalGeneration'\] is not one the numpy"
    ):
        open_source(gemma4)
    mislabelled = write_tiny_gemma3(tmp_path / "mislabelled")
    config = json.loads((mislabelled / "config.json").read_text())
    (mislabelled / "config.json").write_text(json.dumps({**config, "model_type": "gemma4_text"}))
    with pytest.raises(ReferenceConfigError, match=r"\['Gemma3ForCausalLM'\] is not one the numpy"):
        open_source(mislabelled)
    (mislabelled / "config.json").write_text(json.dumps({**config, "hidden_activation": "gelu"}))
    with pytest.raises(ReferenceConfigError, match="hidden_activation='gelu'"):
        open_source(mislabelled)
    # A final logit softcap: the grams do not see it, the eval would get it wrong.
    capped = open_source(write_tiny_gemma3(tmp_path / "capped", final_logit_softcapping=30.0))
    windows = np.arange(24).reshape(2, 12)
    assert calibrate(capped, windows, tmp_path / "capped.safetensors").grams == 28
    with pytest.raises(ReferenceConfigError, match="final_logit_softcapping=30.0"):
        evaluate([capped], windows)
