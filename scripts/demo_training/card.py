"""Provenance of a finished run: the command that reproduces it, ``training.json`` and
``MODEL_CARD.md``."""

from __future__ import annotations

import argparse
import json
import math
import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .corpus import BOS, EOS, MAX_FILE_BYTES, PAD, SKIP_DIRS, Specials, Splits, Streams
from .model import PRESETS, LlamaArgs
from .train import SAMPLE_TOKENS, Sample, TrainResult

SCRIPT = "scripts/train_demo_model.py"

DEMO_INTRO = """A tiny Llama-architecture causal LM trained from scratch by
`scripts/train_demo_model.py` on Python standard-library source. It exists so
that `attnquant serve` / `attnquant generate` and the test suite have a real,
offline, CPU-servable `LlamaForCausalLM` checkpoint. It writes Python-looking
text and nothing more; it is not useful as a language model."""

OTHER_INTRO = """A small Llama-architecture causal LM trained from scratch by
`scripts/train_demo_model.py` on Python standard-library source, on the same
corpus split as the embedded demo model. It writes Python-looking text and
nothing more; it is not useful as a language model."""


@dataclass(frozen=True)
class RunSummary:
    """Everything ``training.json`` and the model card report about one run."""

    args: argparse.Namespace
    config: LlamaArgs
    specials: Specials
    splits: Splits
    streams: Streams
    n_params: int
    state: dict[str, np.ndarray]
    safetensors_bytes: int
    result: TrainResult
    heldout_loss: float
    samples: list[Sample]
    total_wall_s: float


#: The training options of ``scripts/train_demo_model.py`` and their defaults: one that differs
#: goes into the recorded command, so a run with other values can be repeated from its card.
TRAINING_DEFAULTS = {
    "batch": 16,
    "seq": 128,
    "lr": 2e-3,
    "warmup": 50,
    "seed": 1234,
    "train_bytes": 6_000_000,
    "heldout_bytes": 200_000,
}


def reproduce_command(args: argparse.Namespace) -> str:
    """The command line that trains this model again: its sizes, tokenizer, threads, and every
    training option given a value other than its default (``TRAINING_DEFAULTS``)."""
    flags = [f"--out {args.out}"]
    if args.preset not in (None, "demo"):
        flags.append(f"--preset {args.preset}")
    for name, default in PRESETS[args.preset or "demo"].items():
        if getattr(args, name) != default or (name == "steps" and args.preset in (None, "demo")):
            flags.append(f"--{name.replace('_', '-')} {getattr(args, name)}")
    if args.tokenizer_from is not None:
        flags.append(f"--tokenizer-from {args.tokenizer_from}")
    flags.append(f"--threads {args.threads}")
    for name, default in TRAINING_DEFAULTS.items():
        if getattr(args, name) != default:
            flags.append(f"--{name.replace('_', '-')} {getattr(args, name)}")
    return f"/tmp/trainenv/bin/python {SCRIPT} " + " ".join(flags)


def training_record(run: RunSummary) -> dict:
    """The content of training.json: sizes, corpus split, training options and results."""
    args, res = run.args, run.result
    return {
        "script": SCRIPT,
        "command": reproduce_command(args),
        "preset": args.preset,
        "config": {k: getattr(run.config, k) for k in LlamaArgs.__dataclass_fields__},
        "tie_word_embeddings": False,
        "dtype": "float32",
        "parameters": run.n_params,
        "safetensors_bytes": run.safetensors_bytes,
        "tokenizer": "trained" if args.tokenizer_from is None else str(args.tokenizer_from),
        "corpus": {
            "python": platform.python_version(),
            "train_files": len(run.splits.train),
            "train_bytes": run.splits.train_bytes,
            "train_tokens": len(run.streams.train),
            "heldout_files": [rel for rel, _ in run.splits.heldout],
            "heldout_bytes": run.splits.heldout_bytes,
            "heldout_tokens": len(run.streams.heldout),
        },
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "lr": args.lr,
        "warmup": args.warmup,
        "seed": args.seed,
        "threads": args.threads,
        "final_train_loss": res.final_loss,
        "heldout_loss": run.heldout_loss,
        "heldout_ppl": math.exp(run.heldout_loss),
        "train_wall_s": round(res.wall_s, 1),
        "s_per_step": round(res.wall_s / args.steps, 3),
        "total_wall_s": round(run.total_wall_s, 1),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }


def is_demo(args: argparse.Namespace) -> bool:
    """Whether this run trains the embedded demo model: its tokenizer and its sizes."""
    return args.tokenizer_from is None and all(
        getattr(args, k) == v for k, v in PRESETS["demo"].items() if k != "steps"
    )


def title_and_intro(args: argparse.Namespace) -> tuple[str, str]:
    """The model card's title and opening paragraph."""
    if is_demo(args):
        return "attnquant demo model", DEMO_INTRO
    return f"attnquant {args.preset or args.out.name} model", OTHER_INTRO


def model_card(run: RunSummary) -> str:
    """MODEL_CARD.md: architecture, tensors, corpus, training, greedy samples, how to reproduce."""
    args, a, res = run.args, run.config, run.result
    bos_id, eos_id, pad_id = run.specials
    title, intro = title_and_intro(args)
    if args.tokenizer_from is None:
        tok_from = "the tokenizer (trained on the\ntraining split)"
    else:
        tok_from = f"the tokenizer (`{args.tokenizer_from}/tokenizer.json`,\ncopied unchanged)"
    sample_md = "\n".join(
        f"Prompt `{p!r}` (ids `{ids}`), {SAMPLE_TOKENS} greedy tokens, ids `{gen}`:\n\n"
        f"```python\n{p}{text}\n```\n"
        for p, ids, gen, text in run.samples
    )
    shapes = "\n".join(
        f"| `{k}` | {list(v.shape)} |"
        for k, v in run.state.items()
        if ".layers." not in k or ".layers.0." in k
    )
    train_wall, total_wall = res.wall_s, run.total_wall_s
    return f"""# {title}

{intro}

## Architecture

`LlamaForCausalLM`, float32, untied `lm_head`, no biases.

| field | value |
|---|---|
| layers | {a.num_hidden_layers} |
| hidden size | {a.hidden_size} |
| attention heads / KV heads / head dim | {a.num_attention_heads} / {a.num_key_value_heads} / {a.head_dim} (grouped-query) |
| MLP intermediate size | {a.intermediate_size} (SiLU-gated) |
| vocab | {a.vocab_size} (byte-level BPE, specials `{BOS}`={bos_id}, `{EOS}`={eos_id}, `{PAD}`={pad_id}) |
| max positions | {a.max_position_embeddings} |
| RoPE | theta {a.rope_theta:g}, HF rotate_half (non-interleaved) |
| RMSNorm eps | {a.rms_norm_eps:g} |
| parameters | {run.n_params:,} |
| `model.safetensors` | {run.safetensors_bytes:,} bytes |

Tensors (layer 0 shown; layers 0-{a.num_hidden_layers - 1} alike):

| key | shape |
|---|---|
{shapes}

## Corpus

`.py` files of the CPython {platform.python_version()} standard library
(`sysconfig.get_paths()["stdlib"]`), skipping directories {sorted(SKIP_DIRS)},
any directory starting with `test`, `test_*.py`, `_sysconfigdata*`, and files
over {MAX_FILE_BYTES:,} bytes; ordered by SHA-1 of the relative path. The first
files in that order form the held-out set, the next ones the training set.

| split | files | bytes | tokens |
|---|---|---|---|
| train | {len(run.splits.train)} | {run.splits.train_bytes:,} | {len(run.streams.train):,} |
| held-out | {len(run.splits.heldout)} | {run.splits.heldout_bytes:,} | {len(run.streams.heldout):,} |

Each file is encoded as `{BOS}` text `{EOS}`; {tok_from} prepends `{BOS}` on `encode(..., add_special_tokens=True)`.
The chat template is completion-style: a system message becomes a module
docstring, user text is rendered verbatim and the assistant continues it
(`add_generation_prompt` adds nothing); a finished assistant turn ends with `{EOS}`.

## Training

| | |
|---|---|
| steps | {args.steps} |
| batch x window | {args.batch} x {args.seq} tokens (random windows) |
| optimizer | AdamW, betas (0.9, 0.95), weight decay 0.1 (matrices), grad clip 1.0 |
| learning rate | peak {args.lr:g}, linear warm-up {args.warmup} steps, cosine to 10% |
| seed / threads | {args.seed} / {args.threads} |
| final training loss (mean of last {res.final_steps} steps) | {res.final_loss:.4f} |
| held-out loss (ppl) | {run.heldout_loss:.4f} ({math.exp(run.heldout_loss):.2f}) |
| training wall time | {train_wall:.0f} s ({train_wall / args.steps:.2f} s/step) |
| total wall time | {total_wall:.0f} s |
| torch | {torch.__version__}, {platform.machine()} |

## Greedy samples (plain PyTorch reference implementation)

{sample_md}
## Reproduce

```
python3 -m venv /tmp/trainenv
/tmp/trainenv/bin/pip install torch==2.13.0 tokenizers safetensors numpy
{reproduce_command(args)}
```
"""


def write_card(directory: Path, run: RunSummary) -> None:
    """training.json and MODEL_CARD.md into ``directory``."""
    (directory / "training.json").write_text(json.dumps(training_record(run), indent=2) + "\n")
    (directory / "MODEL_CARD.md").write_text(model_card(run))
