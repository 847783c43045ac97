#!/usr/bin/env python3
"""Train attnquant's embedded demo model: a tiny Llama trained on Python source.

The result is a Hugging Face style ``LlamaForCausalLM`` checkpoint (float32,
6 layers, grouped-query attention, untied lm_head) that Modular MAX serves on
CPU, and that the ``attnquant`` CLI ships as its offline demo model.

Corpus: ``.py`` files of the running interpreter's own standard library
(``sysconfig.get_paths()["stdlib"]``), test directories and generated/data-heavy
modules skipped, a deterministic selection by SHA-1 of the relative path. A few
files are held out for a held-out loss. Tokenizer: byte-level BPE (vocab 2048)
trained with the ``tokenizers`` package on the training split.

Torch is *not* a dependency of the project. Run this in a throwaway venv::

    python3 -m venv /tmp/trainenv
    /tmp/trainenv/bin/pip install torch==2.13.0 tokenizers safetensors numpy
    /tmp/trainenv/bin/python scripts/train_demo_model.py \\
        --out packages/attnquant-cli/src/attnquant_cli/demo_model --threads 2

Everything is seeded (``--seed``); the corpus selection depends only on the
stdlib files present, so the same Python version and thread count reproduce
the same checkpoint (floating-point reductions can differ across thread
counts and CPUs). The defaults (1200 steps of 16 x 128 tokens) take about
10 minutes on an idle 2-core x86 machine (~0.45 s/step), longer when the cores
are shared.

Other sizes: ``--hidden``, ``--intermediate``, ``--layers``, ``--heads`` and
``--kv-heads`` (head dim = hidden / heads) default to the demo's; ``--preset``
sets them (and the step count) together. ``--tokenizer-from DIR`` loads
``DIR/tokenizer.json`` instead of training one, and copies ``DIR``'s tokenizer
files into the output, so that a model trained with it scores the very same
token ids as the model ``DIR`` holds. The corpus selection (training and
held-out files) does not depend on any of these options.

Presets:

* ``demo``: the defaults above.
* ``coder-256x8``: hidden 256, MLP 768, 8 layers, 4 heads / 2 KV heads (head
  dim 64), 2500 steps: the repository's second model (``models/coder-256x8``),
  deeper and wider than the demo, every projection's input width a multiple
  of 256 so that llama.cpp's K-quants apply. It must use the demo's tokenizer::

    /tmp/trainenv/bin/python scripts/train_demo_model.py --out models/coder-256x8 \\
        --preset coder-256x8 \\
        --tokenizer-from packages/attnquant-cli/src/attnquant_cli/demo_model --threads 2

  It took 47 minutes (2842 s; 1.13 s/step, ~0.93 s/step while the cores were
  not shared) on a shared 2-core x86 machine, CPython 3.11.7, torch 2.13.0+cpu:
  7,344,384 parameters, held-out loss 3.0426 (ppl 20.96) against the demo's
  3.3520 (28.56) on the same held-out token ids. (1000 steps gave 3.4522, ppl
  31.57: worse than the demo.)

Besides the checkpoint and ``MODEL_CARD.md`` the output holds ``training.json``:
the sizes, the corpus split, the steps and the held-out loss and perplexity.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# The package beside this file (scripts/demo_training) holds the code; a script's own directory
# is on sys.path already unless Python runs with -P / PYTHONSAFEPATH, so make sure of it.
sys.path.insert(0, str(Path(__file__).resolve().parent))

from demo_training.card import TRAINING_DEFAULTS
from demo_training.model import PRESETS
from demo_training.pipeline import run


def build_parser() -> argparse.ArgumentParser:
    """The command line: output, model sizes (or a preset), tokenizer and training options."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="output checkpoint directory")
    ap.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="model sizes and steps together (explicit size/step options override it)",
    )
    ap.add_argument("--hidden", type=int, help="hidden size (demo: 192)")
    ap.add_argument("--intermediate", type=int, help="MLP intermediate size (demo: 512)")
    ap.add_argument("--layers", type=int, help="decoder layers (demo: 6)")
    ap.add_argument(
        "--heads", type=int, help="attention heads; head dim = hidden / heads (demo: 6)"
    )
    ap.add_argument("--kv-heads", type=int, help="key/value heads (demo: 2)")
    ap.add_argument(
        "--tokenizer-from",
        type=Path,
        metavar="DIR",
        help="load DIR/tokenizer.json instead of training a tokenizer; copy DIR's tokenizer files",
    )
    ap.add_argument("--steps", type=int, help="optimizer steps (demo: 1200)")
    ap.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    ap.add_argument("--batch", type=int, default=TRAINING_DEFAULTS["batch"])
    ap.add_argument(
        "--seq", type=int, default=TRAINING_DEFAULTS["seq"], help="training window length (tokens)"
    )
    ap.add_argument("--lr", type=float, default=TRAINING_DEFAULTS["lr"], help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=TRAINING_DEFAULTS["warmup"])
    ap.add_argument("--seed", type=int, default=TRAINING_DEFAULTS["seed"])
    ap.add_argument("--train-bytes", type=int, default=TRAINING_DEFAULTS["train_bytes"])
    ap.add_argument("--heldout-bytes", type=int, default=TRAINING_DEFAULTS["heldout_bytes"])
    ap.add_argument("--log-every", type=int, default=25)
    return ap


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parsed options, the sizes and steps not given filled in from the preset (demo's default)."""
    args = build_parser().parse_args(argv)
    preset = PRESETS[args.preset or "demo"]
    for name in ("hidden", "intermediate", "layers", "heads", "kv_heads", "steps"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])
    return args


def main() -> None:
    """Parse the command line and train (everything else is in ``demo_training``)."""
    run(parse_args())


if __name__ == "__main__":
    sys.exit(main())
