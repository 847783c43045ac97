"""Writing the Hugging Face checkpoint: staged in a temporary directory beside the output and
moved into place once complete (a run that fails leaves the previous output as it was)."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

from .corpus import Specials, write_tokenizer_config
from .model import LlamaArgs, LlamaForCausalLM, hf_config


def staging_dir(out: Path) -> Path:
    """A new empty directory next to ``out`` (same file system, so the final move is atomic)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))


def save_weights(directory: Path, model: LlamaForCausalLM) -> dict[str, np.ndarray]:
    """model.safetensors (float32), checked by reading it back; returns the saved tensors."""
    state = {
        k: np.ascontiguousarray(v.detach().cpu().numpy().astype(np.float32))
        for k, v in model.state_dict().items()
    }
    save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    back = load_file(str(directory / "model.safetensors"))
    assert all(np.array_equal(back[k], state[k]) for k in state), "safetensors round trip failed"
    return state


def save_tokenizer(directory: Path, tok: Tokenizer, tokenizer_from: Path | None) -> None:
    """tokenizer.json: the trained one, or ``tokenizer_from``'s copied byte for byte."""
    if tokenizer_from is None:
        tok.save(str(directory / "tokenizer.json"))
    else:
        # The very same files, byte for byte, so both models tokenize alike.
        shutil.copyfile(tokenizer_from / "tokenizer.json", directory / "tokenizer.json")


def save_configs(
    directory: Path, a: LlamaArgs, specials: Specials, tokenizer_from: Path | None
) -> None:
    """config.json, generation_config.json and tokenizer_config.json (copied when given)."""
    bos_id, eos_id, pad_id = specials
    (directory / "config.json").write_text(
        json.dumps(hf_config(a, bos_id, eos_id, pad_id), indent=2) + "\n"
    )
    (directory / "generation_config.json").write_text(
        json.dumps(
            {
                "bos_token_id": bos_id,
                "eos_token_id": eos_id,
                "pad_token_id": pad_id,
                "do_sample": False,
                "max_length": a.max_position_embeddings,
                "transformers_version": "4.46.0",
            },
            indent=2,
        )
        + "\n"
    )
    if tokenizer_from is not None and (tokenizer_from / "tokenizer_config.json").exists():
        shutil.copyfile(
            tokenizer_from / "tokenizer_config.json", directory / "tokenizer_config.json"
        )
    else:
        write_tokenizer_config(directory, a.max_position_embeddings)


def publish(staged: Path, out: Path) -> None:
    """Give ``staged`` ordinary permissions and move it to ``out``, replacing what was there."""
    # mkdtemp makes a 0700 directory; ship ordinary permissions.
    os.chmod(staged, 0o755)
    for f in staged.iterdir():
        os.chmod(f, 0o644)
    if out.exists():
        shutil.rmtree(out)
    os.replace(staged, out)


def stage_checkpoint(
    out: Path,
    model: LlamaForCausalLM,
    tok: Tokenizer,
    a: LlamaArgs,
    specials: Specials,
    tokenizer_from: Path | None,
) -> tuple[Path, dict[str, np.ndarray]]:
    """Weights, tokenizer and configs in a new staging directory for ``out``.

    Returns the directory (see :func:`publish`) and the tensors written.
    """
    staged = staging_dir(out)
    state = save_weights(staged, model)
    save_tokenizer(staged, tok, tokenizer_from)
    save_configs(staged, a, specials, tokenizer_from)
    return staged, state
