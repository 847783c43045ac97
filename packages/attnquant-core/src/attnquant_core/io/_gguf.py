"""A GGUF file (llama.cpp's format) as a float32 Hugging Face checkpoint, and back.

:func:`import_gguf` reads a GGUF of a Llama, Mistral, Qwen2, Qwen3 or Gemma 3 text model with the
``gguf`` package, dequantizes every tensor to float32 (F32, F16, BF16, Q4_0 to Q8_0, the K-quants,
the IQ types: whatever ``gguf.quants`` decodes), undoes what llama.cpp's converter did to the
weights (the q/k row order of Llama's RoPE, Gemma's ``1 + w`` norms) and writes a Hugging Face
directory: ``config.json``, ``model.safetensors`` (with attnquant's digests), ``tokenizer.json``
and ``tokenizer_config.json`` (with the chat template) built with ``tokenizers``, and
:data:`SOURCE_FILE`, which records each tensor's GGUF type. A quantized GGUF's dequantized model
is then the reference: quality measured against it says so (:func:`gguf_source`).

:func:`export_gguf` writes a Hugging Face Llama checkpoint as a float32 GGUF, as llama.cpp's
``convert_hf_to_gguf.py`` lays it out (it needs torch; this does not), so llama.cpp's own tools
can quantize the very weights attnquant compresses, and an import round-trips. No torch anywhere.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import CheckpointError
from ._atomic import atomic_directory
from ._safetensors import PlannedWriter, TensorSpec

__all__ = [
    "GGUF_ARCHITECTURES",
    "GGUFError",
    "ImportProgress",
    "SOURCE_FILE",
    "dequantize_gguf",
    "export_gguf",
    "gguf_source",
    "gguf_state",
    "import_gguf",
    "permute_rope",
]

#: What an imported checkpoint records of its GGUF: file, digest, each tensor's GGUF type.
SOURCE_FILE = "attnquant.gguf-source.json"
_SOURCE_FORMAT = "attnquant-gguf-source"

#: GGUF ``general.architecture`` -> the Hugging Face architecture it is imported as. Mistral's
#: text models are written by llama.cpp as ``llama``.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

# llama.cpp's block tensor names -> Hugging Face module names (the suffix, .weight or .bias, kept).
_BLOCK = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "ffn_norm": "post_attention_layernorm",
}
# Gemma's four norms a layer: llama.cpp's ffn_norm is Gemma's pre-feedforward norm.
_GEMMA_BLOCK = {
    **_BLOCK,
    "ffn_norm": "pre_feedforward_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_SUFFIXES = ("weight", "bias")

#: GGUF ``tokenizer.ggml.pre`` of a ``gpt2`` (byte-level BPE) vocabulary -> the split before the
#: byte-level mapping, as llama.cpp's ``llama-vocab.cpp`` splits (``None``: GPT-2's own regex).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_BPE_PRE = {
    "default": ("gpt2", False),
    "gpt-2": ("gpt2", False),
    "smollm": ("gpt2", True),  # every digit its own word, then GPT-2's split
    "starcoder": ("gpt2", True),
    "llama-bpe": (_LLAMA3_SPLIT, False),
    "llama3": (_LLAMA3_SPLIT, False),
    "qwen2": (_QWEN2_SPLIT, False),
    "tekken": (_TEKKEN_SPLIT, False),
}

# gguf's TokenType values (stable across gguf releases).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6


class GGUFError(CheckpointError):
    """A GGUF file attnquant cannot import: unreadable, an architecture, tensor or vocabulary it
    does not know."""


@dataclass(frozen=True)
class ImportProgress:
    """One tensor of :func:`import_gguf` done: its Hugging Face key, GGUF type, count so far."""

    key: str
    gguf_type: str
    done: int
    total: int


def _gguf() -> Any:
    try:
        import gguf
    except ImportError as exc:  # pragma: no cover - the extra is installed in every env we test
        raise GGUFError(
            "reading GGUF files needs the gguf package: pip install 'attnquant-core[gguf]'"
        ) from exc
    return gguf


def permute_rope(W: np.ndarray, heads: int, *, inverse: bool = False) -> np.ndarray:
    """llama.cpp's q/k row order for Llama: per head, the half-split RoPE pairs of Hugging Face
    interleaved (``inverse``: back to Hugging Face's order)."""
    rows = W.shape[0]
    if rows % (2 * heads):
        raise GGUFError(f"{rows} rows do not split into {heads} heads of RoPE pairs")
    if inverse:
        return W.reshape(heads, rows // heads // 2, 2, -1).swapaxes(1, 2).reshape(W.shape)
    return W.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(W.shape)


class _Fields:
    """A GGUF's metadata by name, with errors that name the file and the key."""

    def __init__(self, reader: Any, path: Path) -> None:
        self._fields = dict(reader.fields)
        self.path = path

    def __contains__(self, name: str) -> bool:
        return name in self._fields

    def get(self, name: str, default: Any = None) -> Any:
        field = self._fields.get(name)
        if field is None:
            return default
        value = field.contents()
        return value

    def need(self, name: str) -> Any:
        if name not in self._fields:
            raise GGUFError(f"{self.path}: metadata {name!r} missing")
        return self.get(name)


def _hf_key(name: str, arch: str) -> str:
    """The Hugging Face key of a llama.cpp tensor name, or a :class:`GGUFError` naming it."""
    parts = name.split(".")
    block = _GEMMA_BLOCK if arch == "gemma3" else _BLOCK
    if len(parts) == 4 and parts[0] == "blk" and parts[3] in _SUFFIXES and parts[2] in block:
        return f"model.layers.{int(parts[1])}.{block[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP and parts[1] in _SUFFIXES:
        return f"{_TOP[parts[0]]}.{parts[1]}"
    raise GGUFError(f"tensor {name!r} has no Hugging Face name in a {arch} model")


def _config(fields: _Fields, arch: str, n_vocab: int, tied: bool, shapes: Mapping) -> dict:
    """The Hugging Face ``config.json`` of the GGUF's hyperparameters."""
    p = f"{arch}."
    hidden = int(fields.need(p + "embedding_length"))
    heads = int(fields.need(p + "attention.head_count"))
    kv = fields.get(p + "attention.head_count_kv", heads)
    if not np.isscalar(kv) and len(set(kv)) != 1:
        raise GGUFError(f"{fields.path}: per-layer KV head counts {list(kv)} are not imported")
    kv_heads = int(kv if np.isscalar(kv) else kv[0])
    head_dim = int(fields.get(p + "attention.key_length", hidden // heads))
    layers = int(fields.need(p + "block_count"))
    inter = fields.need(p + "feed_forward_length")
    inter = int(inter if np.isscalar(inter) else inter[0])
    rope_dims = fields.get(p + "rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise GGUFError(
            f"{fields.path}: RoPE on {rope_dims} of {head_dim} head dimensions (partial rotary) "
            f"is not imported"
        )
    scaling = fields.get(p + "rope.scaling.type")
    # GGUF keeps float32: 1e-6 reads back as 9.99999997e-07; the shortest float32 repr is 1e-06
    eps = float(f"{float(fields.get(p + 'attention.layer_norm_rms_epsilon', 1e-6)):.7g}")
    ctx = int(fields.get(p + "context_length", 2048))
    ids = {
        "bos_token_id": fields.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": fields.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": fields.get("tokenizer.ggml.padding_token_id"),
    }
    ids = {k: (int(v) if v is not None else None) for k, v in ids.items()}
    base = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        **ids,
        "head_dim": head_dim,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "max_position_embeddings": ctx,
        "num_attention_heads": heads,
        "num_hidden_layers": layers,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": eps,
        "tie_word_embeddings": tied,
        "vocab_size": n_vocab,
        "torch_dtype": "float32",
    }
    theta = float(f"{float(fields.get(p + 'rope.freq_base', 10_000.0)):.7g}")
    if arch == "gemma3":
        if scaling not in (None, "none", "linear"):
            raise GGUFError(f"{fields.path}: Gemma 3 RoPE scaling {scaling!r} is not imported")
        from ..tiny_gemma import gemma3_text_config

        window = fields.get(p + "attention.sliding_window")
        # llama.cpp: every 6th layer global where a window is set; the local RoPE base 10,000
        # unless the file says; queries scaled by 1/sqrt(head_dim), hidden/heads at 27B.
        pattern = 6 if window else 1
        scalar = hidden // heads if (layers, hidden) == (62, 5376) else head_dim
        cfg = gemma3_text_config(
            vocab_size=n_vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            sliding_window=int(window or ctx),
            sliding_window_pattern=pattern,
            max_position_embeddings=ctx,
            query_pre_attn_scalar=scalar,
            rope_theta=theta,
            rope_local_base_freq=float(fields.get(p + "rope.freq_base_swa", 10_000.0)),
            final_logit_softcapping=fields.get(p + "final_logit_softcapping"),
            rms_norm_eps=eps,
            **{k: v for k, v in ids.items() if v is not None},
        )
        if scaling == "linear":
            factor = float(fields.need(p + "rope.scaling.factor"))
            cfg["rope_parameters"]["full_attention"].update(rope_type="linear", factor=factor)
            cfg["rope_scaling"] = {"rope_type": "linear", "factor": factor}
        cfg["architectures"] = [GGUF_ARCHITECTURES[arch]]
        cfg["tie_word_embeddings"] = tied
        cfg["torch_dtype"] = "float32"
        return cfg
    if scaling not in (None, "none"):
        raise GGUFError(f"{fields.path}: RoPE scaling {scaling!r} is not imported")
    model_type = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}[arch]
    cfg = {
        **base,
        "model_type": model_type,
        "hidden_act": "silu",
        "rope_theta": theta,
        "attention_bias": any(k.endswith("self_attn.q_proj.bias") for k in shapes),
        "mlp_bias": False,
    }
    window = fields.get(p + "attention.sliding_window")
    if window:
        cfg["sliding_window"] = int(window)
    if arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = bool(window)
        cfg["sliding_window"] = int(window) if window else None
    return cfg


# --- the tokenizer ----------------------------------------------------------------------------


def _tokens(fields: _Fields) -> tuple[list[str], list[int], list[float] | None]:
    tokens = [str(t) for t in fields.need("tokenizer.ggml.tokens")]
    types = fields.get("tokenizer.ggml.token_type")
    types = [int(t) for t in types] if types is not None else [_NORMAL] * len(tokens)
    scores = fields.get("tokenizer.ggml.scores")
    return tokens, types, ([float(s) for s in scores] if scores is not None else None)


def _added(tokens: list[str], types: list[int], normalized: bool) -> list[dict]:
    """The control and user-defined tokens, split out of text before the model sees it, as
    llama.cpp's ``tokenizer_st_partition`` does."""
    return [
        {
            "id": i,
            "content": text,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": normalized and t != _CONTROL,
            "special": t == _CONTROL,
        }
        for i, (text, t) in enumerate(zip(tokens, types, strict=True))
        if t in (_CONTROL, _USER_DEFINED)
    ]


def _bos_processor(fields: _Fields, tokens: list[str]) -> dict | None:
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
    bos, eos = fields.get("tokenizer.ggml.bos_token_id"), fields.get("tokenizer.ggml.eos_token_id")
    single, pair, special = [], [], {}
    if add_bos and bos is not None:
        single.append({"SpecialToken": {"id": tokens[int(bos)], "type_id": 0}})
        special[tokens[int(bos)]] = {
            "id": tokens[int(bos)],
            "ids": [int(bos)],
            "tokens": [tokens[int(bos)]],
        }
    single.append({"Sequence": {"id": "A", "type_id": 0}})
    if add_eos and eos is not None:
        single.append({"SpecialToken": {"id": tokens[int(eos)], "type_id": 0}})
        special[tokens[int(eos)]] = {
            "id": tokens[int(eos)],
            "ids": [int(eos)],
            "tokens": [tokens[int(eos)]],
        }
    if not special:
        return None
    pair = [
        *single,
        *[{"Sequence": {"id": "B", "type_id": 1}} if "Sequence" in s else s for s in single],
    ]
    return {"type": "TemplateProcessing", "single": single, "pair": pair, "special_tokens": special}


def _bpe_tokenizer(fields: _Fields) -> dict:
    """A ``gpt2`` (byte-level BPE) vocabulary as a ``tokenizers`` BPE model."""
    tokens, types, _ = _tokens(fields)
    merges = [str(m) for m in fields.get("tokenizer.ggml.merges", [])]
    pre = str(fields.get("tokenizer.ggml.pre", "default"))
    if pre not in _BPE_PRE:
        raise GGUFError(
            f"{fields.path}: pre-tokenizer {pre!r} is not imported (known: {', '.join(sorted(_BPE_PRE))})"
        )
    split, digits = _BPE_PRE[pre]
    steps: list[dict] = []
    if digits:
        steps.append({"type": "Digits", "individual_digits": True})
    if split == "gpt2":
        steps.append(
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": True,
                "use_regex": True,
            }
        )
    else:
        steps.append(
            {"type": "Split", "pattern": {"Regex": split}, "behavior": "Isolated", "invert": False}
        )
        steps.append(
            {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": False,
                "use_regex": False,
            }
        )
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added(tokens, types, normalized=False),
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": steps},
        "post_processor": _bos_processor(fields, tokens),
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }


def _spm_merges(tokens: list[str], types: list[int], scores: list[float]) -> list[str]:
    """Merges that make a BPE model tokenize as SentencePiece's BPE does (and llama.cpp's SPM
    tokenizer): every split of a token into two tokens, ranked by the merged token's score
    (highest first), so the best-scoring adjacent pair is always merged next."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] not in (_CONTROL, _BYTE)}
    found: list[tuple[float, int, int, str, str]] = []
    for text, i in vocab.items():
        if types[i] == _USER_DEFINED:
            continue  # split out of the text before the model (added tokens), never merged
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in vocab and right in vocab:
                found.append((-scores[i], i, cut, left, right))
    found.sort()
    return [f"{left} {right}" for _, _, _, left, right in found]


def _spm_tokenizer(fields: _Fields) -> dict:
    """A ``llama`` (SentencePiece BPE) vocabulary as a ``tokenizers`` BPE model with byte
    fallback: spaces as ``▁``, a prefix space only where the file asks (Gemma 3 asks none)."""
    tokens, types, scores = _tokens(fields)
    if scores is None:
        raise GGUFError(f"{fields.path}: a 'llama' vocabulary without tokenizer.ggml.scores")
    if any(t == " " for t in tokens):
        raise GGUFError(f"{fields.path}: a SentencePiece vocabulary holding a bare space")
    prefix = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    normalizer: list[dict] = []
    if prefix:
        normalizer.append({"type": "Prepend", "prepend": "▁"})
    normalizer.append({"type": "Replace", "pattern": {"String": " "}, "content": "▁"})
    decoder: list[dict] = [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
    ]
    if prefix:
        decoder.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
    unk = fields.get("tokenizer.ggml.unknown_token_id")
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": _added(tokens, types, normalized=False),
        "normalizer": {"type": "Sequence", "normalizers": normalizer},
        "pre_tokenizer": None,
        "post_processor": _bos_processor(fields, tokens),
        "decoder": {"type": "Sequence", "decoders": decoder},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": tokens[int(unk)] if unk is not None else None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": True,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": _spm_merges(tokens, types, scores),
        },
    }


def _tokenizer_files(fields: _Fields, config: Mapping) -> dict[str, str]:
    """``tokenizer.json`` and ``tokenizer_config.json`` of the GGUF's vocabulary, as text."""
    model = str(fields.need("tokenizer.ggml.model"))
    if model == "gpt2":
        spec = _bpe_tokenizer(fields)
    elif model == "llama":
        spec = _spm_tokenizer(fields)
    else:
        raise GGUFError(f"{fields.path}: tokenizer model {model!r} is not imported (gpt2, llama)")
    from tokenizers import Tokenizer

    text = json.dumps(spec, ensure_ascii=False)
    try:
        Tokenizer.from_str(text)  # what tokenizers cannot load must not be written
    except Exception as exc:
        raise GGUFError(
            f"{fields.path}: the vocabulary does not build a tokenizer ({exc})"
        ) from exc
    tokens = spec["model"]["vocab"]
    names = {v: k for k, v in tokens.items()}

    def name(key: str) -> str | None:
        i = config.get(key)
        return names.get(i) if i is not None else None

    tok_config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": name("bos_token_id"),
        "eos_token": name("eos_token_id"),
        "pad_token": name("pad_token_id"),
        "unk_token": names.get(fields.get("tokenizer.ggml.unknown_token_id")),
        "add_bos_token": bool(fields.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(fields.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(config["max_position_embeddings"]),
    }
    template = fields.get("tokenizer.chat_template")
    if template:
        tok_config["chat_template"] = str(template)
    return {
        "tokenizer.json": text,
        "tokenizer_config.json": json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n",
    }


# --- import ----------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _layer_order(key: str) -> tuple[int, str]:
    parts = key.split(".")
    return (int(parts[2]) if parts[1] == "layers" else (-1 if "embed" in key else 1 << 30), key)


@dataclass
class _Source:
    """An opened GGUF: its reader, metadata, architecture, and tensors by Hugging Face key."""

    path: Path
    reader: Any
    fields: _Fields
    arch: str
    heads: int
    kv_heads: int
    tensors: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    types: dict[str, str]

    def decode(self, key: str) -> np.ndarray:
        """Tensor ``key`` in float32, in Hugging Face's layout (q/k rows, Gemma's norms)."""
        gguf = _gguf()
        t = self.tensors[key]
        try:
            W = gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError as exc:
            raise GGUFError(f"{self.path}: {t.name}: GGUF type {self.types[key]} ({exc})") from exc
        W = np.asarray(W, dtype=np.float32).reshape(self.shapes[key])
        if self.arch == "llama" and key.endswith(("q_proj.weight", "q_proj.bias")):
            W = permute_rope(W, self.heads, inverse=True)
        elif self.arch == "llama" and key.endswith(("k_proj.weight", "k_proj.bias")):
            W = permute_rope(W, self.kv_heads, inverse=True)
        if self.arch == "gemma3" and key.endswith("norm.weight"):
            W = W - np.float32(1.0)  # llama.cpp stores Gemma's 1 + w
        return np.ascontiguousarray(W, dtype=np.float32)


def _open(path: Path) -> _Source:
    gguf = _gguf()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as exc:
        raise GGUFError(f"{path}: not a GGUF file gguf can read ({exc})") from exc
    fields = _Fields(reader, path)
    arch = str(fields.need("general.architecture"))
    if arch not in GGUF_ARCHITECTURES:
        raise GGUFError(
            f"{path}: architecture {arch!r} is not imported (known: {', '.join(GGUF_ARCHITECTURES)})"
        )
    heads = int(fields.need(f"{arch}.attention.head_count"))
    kv = fields.get(f"{arch}.attention.head_count_kv", heads)
    kv_heads = int(kv if np.isscalar(kv) else kv[0])
    infos: dict[str, Any] = {}
    for t in reader.tensors:
        if t.name == "rope_freqs.weight":
            raise GGUFError(
                f"{path}: rope_freqs.weight (Llama 3.1-style RoPE scaling) is not imported"
            )
        key = _hf_key(t.name, arch)
        if key in infos:
            raise GGUFError(f"{path}: tensor {t.name!r} appears twice")
        infos[key] = t
    if "model.embed_tokens.weight" not in infos:
        raise GGUFError(f"{path}: no token_embd.weight")
    order = sorted(infos, key=_layer_order)
    return _Source(
        path=path,
        reader=reader,
        fields=fields,
        arch=arch,
        heads=heads,
        kv_heads=kv_heads,
        tensors={k: infos[k] for k in order},
        shapes={k: tuple(int(d) for d in reversed(infos[k].shape)) for k in order},
        types={k: gguf.GGMLQuantizationType(int(infos[k].tensor_type)).name for k in order},
    )


def gguf_state(path: Path) -> tuple[dict[str, np.ndarray], dict[str, int], dict[str, str]]:
    """A GGUF's tensors dequantized to float32 under their Hugging Face keys (as
    :func:`import_gguf` writes them), the bytes each holds in the file (what its bits per weight
    are counted from), and each one's GGUF type."""
    src = _open(path)
    state = {key: src.decode(key) for key in src.tensors}
    sizes = {key: int(t.n_bytes) for key, t in src.tensors.items()}
    return state, sizes, dict(src.types)


def dequantize_gguf(path: Path, out: Path) -> Path:
    """Write the GGUF ``path`` again with every tensor in float32 (same metadata, names and
    layout), so llama.cpp's own tools quantize exactly the model :func:`import_gguf` imports."""
    gguf = _gguf()
    src = _open(path)
    out = Path(out)
    tmp = out.with_name(f".tmp-{out.name}")
    try:
        writer = gguf.GGUFWriter(str(tmp), src.arch)
        for field in src.reader.fields.values():
            if field.name.startswith("GGUF.") or field.name == "general.architecture":
                continue
            value = field.contents()
            if field.name == "general.file_type":
                value = int(gguf.LlamaFileType.ALL_F32)
            writer.add_key_value(field.name, value, field.types[0], field.types[-1])
        for t in src.reader.tensors:
            W = gguf.quants.dequantize(t.data, t.tensor_type)
            W = np.asarray(W, np.float32).reshape([int(d) for d in reversed(t.shape)])
            writer.add_tensor(t.name, np.ascontiguousarray(W))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def import_gguf(
    path: Path,
    out: Path,
    *,
    overwrite: bool = False,
    progress: Callable[[ImportProgress], None] | None = None,
) -> dict[str, Any]:
    """Write the GGUF ``path`` as a float32 Hugging Face checkpoint ``out`` (atomically: a
    failure leaves nothing at ``out``); returns a summary (architecture, tensor counts by GGUF
    type, the quantized keys, bytes)."""
    src = _open(path)
    path = src.path
    tied = "lm_head.weight" not in src.tensors
    n_vocab = src.shapes["model.embed_tokens.weight"][0]
    config = _config(src.fields, src.arch, n_vocab, tied, src.shapes)
    side = _tokenizer_files(src.fields, config)
    types = src.types
    unquantized = {"F32", "F64"}
    record = {
        "format": _SOURCE_FORMAT,
        "version": 1,
        "source": path.name,
        "sha256": _sha256(path),
        "architecture": src.arch,
        "file_type": src.fields.get("general.file_type"),
        "name": src.fields.get("general.name"),
        "tensors": dict(types),
        "quantized": sorted(k for k, t in types.items() if t not in unquantized),
        "note": (
            "every tensor dequantized to float32; where the GGUF was quantized, this checkpoint "
            "(not the model the GGUF was made from) is the reference"
        ),
    }
    specs = {k: TensorSpec(np.dtype(np.float32), src.shapes[k]) for k in src.tensors}
    total = len(specs)
    with atomic_directory(out, overwrite) as tmp:
        with PlannedWriter(tmp, specs, metadata={"format": "pt"}) as writer:
            for done, key in enumerate(specs, start=1):
                writer.write(key, src.decode(key))
                if progress is not None:
                    progress(ImportProgress(key, types[key], done, total))
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        gen = {
            k: config[k]
            for k in ("bos_token_id", "eos_token_id", "pad_token_id")
            if config.get(k) is not None
        }
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        for name, text in side.items():
            (tmp / name).write_text(text, encoding="utf-8")
        (tmp / SOURCE_FILE).write_text(json.dumps(record, indent=1) + "\n")
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t] = counts.get(t, 0) + 1
    return {
        "architecture": src.arch,
        "hf_architecture": GGUF_ARCHITECTURES[src.arch],
        "tensors": total,
        "types": dict(sorted(counts.items())),
        "quantized": len(record["quantized"]),
        "float32_bytes": sum(s.nbytes for s in specs.values()),
        "gguf_bytes": path.stat().st_size,
    }


def gguf_source(checkpoint: Path) -> dict[str, Any] | None:
    """What an imported checkpoint records of its GGUF (:data:`SOURCE_FILE`), or ``None``."""
    file = Path(checkpoint) / SOURCE_FILE
    if not file.is_file():
        return None
    record = json.loads(file.read_text())
    if record.get("format") != _SOURCE_FORMAT:
        raise GGUFError(f"{file}: not an attnquant GGUF source record")
    return record


# --- export (a Hugging Face Llama as a float32 GGUF) ------------------------------------------


def _hf_tensors(checkpoint: Path) -> Iterable[tuple[str, np.ndarray]]:
    from safetensors import safe_open

    index = checkpoint / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values()))
        if index.exists()
        else ["model.safetensors"]
    )
    for name in files:
        with safe_open(checkpoint / name, "numpy") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


def _gguf_name(key: str) -> str:
    top = {f"{v}.{s}": f"{k}.{s}" for k, v in _TOP.items() for s in _SUFFIXES}
    if key in top:
        return top[key]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", key)
    inverse = {v: k for k, v in _BLOCK.items()}
    if m is None or m.group(2) not in inverse:
        raise GGUFError(f"{key}: no llama.cpp name for this Llama tensor")
    return f"blk.{m.group(1)}.{inverse[m.group(2)]}.{m.group(3)}"


def export_gguf(checkpoint: Path, out: Path) -> Path:
    """Write a Hugging Face Llama ``checkpoint`` as a float32 GGUF with its byte-level BPE
    tokenizer, laid out as llama.cpp's ``convert_hf_to_gguf.py`` lays it out: the
    hyperparameters, the ``gpt2`` vocabulary with merges and special ids, q/k rows in llama.cpp's
    RoPE order. Written under a temporary name and renamed, so a failure leaves no GGUF."""
    gguf = _gguf()
    checkpoint, out = Path(checkpoint), Path(out)
    cfg = json.loads((checkpoint / "config.json").read_text())
    if cfg.get("model_type", "llama") not in ("llama", "mistral"):
        raise GGUFError(f"{checkpoint}: export_gguf writes Llama models, not {cfg['model_type']!r}")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tmp = out.with_name(f".tmp-{out.name}")
    try:
        writer = gguf.GGUFWriter(str(tmp), "llama")
        writer.add_name(checkpoint.name)
        writer.add_context_length(cfg["max_position_embeddings"])
        writer.add_embedding_length(cfg["hidden_size"])
        writer.add_block_count(cfg["num_hidden_layers"])
        writer.add_feed_forward_length(cfg["intermediate_size"])
        writer.add_head_count(heads)
        writer.add_head_count_kv(kv_heads)
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        writer.add_rope_dimension_count(head_dim)
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        writer.add_rope_freq_base(cfg.get("rope_theta", 10_000.0))
        writer.add_vocab_size(cfg["vocab_size"])
        writer.add_file_type(gguf.LlamaFileType.ALL_F32)
        _export_tokenizer(writer, checkpoint, cfg)
        tensors = dict(_hf_tensors(checkpoint))
        if cfg.get("tie_word_embeddings") and "lm_head.weight" in tensors:
            del tensors["lm_head.weight"]
        for key in sorted(tensors, key=_layer_order):
            W = tensors[key].astype(np.float32)
            if key.endswith("q_proj.weight"):
                W = permute_rope(W, heads)
            elif key.endswith("k_proj.weight"):
                W = permute_rope(W, kv_heads)
            writer.add_tensor(_gguf_name(key), np.ascontiguousarray(W))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _export_tokenizer(writer: Any, checkpoint: Path, cfg: Mapping) -> None:
    """``tokenizer.json``'s byte-level BPE as GGUF's ``gpt2`` tokenizer (GPT-2's split)."""
    gguf = _gguf()
    tok = json.loads((checkpoint / "tokenizer.json").read_text())
    if tok["model"].get("type") != "BPE" or tok["model"].get("byte_fallback"):
        raise GGUFError(f"{checkpoint}: export_gguf writes byte-level BPE tokenizers only")
    vocab = tok["model"]["vocab"]
    special = {t["id"]: t["content"] for t in tok.get("added_tokens", []) if t.get("special")}
    size = max(cfg["vocab_size"], max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = gguf.TokenType.NORMAL
    for i, text in special.items():
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for key, add in (
        ("bos_token_id", writer.add_bos_token_id),
        ("eos_token_id", writer.add_eos_token_id),
        ("pad_token_id", writer.add_pad_token_id),
    ):
        if cfg.get(key) is not None:
            add(cfg[key])
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
