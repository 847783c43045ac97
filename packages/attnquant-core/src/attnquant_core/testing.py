"""Helpers for tests of attnquant and of code built on it: small synthetic checkpoints.

Not imported by the library itself; numpy and safetensors (and ``tokenizers`` for
:func:`write_byte_tokenizer`) only. :func:`mixed_families` builds theta families in every form.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy

__all__ = [
    "EXPORT_LAYERS",
    "EXPORT_SHAPES",
    "MIXED_SHAPES",
    "SHAPES",
    "SHAPES16",
    "export_source_tensors",
    "llama_config",
    "make_weights",
    "mixed_families",
    "byte_llama_config",
    "write_byte_llama",
    "write_byte_tokenizer",
    "write_checkpoint",
]

SHAPES = {
    "self_attn.q_proj": (32, 24),
    "self_attn.k_proj": (8, 24),
    "self_attn.v_proj": (8, 24),
    "self_attn.o_proj": (24, 32),
    "mlp.gate_proj": (40, 24),
    "mlp.up_proj": (40, 24),
    "mlp.down_proj": (24, 40),
}

#: Like :data:`SHAPES` with every input dimension a multiple of 16 (one NVFP4 block), for the
#: 4-bit ``W0`` tests.
SHAPES16 = {
    "self_attn.q_proj": (32, 32),
    "self_attn.k_proj": (16, 32),
    "self_attn.v_proj": (16, 32),
    "self_attn.o_proj": (32, 32),
    "mlp.gate_proj": (48, 32),
    "mlp.up_proj": (48, 32),
    "mlp.down_proj": (32, 48),
}


def llama_config(num_layers: int = 4, **overrides: object) -> dict[str, object]:
    """A ``LlamaForCausalLM`` ``config.json`` for :data:`SHAPES` (hidden 24, 4 query heads and
    1 key/value head of 8, MLP 40), so the numpy forwards run :func:`make_weights`' tensors."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 24,
        "intermediate_size": 40,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "vocab_size": 16,
        "eos_token_id": 1,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        **overrides,
    }


def make_weights(
    num_layers: int = 4,
    *,
    dtype: np.dtype | type = np.float32,
    prefix: str = "model",
    seed: int = 0,
    shapes: dict[str, tuple[int, int]] = SHAPES,
) -> dict[str, np.ndarray]:
    """Correlated layers (a shared part plus noise), like a trained stack, plus non-projection keys."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for family, shape in shapes.items():
        base = rng.standard_normal(shape)
        for layer in range(num_layers):
            W = base + 0.5 * rng.standard_normal(shape)
            tensors[f"{prefix}.layers.{layer}.{family}.weight"] = W.astype(dtype)
    _add_non_projection(tensors, rng, prefix=prefix, shapes=shapes, dtype=dtype)
    return tensors


def _add_non_projection(
    tensors: dict[str, np.ndarray],
    rng: np.random.Generator,
    *,
    prefix: str,
    shapes: dict[str, tuple[int, int]],
    dtype: np.dtype | type,
) -> None:
    """Add the non-projection keys (token embedding, final norm) a checkpoint copies unchanged."""
    hidden = shapes["self_attn.q_proj"][1]
    tensors[f"{prefix}.embed_tokens.weight"] = rng.standard_normal((16, hidden)).astype(dtype)
    tensors[f"{prefix}.norm.weight"] = np.ones(hidden, dtype)


def write_checkpoint(directory: Path, tensors: dict[str, np.ndarray], *, shards: int = 1) -> Path:
    """Write ``tensors`` as a Hugging Face directory, sharded with an index when ``shards > 1``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (directory / "tokenizer.json").write_text("{}")
    keys = sorted(tensors)
    if shards == 1:
        safetensors.numpy.save_file(
            {k: np.ascontiguousarray(tensors[k]) for k in keys}, directory / "model.safetensors"
        )
        return directory
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: np.ascontiguousarray(tensors[k]) for k in keys[i::shards]}
        safetensors.numpy.save_file(part, directory / name)
        weight_map.update(dict.fromkeys(part, name))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return directory


def make_structured_weights(
    num_layers: int = 8,
    *,
    kind: str = "shared",
    rank: int = 4,
    noise: float = 0.05,
    dtype: np.dtype | type = np.float32,
    prefix: str = "model",
    seed: int = 0,
    shapes: dict[str, tuple[int, int]] = SHAPES,
) -> dict[str, np.ndarray]:
    """Layers with a known structure, to check which form a global budget picks.

    ``kind``: ``"shared"`` (one dense matrix shared by every layer, plus noise: banded wins),
    ``"subspace"`` (``A_l B^T`` with ``B [in, rank]`` shared by every layer, plus noise: a
    shared basis on the input side wins), ``"independent"`` (``A_l B_l^T`` of rank ``rank``,
    unrelated across layers, plus noise: per-layer low rank wins). Also writes the
    non-projection keys of :func:`make_weights`.
    """
    if kind not in ("shared", "subspace", "independent"):
        raise ValueError(f"kind must be 'shared', 'subspace' or 'independent', got {kind!r}")
    rng = np.random.default_rng(seed)
    tensors: dict[str, np.ndarray] = {}
    for family, (out_dim, in_dim) in shapes.items():
        base = rng.standard_normal((out_dim, in_dim))
        basis = rng.standard_normal((in_dim, rank))
        for layer in range(num_layers):
            if kind == "shared":
                W = base.copy()
            elif kind == "subspace":
                W = rng.standard_normal((out_dim, rank)) @ basis.T
            else:
                W = rng.standard_normal((out_dim, rank)) @ rng.standard_normal((in_dim, rank)).T
            W /= np.sqrt(rank if kind != "shared" else 1.0)
            W += noise * rng.standard_normal((out_dim, in_dim))
            tensors[f"{prefix}.layers.{layer}.{family}.weight"] = W.astype(dtype)
    _add_non_projection(tensors, rng, prefix=prefix, shapes=shapes, dtype=dtype)
    return tensors


def family_weights(tensors: dict[str, np.ndarray]) -> dict[str, list[np.ndarray]]:
    """Group ``<stack>.<layer>.<family>.weight`` tensors into per-family lists, in layer order."""
    from .io import parse_projection_key

    found: dict[str, dict[int, np.ndarray]] = {}
    for key, array in tensors.items():
        parsed = parse_projection_key(key)
        if parsed is not None:
            _, layer, family = parsed
            found.setdefault(family, {})[layer] = array
    return {f: [layers[i] for i in sorted(layers)] for f, layers in found.items()}


def write_byte_tokenizer(directory: Path, specials: list[str], **tokenizer_config: object) -> None:
    """Write a byte-level BPE with no merges (ids 0-255: one per byte, then ``specials``) as
    ``tokenizer.json``, and ``tokenizer_config.json`` with ``tokenizer_config`` (bos/eos
    tokens, ``model_max_length`` ...) for ``PreTrainedTokenizerFast``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(Path(directory) / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **tokenizer_config}
    (Path(directory) / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def byte_llama_config(
    num_layers: int,
    vocab: int = 257,
    *,
    shapes: dict[str, tuple[int, int]] = SHAPES,
    max_positions: int = 64,
) -> dict[str, object]:
    """The ``config.json`` of :func:`write_byte_llama`'s model (head dim 8, as :data:`SHAPES`)."""
    q_out, hidden = shapes["self_attn.q_proj"]
    return llama_config(
        num_layers,
        hidden_size=hidden,
        intermediate_size=shapes["mlp.gate_proj"][0],
        num_attention_heads=q_out // 8,
        num_key_value_heads=shapes["self_attn.k_proj"][0] // 8,
        vocab_size=vocab,
        eos_token_id=256,
        max_position_embeddings=max_positions,
    )


def write_byte_llama(
    directory: Path,
    num_layers: int,
    vocab: int = 257,
    *,
    shapes: dict[str, tuple[int, int]] = SHAPES,
    max_positions: int = 64,
) -> dict[str, object]:
    """Write a servable tiny Llama of ``shapes`` to ``directory``; return its config.

    Its weights are :func:`make_weights`' scaled to unit gain, with norms of ones, a random
    embedding and head, and :func:`write_byte_tokenizer`'s byte-level tokenizer (``<eos>``
    is id 256). Every numpy forward can score text with it; with :data:`SHAPES16` every
    4-bit form fits it too."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    config = byte_llama_config(num_layers, vocab, shapes=shapes, max_positions=max_positions)
    hidden = int(config["hidden_size"])
    rng = np.random.default_rng(0)
    state = {
        k: (v / math.sqrt(v.shape[-1]) if v.ndim == 2 else v)
        for k, v in make_weights(num_layers, shapes=shapes).items()
    }
    for layer in range(num_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"model.layers.{layer}.{norm}.weight"] = np.ones(hidden, np.float32)
    state["model.embed_tokens.weight"] = rng.standard_normal((vocab, hidden)).astype(np.float32)
    state["lm_head.weight"] = (rng.standard_normal((vocab, hidden)) / 3).astype(np.float32)
    safetensors.numpy.save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    write_byte_tokenizer(directory, ["<eos>"], eos_token="<eos>")
    return config


#: The projections of :func:`mixed_families` (hidden 32, q 48, k/v 16, MLP 64), three layers.
MIXED_SHAPES = {
    "self_attn.q_proj": (48, 32),
    "self_attn.k_proj": (16, 32),
    "self_attn.v_proj": (16, 32),
    "self_attn.o_proj": (32, 48),
    "mlp.gate_proj": (64, 32),
    "mlp.up_proj": (64, 32),
    "mlp.down_proj": (32, 64),
}


def mixed_families(seed: int = 11) -> dict[str, Any]:
    """Every form the GEMM path serves, on :data:`MIXED_SHAPES` over three layers (fixed seed).

    q: low rank, ranks 3, 5, 2; k: low rank, ranks 2, 12 (served dense: ``12 (16 + 32) >= 16 *
    32``), 0 (zero); v: shared basis on the output side, one band; so q/k/v stack their first
    matmul in layers 0 and 1 (fused) and run alone in layer 2. o: shared basis on the input
    side, bands of widths 4 and 0 (served as 1 zero column). gate/up: banded, ``G = 2``, with
    per-layer ranks (gate 2, 4, 0; up 3, 1, 2), fused into one band weight; down: banded ``G = 1``.
    attnquant-max's layer graph runs them; attnquant-core's tests check their in-graph tensors.
    """
    from .forms import FamilyTheta, LayerTheta, LowRankFamily, SharedBasisFamily

    rng = np.random.default_rng(seed)

    def a(*shape: int) -> np.ndarray:
        return rng.normal(0.0, shape[0] ** -0.5, shape).astype(np.float32)

    def lowrank(name: str, ranks: tuple[int, ...]) -> LowRankFamily:
        o, i = MIXED_SHAPES[name]
        return LowRankFamily(name=name, U=[a(o, r) for r in ranks], V=[a(i, r) for r in ranks])

    def basis(name: str, side: str, widths: tuple[int, ...], bands: tuple[int, ...]) -> Any:
        o, i = MIXED_SHAPES[name]
        dim, coef = (i, o) if side == "in" else (o, i)
        return SharedBasisFamily(
            name=name,
            side=side,  # type: ignore[arg-type]
            bases=[a(dim, k) for k in widths],
            bands=bands,
            coefs=[a(coef, widths[b]) for b in bands],
        )

    def banded(name: str, ranks: tuple[int, ...], bands: tuple[int, ...]) -> FamilyTheta:
        o, i = MIXED_SHAPES[name]
        return FamilyTheta(
            name=name,
            shared=[a(o, i) for _ in range(max(bands) + 1)],
            bands=bands,
            layers=[
                LayerTheta(
                    s=(1 + 0.1 * rng.normal(size=o)).astype(np.float32), U=a(o, r), V=a(i, r)
                )
                for r in ranks
            ],
        )

    return {
        "self_attn.q_proj": lowrank("self_attn.q_proj", (3, 5, 2)),
        "self_attn.k_proj": lowrank("self_attn.k_proj", (2, 12, 0)),
        "self_attn.v_proj": basis("self_attn.v_proj", "out", (3,), (0, 0, 0)),
        "self_attn.o_proj": basis("self_attn.o_proj", "in", (4, 0), (0, 0, 1)),
        "mlp.gate_proj": banded("mlp.gate_proj", (2, 4, 0), (0, 0, 1)),
        "mlp.up_proj": banded("mlp.up_proj", (3, 1, 2), (0, 0, 1)),
        "mlp.down_proj": banded("mlp.down_proj", (4, 4, 4), (0, 0, 0)),
    }


#: The dense checkpoint the NVFP4 export tests write (core's writer, MAX's reader): every
#: inner dimension a multiple of 16, q and o of different widths, and an untied head.
EXPORT_LAYERS = 3
EXPORT_SHAPES = {
    "self_attn.q_proj": (64, 32),
    "self_attn.k_proj": (16, 32),
    "self_attn.v_proj": (16, 32),
    "self_attn.o_proj": (32, 64),
    "mlp.gate_proj": (48, 32),
    "mlp.up_proj": (48, 32),
    "mlp.down_proj": (32, 48),
}


def export_source_tensors(dtype: np.dtype | type = np.float32) -> dict[str, np.ndarray]:
    """The tensors of the export tests' dense checkpoint (:data:`EXPORT_SHAPES`, a 16x32 head)."""
    tensors = make_weights(EXPORT_LAYERS, shapes=EXPORT_SHAPES, dtype=dtype, seed=3)
    tensors["lm_head.weight"] = np.random.default_rng(4).standard_normal((16, 32)).astype(dtype)
    return tensors
