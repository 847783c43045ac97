"""GGUF import and export: every tensor back in Hugging Face's keys and order, dequantized as
``gguf`` decodes it; the config, the tokenizer (byte-level BPE, and SentencePiece BPE against
llama.cpp's SPM algorithm written out here), and bad files refused with nothing written."""

from __future__ import annotations

import heapq
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from attnquant_core.gemma_reference import gemma3_logits
from attnquant_core.io import (
    SOURCE_FILE,
    GGUFError,
    export_gguf,
    gguf_source,
    import_gguf,
)
from attnquant_core.io._gguf import permute_rope
from attnquant_core.llama_reference import llama_logits
from attnquant_core.testing import write_byte_llama
from attnquant_core.tiny_gemma import gemma3_text_config, gemma3_text_tensors

Q = gguf.GGMLQuantizationType


def _state(directory: Path) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(str(directory / "model.safetensors"))


def _write_gguf(
    path: Path,
    arch: str,
    kv: dict[str, object],
    tensors: dict[str, tuple[np.ndarray, Q]],
    vocab: dict[str, object],
) -> Path:
    """A GGUF of ``arch`` with metadata ``kv`` (keys without the ``arch.`` prefix), ``tensors``
    (llama.cpp name -> float array and the type to store it in) and a ``vocab``
    (``model``, ``tokens``, ``types``, and ``scores`` or ``merges``, bos/eos ids)."""
    w = gguf.GGUFWriter(str(path), arch)
    for key, value in kv.items():
        if isinstance(value, bool):
            w.add_bool(f"{arch}.{key}", value)
        elif isinstance(value, int):
            w.add_uint32(f"{arch}.{key}", value)
        else:
            w.add_float32(f"{arch}.{key}", float(value))
    w.add_tokenizer_model(vocab["model"])
    w.add_tokenizer_pre(vocab.get("pre", "default"))
    w.add_token_list(vocab["tokens"])
    w.add_token_types(vocab["types"])
    if "scores" in vocab:
        w.add_token_scores(vocab["scores"])
    if "merges" in vocab:
        w.add_token_merges(vocab["merges"])
    for key in ("bos", "eos", "unk"):
        if f"{key}_id" in vocab:
            getattr(w, {"unk": "add_unk_token_id"}.get(key, f"add_{key}_token_id"))(
                vocab[f"{key}_id"]
            )
    w.add_add_bos_token(bool(vocab.get("add_bos", False)))
    if "space_prefix" in vocab:
        w.add_add_space_prefix(bool(vocab["space_prefix"]))
    for name, (array, qtype) in tensors.items():
        array = np.ascontiguousarray(array, np.float32)
        if qtype == Q.F32:
            w.add_tensor(name, array)
        else:
            w.add_tensor(name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# --- Llama ------------------------------------------------------------------------------------


def test_permute_rope_is_llama_cpps_order_and_inverts() -> None:
    W = np.arange(8 * 3, dtype=np.float32).reshape(8, 3)  # 2 heads of 4 rows: pairs (0,2), (1,3)
    P = permute_rope(W, 2)
    # llama.cpp interleaves each head's halves: rows 0, 2, 1, 3 of the head
    np.testing.assert_array_equal(P[:4], W[[0, 2, 1, 3]])
    np.testing.assert_array_equal(P[4:], W[[4, 6, 5, 7]])
    np.testing.assert_array_equal(permute_rope(P, 2, inverse=True), W)
    with pytest.raises(GGUFError, match="heads"):
        permute_rope(W[:6], 2)


def test_a_llama_round_trip_through_gguf_is_exact(tmp_path: Path) -> None:
    src = tmp_path / "src"
    config = write_byte_llama(src, 2)
    gguf_path = export_gguf(src, tmp_path / "m.gguf")
    # the file holds q/k in llama.cpp's row order, not Hugging Face's
    reader = gguf.GGUFReader(str(gguf_path))
    stored = {t.name: np.asarray(t.data) for t in reader.tensors}
    original = _state(src)
    q = original["model.layers.0.self_attn.q_proj.weight"]
    assert not np.array_equal(stored["blk.0.attn_q.weight"].reshape(q.shape), q)

    out = tmp_path / "imported"
    summary = import_gguf(gguf_path, out)
    assert summary["quantized"] == 0 and summary["types"] == {"F32": len(original)}
    back = _state(out)
    assert back.keys() == original.keys()
    for key, value in original.items():
        np.testing.assert_array_equal(back[key], value, err_msg=key)
    cfg = json.loads((out / "config.json").read_text())
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
        assert cfg[key] == config[key], key
    assert cfg["num_key_value_heads"] == config["num_key_value_heads"]
    assert cfg["rms_norm_eps"] == config["rms_norm_eps"]
    assert cfg["rope_theta"] == config["rope_theta"]
    assert cfg["tie_word_embeddings"] is False
    ids = list(range(0, 250, 7))
    np.testing.assert_array_equal(
        llama_logits(cfg, back, ids, dtype=np.float32),
        llama_logits(config, original, ids, dtype=np.float32),
    )
    theirs = Tokenizer.from_file(str(src / "tokenizer.json"))
    ours = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in ("def f(x):\n    return x  # ok", "  spaces\tand\ttabs\n\n", "héllo wörld"):
        assert ours.encode(text, add_special_tokens=False).ids == theirs.encode(text).ids
        assert ours.decode(ours.encode(text, add_special_tokens=False).ids) == text
    record = gguf_source(out)
    assert record is not None and record["quantized"] == [] and record["architecture"] == "llama"
    assert record["source"] == "m.gguf" and len(record["sha256"]) == 64


def _llama_tensors(rng: np.random.Generator, layers: int, hidden: int, vocab: int) -> dict:
    """Hugging Face tensors of a tiny untied Llama, 2 heads of 32 and 1 KV head, MLP 2 x hidden."""
    shapes = {
        "self_attn.q_proj": (hidden, hidden),
        "self_attn.k_proj": (hidden // 2, hidden),
        "self_attn.v_proj": (hidden // 2, hidden),
        "self_attn.o_proj": (hidden, hidden),
        "mlp.gate_proj": (2 * hidden, hidden),
        "mlp.up_proj": (2 * hidden, hidden),
        "mlp.down_proj": (hidden, 2 * hidden),
    }
    state = {
        "model.embed_tokens.weight": rng.standard_normal((vocab, hidden)),
        "model.norm.weight": 1 + 0.1 * rng.standard_normal(hidden),
        "lm_head.weight": rng.standard_normal((vocab, hidden)) / 8,
    }
    for i in range(layers):
        for module, shape in shapes.items():
            state[f"model.layers.{i}.{module}.weight"] = rng.standard_normal(shape) / 8
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"model.layers.{i}.{norm}.weight"] = 1 + 0.1 * rng.standard_normal(hidden)
    return {k: v.astype(np.float32) for k, v in state.items()}


_LLAMA_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(key: str, names: dict[str, str]) -> str:
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    stem, suffix = key.rsplit(".", 1)
    if stem in top:
        return f"{top[stem]}.{suffix}"
    _, _, layer, module = stem.split(".", 3)
    return f"blk.{layer}.{names[module]}.{suffix}"


def _byte_vocab(n: int) -> dict[str, object]:
    alphabet = sorted(__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet())
    tokens = alphabet + [f"<s{i}>" for i in range(n - len(alphabet))]
    types = [1] * len(alphabet) + [3] * (n - len(alphabet))
    return {"model": "gpt2", "tokens": tokens, "types": types, "merges": [], "eos_id": 256}


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.F16, Q.BF16])
def test_quantized_tensors_come_back_as_gguf_decodes_them(tmp_path: Path, qtype: Q) -> None:
    rng = np.random.default_rng(int(qtype))
    hidden, heads, kv_heads = 64, 2, 1
    state = _llama_tensors(rng, 2, hidden, 260)
    tensors = {}
    for key, W in state.items():
        stored = W
        if key.endswith("q_proj.weight"):
            stored = permute_rope(W, heads)
        elif key.endswith("k_proj.weight"):
            stored = permute_rope(W, kv_heads)
        kind = qtype if W.ndim == 2 else Q.F32
        tensors[_gguf_name(key, _LLAMA_NAMES)] = (stored, kind)
    kv = {
        "context_length": 128,
        "embedding_length": hidden,
        "block_count": 2,
        "feed_forward_length": 2 * hidden,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "attention.layer_norm_rms_epsilon": 1e-5,
        "rope.freq_base": 10000.0,
        "rope.dimension_count": hidden // heads,
    }
    path = _write_gguf(tmp_path / "q.gguf", "llama", kv, tensors, _byte_vocab(260))
    out = tmp_path / "out"
    summary = import_gguf(path, out)
    back = _state(out)
    assert summary["quantized"] == sum(W.ndim == 2 for W in state.values())
    record = gguf_source(out)
    assert record is not None
    assert set(record["quantized"]) == {k for k, W in state.items() if W.ndim == 2}
    assert record["tensors"]["model.layers.0.self_attn.q_proj.weight"] == qtype.name
    for key, W in state.items():
        stored, kind = tensors[_gguf_name(key, _LLAMA_NAMES)]
        if kind == Q.F32:
            np.testing.assert_array_equal(back[key], W, err_msg=key)
            continue
        decoded = gguf.quants.dequantize(gguf.quants.quantize(stored, kind), kind)
        if key.endswith("q_proj.weight"):
            decoded = permute_rope(decoded, heads, inverse=True)
        elif key.endswith("k_proj.weight"):
            decoded = permute_rope(decoded, kv_heads, inverse=True)
        np.testing.assert_array_equal(back[key], decoded, err_msg=key)
        # and the code is near the weights it was made from, in their own row order
        rel = np.linalg.norm(back[key] - W) / np.linalg.norm(W)
        assert rel < 0.2, (key, rel)


# --- Gemma 3 ---------------------------------------------------------------------------------

_GEMMA_NAMES = {
    **_LLAMA_NAMES,
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _spm_vocab(pieces: list[str], *, bos: bool = True) -> dict[str, object]:
    """A SentencePiece BPE vocabulary: specials, 256 byte tokens, then ``pieces`` with unique
    scores in order (earlier: higher)."""
    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    tokens = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    types = [3, 3, 3, 2] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * (4 + 256) + [-float(i) for i in range(len(pieces))]
    return {
        "model": "llama",
        "tokens": tokens,
        "types": types,
        "scores": scores,
        "bos_id": 2,
        "eos_id": 1,
        "unk_id": 3,
        "add_bos": bos,
        "space_prefix": False,
    }


def test_a_gemma3_gguf_imports_as_the_model_it_was_made_from(tmp_path: Path) -> None:
    pieces = ["▁", "a", "b", "c", "d", "▁a", "ab", "abc", "▁ab", "cd", "▁abcd"]
    vocab = _spm_vocab(pieces)
    n = len(vocab["tokens"])
    text = gemma3_text_config(
        vocab_size=n,
        num_hidden_layers=6,
        sliding_window=4,
        sliding_window_pattern=6,
        bos_token_id=2,
        eos_token_id=1,
        pad_token_id=0,
    )
    state = {
        k: np.asarray(v, np.float32)
        for k, v in gemma3_text_tensors(text, seed=3, prefix="model").items()
    }
    tensors = {}
    for key, W in state.items():
        stored = W + 1 if key.endswith("norm.weight") else W  # llama.cpp stores Gemma's 1 + w
        tensors[_gguf_name(key, _GEMMA_NAMES)] = (stored, Q.F32)
    kv = {
        "context_length": text["max_position_embeddings"],
        "embedding_length": text["hidden_size"],
        "block_count": 6,
        "feed_forward_length": text["intermediate_size"],
        "attention.head_count": text["num_attention_heads"],
        "attention.head_count_kv": text["num_key_value_heads"],
        "attention.key_length": text["head_dim"],
        "attention.value_length": text["head_dim"],
        "attention.layer_norm_rms_epsilon": 1e-6,
        "rope.freq_base": 1_000_000.0,
        "attention.sliding_window": 4,
    }
    path = _write_gguf(tmp_path / "g.gguf", "gemma3", kv, tensors, vocab)
    out = tmp_path / "out"
    import_gguf(path, out)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    for key in (
        "layer_types",
        "sliding_window",
        "head_dim",
        "query_pre_attn_scalar",
        "rope_parameters",
        "num_key_value_heads",
        "rms_norm_eps",
    ):
        assert cfg[key] == text[key], key
    assert cfg["tie_word_embeddings"] is True
    back = _state(out)
    assert back.keys() == state.keys()
    for key, W in state.items():
        # (1 + w) - 1 in float32 is w to within one rounding of 1 + w
        atol = 2**-23 if key.endswith("norm.weight") else 0
        np.testing.assert_allclose(back[key], W, rtol=0, atol=atol, err_msg=key)
    ids = [2, 5, 9, 30, 270, 266, 268, 3, 200, 261, 264, 263, 262]  # past the window of 4
    np.testing.assert_allclose(
        gemma3_logits(cfg, back, ids), gemma3_logits(text, state, ids), rtol=1e-5, atol=1e-5
    )
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.encode(" abcd abc").tokens == ["<bos>", "▁abcd", "▁ab", "c"]
    assert tok.decode(tok.encode("ab é").ids) == "ab é"  # é: two byte tokens, fused back


def _llama_cpp_spm(text: str, vocab: dict[str, object]) -> list[int]:
    """llama.cpp's SPM tokenizer (``llm_tokenizer_spm_session``): spaces as ▁, characters as
    symbols, the adjacent pair whose concatenation is the highest-scoring token merged first
    (ties: the leftmost), symbols that are no token as their UTF-8 bytes."""
    tokens: list[str] = vocab["tokens"]  # type: ignore[assignment]
    scores: list[float] = vocab["scores"]  # type: ignore[assignment]
    ids = {t: i for i, t in enumerate(tokens)}
    syms = list(text.replace(" ", "▁"))
    alive = [True] * len(syms)
    nxt = [*range(1, len(syms)), -1]
    prv = list(range(-1, len(syms) - 1))
    heap: list[tuple[float, int, int, str]] = []

    def push(left: int, right: int) -> None:
        if left < 0 or right < 0:
            return
        merged = syms[left] + syms[right]
        if merged in ids:
            heapq.heappush(heap, (-scores[ids[merged]], left, right, merged))

    for i in range(len(syms) - 1):
        push(i, i + 1)
    while heap:
        _, left, right, merged = heapq.heappop(heap)
        if not (alive[left] and alive[right]) or syms[left] + syms[right] != merged:
            continue
        syms[left] = merged
        alive[right] = False
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prv[nxt[right]] = left
        push(prv[left], left)
        push(left, nxt[left])
    out: list[int] = []
    i = 0 if syms else -1
    while i >= 0:
        if syms[i] in ids:
            out.append(ids[syms[i]])
        else:
            out.extend(ids[f"<0x{b:02X}>"] for b in syms[i].encode())
        i = nxt[i]
    return out


_PIECES = ["▁", "a", "b", "c", "▁a", "ab", "ba", "bc", "abc", "▁ab", "cab", "▁b", "bb", "aa"]
_PIECES += ["▁▁", "aab", "bca", "▁c", "cc", "ca"]


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet="abc é", max_size=24))
def test_sentencepiece_bpe_tokenizes_as_llama_cpp(tmp_path_factory, text: str) -> None:
    tok = _spm_tokenizer_for(tmp_path_factory)
    vocab = _spm_vocab(_PIECES, bos=False)
    assert tok.encode(text).ids == _llama_cpp_spm(text, vocab)


_CACHE: dict[str, Tokenizer] = {}


def _spm_tokenizer_for(tmp_path_factory) -> Tokenizer:
    """The tokenizer :func:`import_gguf` builds from :data:`_PIECES`' vocabulary (once)."""
    if "spm" not in _CACHE:
        tmp = tmp_path_factory.mktemp("spm")
        vocab = _spm_vocab(_PIECES, bos=False)
        hidden = 64
        text = gemma3_text_config(vocab_size=len(vocab["tokens"]), num_hidden_layers=1)
        state = gemma3_text_tensors({**text, "hidden_size": hidden}, seed=0, prefix="model")
        tensors = {
            _gguf_name(k, _GEMMA_NAMES): (np.asarray(v, np.float32), Q.F32)
            for k, v in state.items()
        }
        kv = {
            "embedding_length": hidden,
            "block_count": 1,
            "feed_forward_length": text["intermediate_size"],
            "attention.head_count": text["num_attention_heads"],
            "attention.head_count_kv": text["num_key_value_heads"],
            "attention.key_length": text["head_dim"],
        }
        path = _write_gguf(tmp / "t.gguf", "gemma3", kv, tensors, vocab)
        import_gguf(path, tmp / "out")
        _CACHE["spm"] = Tokenizer.from_file(str(tmp / "out" / "tokenizer.json"))
    return _CACHE["spm"]


# --- bad input --------------------------------------------------------------------------------


def test_a_file_that_is_no_gguf_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(200)))
    out = tmp_path / "out"
    with pytest.raises(GGUFError, match="bad.gguf"):
        import_gguf(bad, out)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["bad.gguf"]
    with pytest.raises(FileNotFoundError, match="no such GGUF"):
        import_gguf(tmp_path / "missing.gguf", out)


def test_an_unknown_architecture_or_tensor_is_named(tmp_path: Path) -> None:
    kv = {"embedding_length": 32, "block_count": 1, "attention.head_count": 1}
    embd = {"token_embd.weight": (np.zeros((260, 32), np.float32), Q.F32)}
    path = _write_gguf(tmp_path / "a.gguf", "gpt2", kv, embd, _byte_vocab(260))
    with pytest.raises(GGUFError, match="architecture 'gpt2'"):
        import_gguf(path, tmp_path / "out")
    odd = {**embd, "blk.0.attn_qkv.weight": (np.zeros((96, 32), np.float32), Q.F32)}
    path = _write_gguf(tmp_path / "b.gguf", "llama", kv, odd, _byte_vocab(260))
    with pytest.raises(GGUFError, match="'blk.0.attn_qkv.weight'"):
        import_gguf(path, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_existing_output_is_kept_unless_overwrite(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_byte_llama(src, 1)
    path = export_gguf(src, tmp_path / "m.gguf")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("mine")
    with pytest.raises(FileExistsError):
        import_gguf(path, out)
    assert (out / "keep").read_text() == "mine"
    import_gguf(path, out, overwrite=True)
    assert not (out / "keep").exists() and (out / SOURCE_FILE).is_file()
