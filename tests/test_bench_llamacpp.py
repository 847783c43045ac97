"""The GGUF writer and reader of ``benchmarks/llamacpp.py``, without llama.cpp's binaries.

The benchmarks hand llama.cpp the very weights attnquant compresses: a Hugging Face checkpoint
written as a float32 GGUF (``hf_to_gguf``), quantized by llama.cpp's own tools, read back
dequantized (``gguf_state``) into attnquant-core's numpy forward. A wrong RoPE row order or a
transposed tensor there would make every llama.cpp figure wrong without an error, so the round
trip is checked exactly on the demo model, and the row order against the numpy forward.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

gguf = pytest.importorskip("gguf")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from llamacpp import gguf_name, gguf_state, hf_name, hf_to_gguf, permute_rope  # noqa: E402

from attnquant_cli import demo_model_path  # noqa: E402


@given(heads=st.integers(1, 4), half=st.integers(1, 8), cols=st.integers(1, 5))
def test_rope_permutation_inverts(heads: int, half: int, cols: int) -> None:
    """llama.cpp's interleaved q/k row order, and back, is the identity; it moves rows only."""
    W = np.arange(heads * 2 * half * cols, dtype=np.float32).reshape(heads * 2 * half, cols)
    there = permute_rope(W, heads)
    assert np.array_equal(permute_rope(there, heads, inverse=True), W)
    assert sorted(map(tuple, there)) == sorted(map(tuple, W))


def test_names_invert() -> None:
    keys = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    keys += [f"model.layers.3.{m}.weight" for m in ("self_attn.k_proj", "mlp.down_proj")]
    keys += ["model.layers.0.post_attention_layernorm.weight"]
    assert [hf_name(gguf_name(k)) for k in keys] == keys


def test_demo_round_trips_exactly(tmp_path: Path) -> None:
    """Every tensor of the demo comes back bit for bit, under its own key and shape; the file
    carries the tokenizer (2,048 tokens, merges, BOS/EOS) llama.cpp needs to load it."""
    from safetensors.numpy import load_file

    demo = demo_model_path()
    out = hf_to_gguf(demo, tmp_path / "demo-f32.gguf")
    state, sizes = gguf_state(out)
    want = load_file(demo / "model.safetensors")
    assert sorted(state) == sorted(want)
    for key, W in want.items():
        assert np.array_equal(state[key], W), key
        assert sizes[key] == W.nbytes, key
    reader = gguf.GGUFReader(str(out))
    fields = reader.fields
    tokens = fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == json.loads((demo / "config.json").read_text())["vocab_size"]
    assert len(fields["tokenizer.ggml.merges"].data) > 0
    assert int(fields["tokenizer.ggml.bos_token_id"].parts[-1][0]) == 0
    assert not list(tmp_path.glob("*.tmp"))


def test_q_rows_are_in_llama_cpp_order(tmp_path: Path) -> None:
    """The file's q rows are the checkpoint's permuted (what llama.cpp's converter writes):
    read raw, un-permuted, they give the numpy forward's logits of the checkpoint itself."""
    from safetensors.numpy import load_file

    from attnquant_core.llama_reference import llama_logits

    demo = demo_model_path()
    out = hf_to_gguf(demo, tmp_path / "demo.gguf")
    raw = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(str(out)).tensors}
    want = load_file(demo / "model.safetensors")
    q = want["model.layers.0.self_attn.q_proj.weight"]
    heads = json.loads((demo / "config.json").read_text())["num_attention_heads"]
    assert np.array_equal(raw["blk.0.attn_q.weight"], permute_rope(q, heads))
    assert not np.array_equal(raw["blk.0.attn_q.weight"], q)
    config = json.loads((demo / "config.json").read_text())
    ids = [0, 5, 17, 300, 42]
    got = llama_logits(config, gguf_state(out)[0], ids, dtype=np.float32)
    assert np.array_equal(got, llama_logits(config, want, ids, dtype=np.float32))
