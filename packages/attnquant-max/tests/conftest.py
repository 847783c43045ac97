"""Fixtures: one tiny random Llama checkpoint (fixed seed, fixed shape) and its theta variants.

Every MAX test uses the one shape below, so a test run compiles one model graph
(~100 s cold on 2 cores, 1-2 s from ~/.cache/modular after).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from attnquant_core import decompose_checkpoint

# The one model shape of the test suite: do not change it without need (cold compile).
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 64, 2, 4, 2, 16, 128, 272
MAX_LENGTH, MAX_BATCH_SIZE = 64, 4
SPECIALS = ["<s>", "</s>"] + [f"<extra_{i}>" for i in range(VOCAB - 258)]

PROJECTIONS = {
    "self_attn.q_proj": (HEADS * HEAD_DIM, HIDDEN),
    "self_attn.k_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.v_proj": (KV_HEADS * HEAD_DIM, HIDDEN),
    "self_attn.o_proj": (HIDDEN, HEADS * HEAD_DIM),
    "mlp.gate_proj": (INTERMEDIATE, HIDDEN),
    "mlp.up_proj": (INTERMEDIATE, HIDDEN),
    "mlp.down_proj": (HIDDEN, INTERMEDIATE),
}


def tiny_llama_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    tensors = {
        "model.embed_tokens.weight": rng.normal(0.0, 1.0, (VOCAB, HIDDEN)),
        "model.norm.weight": np.ones(HIDDEN),
        "lm_head.weight": rng.normal(0.0, 0.3, (VOCAB, HIDDEN)),
    }
    for i in range(LAYERS):
        prefix = f"model.layers.{i}."
        tensors[prefix + "input_layernorm.weight"] = np.ones(HIDDEN)
        tensors[prefix + "post_attention_layernorm.weight"] = np.ones(HIDDEN)
        for family, shape in PROJECTIONS.items():
            tensors[prefix + family + ".weight"] = rng.normal(0.0, shape[1] ** -0.5, shape)
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()}


def write_tokenizer(directory: Path) -> None:
    """A byte-level BPE with no merges (one token per byte), padded with specials to VOCAB."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(SPECIALS)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "model_max_length": MAX_LENGTH,
            }
        )
    )


def write_tiny_llama(directory: Path, tensors: dict[str, np.ndarray] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    tensors = tiny_llama_tensors() if tensors is None else tensors
    safetensors.numpy.save_file(tensors, directory / "model.safetensors")
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "vocab_size": VOCAB,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 256,
        "eos_token_id": 257,
        "torch_dtype": "float32",
        "attention_bias": False,
        "mlp_bias": False,
    }
    (directory / "config.json").write_text(json.dumps(config, indent=1))
    write_tokenizer(directory)
    return directory


def rewrite_tensors(directory: Path, drop: str) -> None:
    """Rewrite every safetensors file of ``directory`` without the key ``drop``."""
    for file in directory.glob("*.safetensors"):
        tensors = safetensors.numpy.load_file(file)
        if drop in tensors:
            del tensors[drop]
            safetensors.numpy.save_file(tensors, file)
            return
    raise KeyError(drop)


@pytest.fixture(scope="session")
def tiny_dense(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("ckpt") / "dense")


@pytest.fixture(scope="session")
def tiny_theta(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dense checkpoint decomposed at passthrough (G = L), rank 4."""
    out = tmp_path_factory.mktemp("ckpt") / "theta"
    decompose_checkpoint(tiny_dense, out, blocks="layers", rank=4)
    return out


@pytest.fixture(scope="session")
def tiny_theta_g1(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dense checkpoint decomposed with one shared block per family, rank 8."""
    out = tmp_path_factory.mktemp("ckpt") / "theta_g1"
    decompose_checkpoint(tiny_dense, out, blocks=1, rank=8)
    return out


@pytest.fixture(scope="session")
def tiny_theta_g1_r16(tiny_dense: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One shared block per family, rank 16 (the largest the k/v shapes [32, 64] allow: 32)."""
    out = tmp_path_factory.mktemp("ckpt") / "theta_g1_r16"
    decompose_checkpoint(tiny_dense, out, blocks=1, rank=16)
    return out


def load_tiny(path: Path, config: Any = None) -> Any:
    """``load_pipeline`` of a tiny checkpoint with the suite's one length and batch size."""
    from attnquant_max import AttnquantConfig, load_pipeline

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("MAX_SERVE_DISABLE_TELEMETRY", "1")
    return load_pipeline(
        path,
        max_length=MAX_LENGTH,
        max_batch_size=MAX_BATCH_SIZE,
        config=AttnquantConfig() if config is None else config,
    )


@pytest.fixture(scope="session")
def dense_model(tiny_dense: Path) -> Iterator[Any]:
    """The dense tiny Llama, stock graph."""
    with load_tiny(tiny_dense) as model:
        yield model


@pytest.fixture(scope="session")
def theta_model(tiny_theta: Path) -> Iterator[Any]:
    """The passthrough theta checkpoint on the precompute-outside path (stock graph)."""
    with load_tiny(tiny_theta) as model:
        yield model


@pytest.fixture(scope="session")
def theta_missing_v(tiny_theta: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Passthrough theta checkpoint with ``layers.1.mlp.up_proj.theta_V`` removed."""
    out = tmp_path_factory.mktemp("ckpt") / "theta_missing_v"
    shutil.copytree(tiny_theta, out)
    rewrite_tensors(out, "model.layers.1.mlp.up_proj.theta_V")
    return out


@pytest.fixture(scope="session")
def theta_other_blocks(tiny_theta: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Passthrough theta checkpoint whose attnquant.json claims ``blocks = 1``."""
    out = tmp_path_factory.mktemp("ckpt") / "theta_other_blocks"
    shutil.copytree(tiny_theta, out)
    manifest = json.loads((out / "attnquant.json").read_text())
    manifest["blocks"] = 1
    (out / "attnquant.json").write_text(json.dumps(manifest))
    return out


@pytest.fixture(scope="session")
def dense_missing_weight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dense checkpoint without ``model.layers.1.post_attention_layernorm.weight``."""
    tensors = tiny_llama_tensors()
    del tensors["model.layers.1.post_attention_layernorm.weight"]
    return write_tiny_llama(tmp_path_factory.mktemp("ckpt") / "dense_missing", tensors)


@pytest.fixture(scope="session")
def theta_without_manifest(tiny_theta: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A theta checkpoint whose attnquant.json was lost: the stock loader would zero-fill."""
    out = tmp_path_factory.mktemp("ckpt") / "theta_no_manifest"
    shutil.copytree(tiny_theta, out)
    (out / "attnquant.json").unlink()
    return out
