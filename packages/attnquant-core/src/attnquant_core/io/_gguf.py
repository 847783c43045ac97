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
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ._atomic import atomic_directory, write_atomic
from ._checkpoint import read_tensor_directory
from ._gguf_meta import (
    _BLOCK,
    _SUFFIXES,
    _TOP,
    GGUF_ARCHITECTURES,
    GGUFError,
    ImportProgress,
    _config,
    _Fields,
    _gguf,
    _hf_key,
    permute_rope,
)
from ._gguf_tokenizer import _export_tokenizer, _tokenizer_files
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
    "gguf_tensor_name",
    "hf_tensor_key",
    "permute_rope",
]

#: What an imported checkpoint records of its GGUF: file, digest, each tensor's GGUF type.
SOURCE_FILE = "attnquant.gguf-source.json"
_SOURCE_FORMAT = "attnquant-gguf-source"

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

    def write(tmp: Path) -> None:
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
        _finish(writer)

    write_atomic(Path(out), write)
    return Path(out)


def _finish(writer: Any) -> None:
    """Write a ``GGUFWriter``'s header, metadata and tensors, and close it."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def import_gguf(
    path: Path,
    out: Path,
    *,
    overwrite: bool = False,
    progress: Callable[[ImportProgress], None] | None = None,
    chat_template: str | None = None,
) -> dict[str, Any]:
    """Write the GGUF ``path`` as a float32 Hugging Face checkpoint ``out`` (atomically: a
    failure leaves nothing at ``out``); returns a summary (architecture, tensor counts by GGUF
    type, the quantized keys, bytes, where the chat template came from).

    ``chat_template`` (Jinja text) is written as the tokenizer's chat template in place of the
    GGUF's ``tokenizer.chat_template``, for a GGUF that carries none (llama.cpp's
    ``--chat-template``); the record says it was given."""
    src = _open(path)
    path = src.path
    tied = "lm_head.weight" not in src.tensors
    n_vocab = src.shapes["model.embed_tokens.weight"][0]
    config = _config(src.fields, src.arch, n_vocab, tied, src.shapes)
    side = _tokenizer_files(src.fields, config)
    template_from = "gguf" if src.fields.get("tokenizer.chat_template") else None
    if chat_template is not None:
        if not chat_template.strip():
            raise GGUFError("the chat template given is empty")
        tok_config = json.loads(side["tokenizer_config.json"])
        tok_config["chat_template"] = chat_template
        side["tokenizer_config.json"] = json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n"
        template_from = "given"
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
        "chat_template": template_from,
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
    counts = Counter(types.values())
    return {
        "architecture": src.arch,
        "hf_architecture": GGUF_ARCHITECTURES[src.arch],
        "tensors": total,
        "types": dict(sorted(counts.items())),
        "quantized": len(record["quantized"]),
        "float32_bytes": sum(s.nbytes for s in specs.values()),
        "gguf_bytes": path.stat().st_size,
        "chat_template": template_from,
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


# --- export: a Hugging Face Llama as a float32 GGUF --------------------------------------------


def gguf_tensor_name(key: str) -> str:
    """llama.cpp's tensor name of a Hugging Face Llama key (:func:`hf_tensor_key` inverted)."""
    top = {f"{v}.{s}": f"{k}.{s}" for k, v in _TOP.items() for s in _SUFFIXES}
    if key in top:
        return top[key]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", key)
    inverse = {v: k for k, v in _BLOCK.items()}
    if m is None or m.group(2) not in inverse:
        raise GGUFError(f"{key}: no llama.cpp name for this Llama tensor")
    return f"blk.{m.group(1)}.{inverse[m.group(2)]}.{m.group(3)}"


def hf_tensor_key(name: str, arch: str = "llama") -> str:
    """The Hugging Face key of a llama.cpp tensor name in an ``arch`` model, or a
    :class:`GGUFError` naming it."""
    return _hf_key(name, arch)


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
    files, _ = read_tensor_directory(checkpoint)
    keys = [
        k for k in files.keys() if not (cfg.get("tie_word_embeddings") and k == "lm_head.weight")
    ]

    def write(tmp: Path) -> None:
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
        for key in sorted(keys, key=_layer_order):
            W = files.get(key).astype(np.float32)
            if key.endswith("q_proj.weight"):
                W = permute_rope(W, heads)
            elif key.endswith("k_proj.weight"):
                W = permute_rope(W, kv_heads)
            writer.add_tensor(gguf_tensor_name(key), np.ascontiguousarray(W))
        _finish(writer)

    write_atomic(out, write)
    return out
