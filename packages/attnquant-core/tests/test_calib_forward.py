"""The calibration forward, its text pipeline and eval, against independent computations."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from scipy.special import log_softmax

from attnquant_core.calib import (
    CalibrationError,
    calibrate,
    evaluate,
    open_source,
    read_stats,
    read_texts,
    token_stream,
    token_windows,
)
from attnquant_core.llama_reference import llama_logits
from attnquant_core.testing import SHAPES, llama_config, make_weights

# attnquant_core.testing's shapes: hidden 24, q 32 = 4 heads x 8, k/v 8 = 1 KV head, MLP 40.
CONFIG = llama_config(2)


def tiny_llama(directory: Path, *, seed: int = 0) -> tuple[Path, dict[str, np.ndarray]]:
    """A 2-layer Llama with attnquant_core.testing's projection shapes, weights scaled to O(1/sqrt(in))."""
    rng = np.random.default_rng(seed)
    state = {
        k: (v / math.sqrt(v.shape[-1]) if v.ndim == 2 else v)
        for k, v in make_weights(2, seed=seed).items()
    }
    for layer in range(2):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"model.layers.{layer}.{norm}.weight"] = (
                1 + 0.1 * rng.standard_normal(24)
            ).astype(np.float32)
    state["model.embed_tokens.weight"] = rng.standard_normal((16, 24)).astype(np.float32)
    state["lm_head.weight"] = (rng.standard_normal((16, 24)) / 3).astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory, state


def _independent_inputs(state: dict, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Each projection's input rows for one sequence, by a plain float64 loop over heads and
    positions (HF modeling_llama written out), checked below against llama_logits."""
    f = {k: np.asarray(v, dtype=np.float64) for k, v in state.items()}
    n_heads, n_kv, d, eps = 4, 1, 8, 1e-5
    T = len(ids)

    def norm(x, w):
        return w * x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps)

    def rope(x, t):  # x [d]
        inv = 1.0 / 10000.0 ** (np.arange(0, d, 2) / d)
        c, s = np.cos(t * inv), np.sin(t * inv)
        a, b = x[: d // 2], x[d // 2 :]
        return np.concatenate([a * c - b * s, b * c + a * s])

    h = f["model.embed_tokens.weight"][ids]
    inputs: dict[str, np.ndarray] = {}
    for layer in range(2):
        p = f"model.layers.{layer}"
        x = norm(h, f[f"{p}.input_layernorm.weight"])
        for name in ("q_proj", "k_proj", "v_proj"):
            inputs[f"{p}.self_attn.{name}"] = x
        q, k, v = (x @ f[f"{p}.self_attn.{n}.weight"].T for n in ("q_proj", "k_proj", "v_proj"))
        out = np.zeros((T, n_heads * d))
        for head in range(n_heads):
            kv = head // (n_heads // n_kv)
            for t in range(T):
                qt = rope(q[t, head * d : (head + 1) * d], t)
                scores = np.array(
                    [qt @ rope(k[u, kv * d : (kv + 1) * d], u) / math.sqrt(d) for u in range(t + 1)]
                )
                w = np.exp(scores - scores.max())
                w /= w.sum()
                out[t, head * d : (head + 1) * d] = w @ v[: t + 1, kv * d : (kv + 1) * d]
        inputs[f"{p}.self_attn.o_proj"] = out
        h = h + out @ f[f"{p}.self_attn.o_proj.weight"].T
        x = norm(h, f[f"{p}.post_attention_layernorm.weight"])
        inputs[f"{p}.mlp.gate_proj"] = inputs[f"{p}.mlp.up_proj"] = x
        g = x @ f[f"{p}.mlp.gate_proj.weight"].T
        inner = g / (1 + np.exp(-g)) * (x @ f[f"{p}.mlp.up_proj.weight"].T)
        inputs[f"{p}.mlp.down_proj"] = inner
        h = h + inner @ f[f"{p}.mlp.down_proj.weight"].T
    inputs["logits"] = norm(h, f["model.norm.weight"]) @ f["lm_head.weight"].T
    return inputs


def test_calibration_grams_equal_an_independent_forward(tmp_path: Path) -> None:
    directory, state = tiny_llama(tmp_path / "tiny")
    windows = np.random.default_rng(1).integers(0, 16, size=(3, 7))
    report = calibrate(
        open_source(directory),
        windows,
        tmp_path / "stats.safetensors",
        dtype=np.float64,
        stats_dtype=np.float64,
        batch=2,  # two batches: the grams accumulate across them
    )
    assert (report.tokens, report.sequences, report.seq_len, report.grams) == (21, 3, 7, 14)
    assert report.peak_rss_bytes > 0
    stats = read_stats(report.path)
    assert stats.tokens == 21
    expected: dict[str, np.ndarray] = {}
    for ids in windows:
        inputs = _independent_inputs(state, ids)
        # The independent forward is itself the model: its logits are llama_logits'.
        np.testing.assert_allclose(
            inputs.pop("logits"), llama_logits(CONFIG, state, ids), atol=1e-10
        )
        for key, x in inputs.items():
            expected[key] = expected.get(key, 0) + x.T @ x
    assert len(expected) == 14 and stats.keys == sorted(f"{k}.weight" for k in expected)
    for key, G in expected.items():
        width = SHAPES[key.split(".", 3)[3]][1]
        np.testing.assert_allclose(
            stats.gram(f"{key}.weight", in_features=width), G, rtol=1e-10, atol=1e-10
        )


def test_float32_forward_and_stats_are_close(tmp_path: Path) -> None:
    directory, _ = tiny_llama(tmp_path / "tiny")
    windows = np.random.default_rng(2).integers(0, 16, size=(2, 9))
    source = open_source(directory)
    a = calibrate(
        source, windows, tmp_path / "a.safetensors", dtype=np.float64, stats_dtype=np.float64
    )
    b = calibrate(source, windows, tmp_path / "b.safetensors")  # float32 forward and file
    sa, sb = read_stats(a.path), read_stats(b.path)
    for key in sa.keys:
        np.testing.assert_allclose(sb.gram(key), sa.gram(key), rtol=1e-4, atol=1e-4)


def test_eval_perplexity_kl_and_agreement_are_exact(tmp_path: Path) -> None:
    base_dir, base = tiny_llama(tmp_path / "base", seed=0)
    other_dir, other = tiny_llama(tmp_path / "other", seed=0)
    # A perturbed copy stands for a compressed model.
    key = "model.layers.1.mlp.down_proj.weight"
    other[key] = other[key] + 0.3 * np.random.default_rng(5).standard_normal(
        other[key].shape
    ).astype(np.float32)
    safetensors.numpy.save_file(other, str(other_dir / "model.safetensors"))
    windows = np.random.default_rng(3).integers(0, 16, size=(2, 6))
    results = evaluate([open_source(base_dir), open_source(other_dir)], windows, dtype=np.float64)
    nll = {"base": 0.0, "other": 0.0}
    kl = agree = 0.0
    for ids in windows:
        lp = {
            name: log_softmax(llama_logits(CONFIG, s, ids), -1)[:-1]
            for name, s in (("base", base), ("other", other))
        }
        for name in nll:
            nll[name] -= sum(lp[name][t, ids[t + 1]] for t in range(5))
        kl += float(np.sum(np.exp(lp["base"]) * (lp["base"] - lp["other"])))
        agree += float(np.sum(lp["base"].argmax(-1) == lp["other"].argmax(-1)))
    base_r, other_r = results
    assert base_r.tokens == other_r.tokens == 10
    assert base_r.perplexity == pytest.approx(math.exp(nll["base"] / 10), rel=1e-12)
    assert other_r.perplexity == pytest.approx(math.exp(nll["other"] / 10), rel=1e-12)
    assert (base_r.top1, base_r.kl) == (1.0, 0.0)
    assert other_r.kl == pytest.approx(kl / 10, rel=1e-9) and other_r.kl > 0
    assert other_r.top1 == agree / 10


def test_theta_checkpoint_is_evaluated_as_its_rebuilt_dense_model(tmp_path: Path) -> None:
    from attnquant_core import ThetaCheckpoint, decompose_checkpoint

    base_dir, _ = tiny_llama(tmp_path / "base")
    theta_dir = tmp_path / "theta"
    decompose_checkpoint(base_dir, theta_dir, blocks=1, rank=2)
    rebuilt = dict(ThetaCheckpoint.open(theta_dir).rebuilt_state())
    source = open_source(theta_dir)
    assert source.theta and source.num_layers == 2
    windows = np.random.default_rng(4).integers(0, 16, size=(1, 6))
    _, got = evaluate([open_source(base_dir), source], windows, dtype=np.float64)
    lp = log_softmax(llama_logits(CONFIG, rebuilt, windows[0]), -1)[:-1]
    assert got.nll == pytest.approx(-np.mean(lp[np.arange(5), windows[0, 1:]]), rel=1e-12)


def test_read_texts_files_directories_and_jsonl(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "b.txt").write_text("second")
    (tmp_path / "d" / "sub" / "a.py").write_text("third")
    (tmp_path / "d" / ".hidden").write_text("never")
    (tmp_path / "d" / "blob.bin").write_bytes(b"\xff\xfe\x00")
    (tmp_path / "d" / "c.jsonl").write_text('{"text": "j1"}\n\n{"text": "j2", "id": 3}\n')
    (tmp_path / "one.txt").write_text("first\r\nline")
    assert read_texts([tmp_path / "one.txt", tmp_path / "d"]) == [
        "first\nline",
        "second",
        "j1",
        "j2",
        "third",
    ]
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"content": "x"}\n')
    with pytest.raises(
        CalibrationError, match=r"bad.jsonl:2: a JSON Lines record needs a string 'text'"
    ):
        read_texts([tmp_path / "bad.jsonl"])
    (tmp_path / "bad2.jsonl").write_text("{oops\n")
    with pytest.raises(CalibrationError, match=r"bad2.jsonl:1: not valid JSON"):
        read_texts([tmp_path / "bad2.jsonl"])
    with pytest.raises(CalibrationError, match="missing: no such file or directory"):
        read_texts([tmp_path / "missing"])
    (tmp_path / "empty").mkdir()
    with pytest.raises(CalibrationError, match="no text in"):
        read_texts([tmp_path / "empty"])


def test_token_stream_uses_the_checkpoints_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<bos>": 0, "<eos>": 1, "[UNK]": 2, "a": 3, "b": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 0)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    stream = token_stream(tmp_path, ["a b", "b c"], {"eos_token_id": 1})
    np.testing.assert_array_equal(stream, [0, 3, 4, 1, 0, 4, 2, 1])
    with pytest.raises(CalibrationError, match="no tokenizer.json"):
        token_stream(tmp_path / "nowhere", ["a"], {})


def test_token_windows() -> None:
    stream = np.arange(100)
    all_windows = token_windows(stream, seq_len=30, samples=None)
    np.testing.assert_array_equal(all_windows, np.arange(90).reshape(3, 30))
    first = token_windows(stream, seq_len=30, samples=2, seed=None)
    np.testing.assert_array_equal(first, all_windows[:2])
    drawn = token_windows(stream, seq_len=10, samples=4, seed=0)
    assert (
        drawn.shape == (4, 10)
        and np.all(np.diff(drawn[:, 0]) > 0)
        and np.all(drawn[:, 0] % 10 == 0)
    )
    np.testing.assert_array_equal(drawn, token_windows(stream, seq_len=10, samples=4, seed=0))
    np.testing.assert_array_equal(token_windows(stream[:7], seq_len=30), [np.arange(7)])  # capped
    with pytest.raises(CalibrationError, match="at least 2"):
        token_windows(stream[:1])


def test_architectures_the_forward_does_not_run_are_refused(tmp_path: Path) -> None:
    from attnquant_core.llama_reference import ReferenceConfigError

    directory, _ = tiny_llama(tmp_path / "tiny")
    config = {**CONFIG, "architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu"}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ReferenceConfigError, match=r"\['Gemma3ForCausalLM'\] is not one the numpy"):
        open_source(directory)


def test_grams_accumulate_in_place_chunk_by_chunk() -> None:
    """The gram of a projection's input is added into one float64 array (dsyrk), a chunk of
    tokens at a time: the same gram as ``sum x^T x``, with no second ``[in, in]`` array and no
    float64 copy of the whole input (at Llama-3.2-1B shapes those two added ~540 MiB to every
    layer's peak RSS: a second 512 MiB down_proj gram and its 256 MiB float64 input)."""
    import tracemalloc

    from attnquant_core.calib._forward import accumulate_gram, symmetrize_gram

    rng = np.random.default_rng(3)
    n = 256
    batches = [rng.standard_normal((2, 300, n)).astype(np.float32) for _ in range(3)]
    acc = None
    tracemalloc.start()
    try:
        for x in batches:
            held = acc
            before = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            acc = accumulate_gram(acc, x, chunk_bytes=64 << 10)  # 32 tokens of width 256
            grown = tracemalloc.get_traced_memory()[1] - before
            if held is not None:
                assert acc is held  # in place
                # one float64 chunk (64 KiB) and small change; a temporary gram is 512 KiB
                assert grown < 128 << 10, grown
    finally:
        tracemalloc.stop()
    assert acc is not None and acc.shape == (n, n) and acc.dtype == np.float64
    G = symmetrize_gram(acc, block=48)  # blocks that do not divide n
    assert G is acc
    flat = np.concatenate([x.reshape(-1, n) for x in batches]).astype(np.float64)
    np.testing.assert_allclose(G, flat.T @ flat, rtol=1e-12, atol=1e-9)
    np.testing.assert_array_equal(G, G.T)
