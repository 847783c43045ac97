"""A GGUF's vocabulary as ``tokenizers`` files (``tokenizer.json``, ``tokenizer_config.json``),
and a ``tokenizer.json`` byte-level BPE as a GGUF vocabulary: the tokenizer half of
:mod:`attnquant_core.io._gguf`."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ._gguf_meta import GGUFError, _Fields, _gguf

__all__: list[str] = []

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
    """A ``TemplateProcessing`` adding BOS and EOS where the file says, or ``None``."""
    ends = {}
    for end in ("bos", "eos"):
        i = fields.get(f"tokenizer.ggml.{end}_token_id")
        if fields.get(f"tokenizer.ggml.add_{end}_token", False) and i is not None:
            ends[end] = {"id": tokens[int(i)], "ids": [int(i)], "tokens": [tokens[int(i)]]}
    if not ends:
        return None

    def around(seq: str, type_id: int) -> list[dict]:
        body = [{"Sequence": {"id": seq, "type_id": type_id}}]
        bos = (
            [{"SpecialToken": {"id": ends["bos"]["id"], "type_id": type_id}}]
            if "bos" in ends
            else []
        )
        eos = (
            [{"SpecialToken": {"id": ends["eos"]["id"], "type_id": type_id}}]
            if "eos" in ends
            else []
        )
        return bos + body + eos

    return {
        "type": "TemplateProcessing",
        "single": around("A", 0),
        "pair": around("A", 0) + around("B", 1),
        "special_tokens": {e["id"]: e for e in ends.values()},
    }


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
