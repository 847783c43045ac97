"""Corpus selection, held-out split and byte-level BPE tokenizer (no torch needed here)."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"

# Directories of the stdlib that are tests, vendored data or not Python source
# worth learning from (codec tables, generated config data, demos).
SKIP_DIRS = {
    "__pycache__",
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idle_test",
    "lib2to3",
    "encodings",
    "pydoc_data",
    "turtledemo",
    "ensurepip",
    "lib-dynload",
}
MAX_FILE_BYTES = 150_000

# Chat template for a code-completion model: a system message becomes a module
# docstring, a user turn is rendered verbatim and the assistant turn continues
# the user's text, so `max generate --prompt "def "` completes the code as a
# raw completion would; a finished assistant turn ends with <|eos|>.
# add_generation_prompt is accepted and adds nothing. (Turns rendered as
# "# user:" / "# assistant:" comments made the model print "#" lines forever:
# the stdlib files that open with comments open with licence headers.)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '\"\"\"' + message['content'] + '\"\"\"\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}"
    "{% else %}{{ message['content'] }}{% endif %}"
    "{% endfor %}"
)

#: A document: its path relative to the stdlib, and its text.
Doc = tuple[str, str]


class Specials(NamedTuple):
    """Token ids of the special tokens, as config.json and the model card name them."""

    bos: int
    eos: int
    pad: int


@dataclass(frozen=True)
class Splits:
    """The training and held-out documents, in selection order."""

    train: list[Doc]
    heldout: list[Doc]

    @property
    def train_bytes(self) -> int:
        """UTF-8 size of the training documents."""
        return sum(len(t.encode()) for _, t in self.train)

    @property
    def heldout_bytes(self) -> int:
        """UTF-8 size of the held-out documents."""
        return sum(len(t.encode()) for _, t in self.heldout)


@dataclass(frozen=True)
class Streams:
    """Both splits encoded as one token id stream each (see :func:`encode_docs`)."""

    train: np.ndarray
    heldout: np.ndarray


def write_tokenizer_config(directory: Path, max_length: int) -> None:
    """tokenizer_config.json for transformers' PreTrainedTokenizerFast (and MAX)."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def select_corpus(
    stdlib: Path, train_bytes: int, heldout_bytes: int
) -> tuple[list[Doc], list[Doc]]:
    """Deterministic (path, text) lists for training and held-out evaluation."""
    candidates: list[tuple[str, Path]] = []
    for root, dirs, files in os.walk(stdlib):
        dirs[:] = sorted(
            d for d in dirs if d not in SKIP_DIRS and not d.startswith(("test", "config-"))
        )
        for name in sorted(files):
            if not name.endswith(".py") or name.startswith(("test_", "_sysconfigdata")):
                continue
            path = Path(root) / name
            if path.stat().st_size > MAX_FILE_BYTES or path.stat().st_size < 200:
                continue
            rel = path.relative_to(stdlib).as_posix()
            candidates.append((rel, path))
    # Order by hash of the relative path: spreads the selection over the whole
    # stdlib instead of taking it alphabetically, and is independent of the
    # file system's listing order.
    candidates.sort(key=lambda item: hashlib.sha1(item[0].encode()).hexdigest())
    heldout: list[Doc] = []
    train: list[Doc] = []
    held_size = train_size = 0
    for rel, path in candidates:
        text = path.read_text(encoding="utf-8", errors="replace").replace("\r\n", "\n")
        if held_size < heldout_bytes:
            heldout.append((rel, text))
            held_size += len(text.encode())
        elif train_size < train_bytes:
            train.append((rel, text))
            train_size += len(text.encode())
        else:
            break
    return train, heldout


def load_splits(stdlib: Path, train_bytes: int, heldout_bytes: int) -> Splits:
    """:func:`select_corpus` as :class:`Splits`, logging their sizes."""
    train, heldout = select_corpus(stdlib, train_bytes, heldout_bytes)
    splits = Splits(train=train, heldout=heldout)
    print(
        f"corpus: {stdlib}: {len(splits.train)} train files ({splits.train_bytes} B), "
        f"{len(splits.heldout)} held-out files ({splits.heldout_bytes} B)",
        flush=True,
    )
    return splits


def train_tokenizer(texts: list[str], vocab_size: int, max_length: int) -> Tokenizer:
    """Byte-level BPE over ``texts`` that, like Llama's, prepends <|bos|> when encoding.

    ``max_length`` is accepted for the callers' symmetry and not used.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    # Like Llama: encode(..., add_special_tokens=True) prepends <|bos|>.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, bos_id)],
    )
    tok.no_padding()
    tok.no_truncation()
    return tok


def load_tokenizer(
    splits: Splits, tokenizer_from: Path | None, vocab_size: int, max_length: int
) -> Tokenizer:
    """``tokenizer_from/tokenizer.json`` when given, else one trained on the training split."""
    if tokenizer_from is None:
        tok = train_tokenizer([t for _, t in splits.train], vocab_size, max_length)
        assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
        return tok
    tok = Tokenizer.from_file(str(tokenizer_from / "tokenizer.json"))
    print(f"tokenizer: {tokenizer_from / 'tokenizer.json'}", flush=True)
    return tok


def special_ids(tok: Tokenizer) -> Specials:
    """The ids of <|bos|>, <|eos|> and <|pad|>; a tokenizer without them is refused."""
    bos_id, eos_id, pad_id = (tok.token_to_id(s) for s in (BOS, EOS, PAD))
    assert None not in (bos_id, eos_id, pad_id), "tokenizer lacks the special tokens"
    return Specials(bos_id, eos_id, pad_id)


def encode_docs(tok: Tokenizer, docs: list[Doc]) -> np.ndarray:
    """Concatenate documents as <|bos|> text <|eos|> ... into one id stream."""
    eos_id = tok.token_to_id(EOS)
    encs = tok.encode_batch([text for _, text in docs], add_special_tokens=True)
    stream: list[int] = []
    for enc in encs:
        stream.extend(enc.ids)
        stream.append(eos_id)
    return np.asarray(stream, dtype=np.int64)


def encode_splits(tok: Tokenizer, splits: Splits) -> Streams:
    """Both splits encoded by :func:`encode_docs`."""
    return Streams(train=encode_docs(tok, splits.train), heldout=encode_docs(tok, splits.heldout))
