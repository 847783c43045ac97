"""Calibration and evaluation text: files, directories and JSON Lines, tokenised by the checkpoint.

Text is read from plain text files, directories of them (recursively, sorted, hidden files
and files that are not UTF-8 skipped), and JSON Lines files (``.jsonl``, one object per line
with a ``"text"`` string). Each document is encoded with the checkpoint's own
``tokenizer.json`` (``add_special_tokens=True``, so a BOS-prepending tokenizer prepends BOS)
followed by the config's ``eos_token_id``, and the documents are concatenated into one stream,
as the demo model was trained. Windows of ``seq_len`` tokens are then cut from the stream.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from ..fit._spec import DEFAULT_SAMPLES, DEFAULT_SEQ_LEN
from ..io._calibration import CalibrationError

__all__ = [
    "DEFAULT_SAMPLES",
    "DEFAULT_SEQ_LEN",
    "read_texts",
    "token_stream",
    "token_windows",
]

logger = logging.getLogger(__name__)

# DEFAULT_SAMPLES and DEFAULT_SEQ_LEN: the windows' defaults, kept with decompose's other
# defaults in attnquant_core.fit._spec (decompose --calibration-data cuts the same windows).


def _jsonl(path: Path) -> list[str]:
    texts = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationError(f"{path}:{number}: not valid JSON ({exc.msg})") from None
            text = record.get("text") if isinstance(record, dict) else None
            if not isinstance(text, str):
                raise CalibrationError(
                    f"{path}:{number}: a JSON Lines record needs a string 'text' field"
                )
            texts.append(text)
    return texts


def _read_file(path: Path, *, strict: bool) -> list[str]:
    if path.suffix == ".jsonl":
        return _jsonl(path)
    try:
        return [path.read_text(encoding="utf-8").replace("\r\n", "\n")]
    except UnicodeDecodeError:
        if strict:
            raise CalibrationError(f"{path}: not UTF-8 text") from None
        logger.warning("%s: skipped, not UTF-8 text", path)
        return []


def read_texts(paths: Iterable[str | Path]) -> list[str]:
    """The documents in ``paths`` (files, directories, ``.jsonl``), in the order given."""
    texts: list[str] = []
    for entry in paths:
        path = Path(entry)
        if path.is_dir():
            files = sorted(
                p
                for p in path.rglob("*")
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
            )
            for file in files:
                texts.extend(_read_file(file, strict=False))
        elif path.is_file():
            texts.extend(_read_file(path, strict=True))
        else:
            raise CalibrationError(f"{path}: no such file or directory")
    texts = [t for t in texts if t]
    if not texts:
        raise CalibrationError(
            f"no text in {', '.join(str(p) for p in paths)}: give text files, directories of "
            f"them, or JSON Lines files with a 'text' field"
        )
    return texts


def token_stream(directory: str | Path, texts: Sequence[str], config: Mapping) -> np.ndarray:
    """Encode ``texts`` with ``directory/tokenizer.json`` into one id stream (``int64``)."""
    try:
        from tokenizers import Tokenizer
    except ImportError as exc:  # pragma: no cover - a dependency of attnquant-core
        raise ImportError('tokenising needs "tokenizers": pip install "tokenizers>=0.19"') from exc
    file = Path(directory) / "tokenizer.json"
    if not file.is_file():
        raise CalibrationError(f"{file}: no tokenizer.json; the text is tokenised with it")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as exc:  # the Rust side raises plain Exceptions
        raise CalibrationError(f"{file}: not a tokenizers file ({exc})") from None
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and eos else eos
    stream: list[int] = []
    for encoding in tokenizer.encode_batch(list(texts), add_special_tokens=True):
        stream.extend(encoding.ids)
        if isinstance(eos, int):
            stream.append(eos)
    return np.asarray(stream, dtype=np.int64)


def token_windows(
    stream: np.ndarray,
    *,
    seq_len: int = DEFAULT_SEQ_LEN,
    samples: int | None = DEFAULT_SAMPLES,
    seed: int | None = 0,
) -> np.ndarray:
    """Non-overlapping windows ``[n, seq_len]`` of ``stream``.

    ``samples`` caps their number (None: every whole window). With ``seed`` the windows are
    drawn at random (seeded) among all whole ones and kept in stream order; with ``seed=None``
    the first ones are taken. A stream shorter than ``seq_len`` gives one window of its length.
    """
    if seq_len < 2:
        raise CalibrationError(f"seq_len must be at least 2, got {seq_len}")
    if samples is not None and samples < 1:
        raise CalibrationError(f"samples must be at least 1, got {samples}")
    stream = np.asarray(stream, dtype=np.int64)
    if len(stream) < 2:
        raise CalibrationError(f"the text gives {len(stream)} token(s); at least 2 are needed")
    whole = len(stream) // seq_len
    if whole == 0:
        return stream[None, :]
    windows = stream[: whole * seq_len].reshape(whole, seq_len)
    if samples is None or samples >= whole:
        return windows
    if seed is None:
        return windows[:samples]
    chosen = np.sort(np.random.default_rng(seed).choice(whole, size=samples, replace=False))
    return windows[chosen]


def windows_digest(windows: np.ndarray) -> str:
    """``sha256:<hex>`` of the token windows (shape and little-endian int64 ids)."""
    w = np.ascontiguousarray(np.asarray(windows, dtype="<i8"))
    digest = hashlib.sha256(repr(tuple(w.shape)).encode())
    digest.update(w.tobytes())
    return f"sha256:{digest.hexdigest()}"
