"""The served model's tokenizer and limits, read once by the gateway from the checkpoint.

The gateway needs them to check token-id prompts against the vocabulary, to decode an echoed
prompt, and to answer vLLM's ``/tokenize``, ``/detokenize`` and ``/tokenizer_info`` routes,
which lm-eval's ``local-completions`` model uses as its tokenizer when a server offers them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["ModelTokenizer"]


class ModelTokenizer:
    """A checkpoint's ``tokenizer.json`` (Hugging Face ``tokenizers``) and its special tokens."""

    def __init__(self, model_path: str | os.PathLike[str]) -> None:
        from tokenizers import Tokenizer

        path = Path(model_path)
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        config_file = path / "tokenizer_config.json"
        self.config: dict[str, Any] = (
            json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        )
        model_config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        self.vocab_size = min(size, int(model_config.get("vocab_size") or size))
        self.max_position_embeddings = model_config.get("max_position_embeddings")

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _special(self, name: str) -> str | None:
        token = self.config.get(name)
        if isinstance(token, dict):  # {"content": "<s>", ...} in some tokenizer configs
            token = token.get("content")
        return token if isinstance(token, str) else None

    def info(self, max_length: int) -> dict[str, Any]:
        """vLLM's ``/tokenizer_info``: special tokens, chat template, window."""
        return {
            "tokenizer_class": self.config.get("tokenizer_class", "PreTrainedTokenizerFast"),
            "bos_token": self._special("bos_token"),
            "eos_token": self._special("eos_token"),
            "pad_token": self._special("pad_token"),
            "chat_template": self.config.get("chat_template"),
            "model_max_length": max_length,
            "vocab_size": self.vocab_size,
        }
