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
import hashlib
import json
import math
import os
import platform
import random
import shutil
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from torch import nn

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


# --------------------------------------------------------------------------- #
# Corpus
# --------------------------------------------------------------------------- #
def select_corpus(
    stdlib: Path, train_bytes: int, heldout_bytes: int
) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
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
    heldout: list[tuple[str, str]] = []
    train: list[tuple[str, str]] = []
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


def train_tokenizer(texts: list[str], vocab_size: int, max_length: int) -> Tokenizer:
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


def encode_docs(tok: Tokenizer, docs: list[tuple[str, str]]) -> np.ndarray:
    """Concatenate documents as <|bos|> text <|eos|> ... into one id stream."""
    eos_id = tok.token_to_id(EOS)
    encs = tok.encode_batch([text for _, text in docs], add_special_tokens=True)
    stream: list[int] = []
    for enc in encs:
        stream.extend(enc.ids)
        stream.append(eos_id)
    return np.asarray(stream, dtype=np.int64)


# --------------------------------------------------------------------------- #
# Model: a plain-PyTorch LlamaForCausalLM (same math and key names as HF)
# --------------------------------------------------------------------------- #
@dataclass
class LlamaArgs:
    vocab_size: int = 2048
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 6
    num_attention_heads: int = 6
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 512
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5


# --preset NAME: model sizes and step count (explicit options override them).
PRESETS: dict[str, dict[str, int]] = {
    "demo": {
        "hidden": 192,
        "intermediate": 512,
        "layers": 6,
        "heads": 6,
        "kv_heads": 2,
        "steps": 1200,
    },
    "coder-256x8": {
        "hidden": 256,
        "intermediate": 768,
        "layers": 8,
        "heads": 4,
        "kv_heads": 2,
        "steps": 2500,
    },
}


def model_args(
    hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, vocab: int
) -> LlamaArgs:
    if hidden % heads:
        raise SystemExit(f"--hidden {hidden} is not a multiple of --heads {heads}")
    if heads % kv_heads:
        raise SystemExit(f"--heads {heads} is not a multiple of --kv-heads {kv_heads}")
    if (hidden // heads) % 2:
        raise SystemExit(f"head dim {hidden // heads} must be even (RoPE)")
    return LlamaArgs(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
    )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(a: LlamaArgs, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / (
        a.rope_theta ** (torch.arange(0, a.head_dim, 2, dtype=torch.int64).float() / a.head_dim)
    )
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)  # HF non-interleaved (rotate_half)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.a = a
        h, d = a.hidden_size, a.head_dim
        self.q_proj = nn.Linear(h, a.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, a.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, a.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(a.num_attention_heads * d, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a = self.a
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, a.num_attention_heads, a.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, a.num_key_value_heads, a.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, a.num_key_value_heads, a.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = a.num_attention_heads // a.num_key_value_heads
        # HF repeat_kv: query head i uses kv head i // rep.
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=a.head_dim**-0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.self_attn = Attention(a)
        self.mlp = MLP(a)
        self.input_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(a.hidden_size, a.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(a) for _ in range(a.num_hidden_layers))
        self.norm = RMSNorm(a.hidden_size, a.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    def __init__(self, a: LlamaArgs):
        super().__init__()
        self.args = a
        self.model = LlamaModel(a)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_cos_sin(self.args, torch.arange(ids.shape[1]))
        x = self.model.embed_tokens(ids)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.model.norm(x))

    @torch.no_grad()
    def greedy(self, ids: list[int], new_tokens: int, eos_id: int | None = None) -> list[int]:
        out = list(ids)
        for _ in range(new_tokens):
            window = out[-self.args.max_position_embeddings :]
            nxt = int(self(torch.tensor([window]))[0, -1].argmax())
            out.append(nxt)
            if eos_id is not None and nxt == eos_id:
                break
        return out[len(ids) :]


def init_weights(model: LlamaForCausalLM, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    n_layers = model.args.num_hidden_layers
    for name, p in model.named_parameters():
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            nn.init.ones_(p)
            continue
        std = 0.02
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            std = 0.02 / math.sqrt(2 * n_layers)
        with torch.no_grad():
            p.copy_(torch.randn(p.shape, generator=g) * std)


# --------------------------------------------------------------------------- #
# Training
# --------------------------------------------------------------------------- #
def batch_from(
    stream: np.ndarray, starts: np.ndarray, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    idx = starts[:, None] + np.arange(seq + 1)[None, :]
    chunk = torch.from_numpy(stream[idx])
    return chunk[:, :-1], chunk[:, 1:]


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, stream: np.ndarray, seq: int, batch: int) -> float:
    """Mean loss over non-overlapping windows of the whole stream."""
    model.eval()
    n = (len(stream) - 1) // seq
    starts = np.arange(n) * seq
    total, count = 0.0, 0
    for i in range(0, n, batch):
        x, y = batch_from(stream, starts[i : i + batch], seq)
        logits = model(x)
        total += F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum"
        ).item()
        count += y.numel()
    model.train()
    return total / max(count, 1)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def hf_config(a: LlamaArgs, bos: int, eos: int, pad: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "vocab_size": a.vocab_size,
        "hidden_size": a.hidden_size,
        "intermediate_size": a.intermediate_size,
        "num_hidden_layers": a.num_hidden_layers,
        "num_attention_heads": a.num_attention_heads,
        "num_key_value_heads": a.num_key_value_heads,
        "head_dim": a.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": a.max_position_embeddings,
        "initializer_range": 0.02,
        "rms_norm_eps": a.rms_norm_eps,
        "rope_theta": a.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "pretraining_tp": 1,
        "tie_word_embeddings": False,
        "use_cache": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "transformers_version": "4.46.0",
    }


def main() -> None:
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
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128, help="training window length (tokens)")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--train-bytes", type=int, default=6_000_000)
    ap.add_argument("--heldout-bytes", type=int, default=200_000)
    ap.add_argument("--log-every", type=int, default=25)
    args = ap.parse_args()
    preset = PRESETS[args.preset or "demo"]
    for name in ("hidden", "intermediate", "layers", "heads", "kv_heads", "steps"):
        if getattr(args, name) is None:
            setattr(args, name, preset[name])

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    t0 = time.time()

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train_docs, held_docs = select_corpus(stdlib, args.train_bytes, args.heldout_bytes)
    train_bytes = sum(len(t.encode()) for _, t in train_docs)
    held_bytes = sum(len(t.encode()) for _, t in held_docs)
    print(
        f"corpus: {stdlib}: {len(train_docs)} train files ({train_bytes} B), "
        f"{len(held_docs)} held-out files ({held_bytes} B)",
        flush=True,
    )

    if args.tokenizer_from is None:
        tok = train_tokenizer(
            [t for _, t in train_docs], LlamaArgs.vocab_size, LlamaArgs.max_position_embeddings
        )
        assert tok.get_vocab_size() == LlamaArgs.vocab_size, tok.get_vocab_size()
    else:
        tok = Tokenizer.from_file(str(args.tokenizer_from / "tokenizer.json"))
        print(f"tokenizer: {args.tokenizer_from / 'tokenizer.json'}", flush=True)
    a = model_args(
        args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, tok.get_vocab_size()
    )
    bos_id, eos_id, pad_id = (tok.token_to_id(s) for s in (BOS, EOS, PAD))
    assert None not in (bos_id, eos_id, pad_id), "tokenizer lacks the special tokens"
    train_stream = encode_docs(tok, train_docs)
    held_stream = encode_docs(tok, held_docs)
    print(
        f"tokens: train {len(train_stream)}, held-out {len(held_stream)} "
        f"({train_bytes / len(train_stream):.2f} B/token) [{time.time() - t0:.1f}s]",
        flush=True,
    )

    model = LlamaForCausalLM(a)
    init_weights(model, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"model: {n_params} parameters (hidden {a.hidden_size}, MLP {a.intermediate_size}, "
        f"{a.num_hidden_layers} layers, {a.num_attention_heads}/{a.num_key_value_heads} heads "
        f"of {a.head_dim}, vocab {a.vocab_size})",
        flush=True,
    )

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    rng = np.random.default_rng(args.seed)
    t_train = time.time()
    ema = None
    last_loss = float("nan")
    recent: list[float] = []
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        starts = rng.integers(0, len(train_stream) - args.seq - 1, size=args.batch)
        x, y = batch_from(train_stream, starts, args.seq)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, a.vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last_loss = loss.item()
        recent = [*recent, last_loss][-50:]
        ema = last_loss if ema is None else 0.95 * ema + 0.05 * last_loss
        if step % args.log_every == 0 or step == args.steps - 1:
            el = time.time() - t_train
            print(
                f"step {step:5d}  loss {last_loss:.4f}  ema {ema:.4f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}  {el:.0f}s "
                f"({el / (step + 1):.2f}s/step)",
                flush=True,
            )
    train_wall = time.time() - t_train
    final_train = float(np.mean(recent))

    held_loss = evaluate(model, held_stream, args.seq, args.batch)
    print(
        f"held-out loss {held_loss:.4f} (ppl {math.exp(held_loss):.2f}); "
        f"final train loss (mean of last {len(recent)} steps) {final_train:.4f}",
        flush=True,
    )

    model.eval()
    samples = []
    for prompt in ("def ", "import os\n"):
        ids = tok.encode(prompt, add_special_tokens=True).ids
        gen = model.greedy(ids, 64)
        samples.append((prompt, ids, gen, tok.decode(gen, skip_special_tokens=False)))
        print(f"--- greedy sample for {prompt!r}:\n{prompt}{samples[-1][3]}\n---", flush=True)

    # ---- write the checkpoint atomically ----------------------------------- #
    out: Path = args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    state = {
        k: np.ascontiguousarray(v.detach().cpu().numpy().astype(np.float32))
        for k, v in model.state_dict().items()
    }
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    back = load_file(str(tmp / "model.safetensors"))
    assert all(np.array_equal(back[k], state[k]) for k in state), "safetensors round trip failed"
    if args.tokenizer_from is None:
        tok.save(str(tmp / "tokenizer.json"))
    else:
        # The very same files, byte for byte, so both models tokenize alike.
        shutil.copyfile(args.tokenizer_from / "tokenizer.json", tmp / "tokenizer.json")
    (tmp / "config.json").write_text(
        json.dumps(hf_config(a, bos_id, eos_id, pad_id), indent=2) + "\n"
    )
    (tmp / "generation_config.json").write_text(
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
    if args.tokenizer_from is not None and (args.tokenizer_from / "tokenizer_config.json").exists():
        shutil.copyfile(
            args.tokenizer_from / "tokenizer_config.json", tmp / "tokenizer_config.json"
        )
    else:
        write_tokenizer_config(tmp, a.max_position_embeddings)
    size = (tmp / "model.safetensors").stat().st_size
    total_wall = time.time() - t0
    sample_md = "\n".join(
        f"Prompt `{p!r}` (ids `{ids}`), 64 greedy tokens, ids `{gen}`:\n\n```python\n{p}{text}\n```\n"
        for p, ids, gen, text in samples
    )
    shapes = "\n".join(
        f"| `{k}` | {list(v.shape)} |"
        for k, v in state.items()
        if ".layers." not in k or ".layers.0." in k
    )
    demo_sizes = PRESETS["demo"]
    is_demo = args.tokenizer_from is None and all(
        getattr(args, k) == v for k, v in demo_sizes.items() if k != "steps"
    )
    if is_demo:
        title = "attnquant demo model"
        intro = """A tiny Llama-architecture causal LM trained from scratch by
`scripts/train_demo_model.py` on Python standard-library source. It exists so
that `attnquant serve` / `attnquant generate` and the test suite have a real,
offline, CPU-servable `LlamaForCausalLM` checkpoint. It writes Python-looking
text and nothing more; it is not useful as a language model."""
    else:
        title = f"attnquant {args.preset or out.name} model"
        intro = """A small Llama-architecture causal LM trained from scratch by
`scripts/train_demo_model.py` on Python standard-library source, on the same
corpus split as the embedded demo model. It writes Python-looking text and
nothing more; it is not useful as a language model."""
    if args.tokenizer_from is None:
        tok_from = "the tokenizer (trained on the\ntraining split)"
    else:
        tok_from = f"the tokenizer (`{args.tokenizer_from}/tokenizer.json`,\ncopied unchanged)"
    flags = [f"--out {out}"]
    if args.preset not in (None, "demo"):
        flags.append(f"--preset {args.preset}")
    for name, default in PRESETS[args.preset or "demo"].items():
        if getattr(args, name) != default or (name == "steps" and args.preset in (None, "demo")):
            flags.append(f"--{name.replace('_', '-')} {getattr(args, name)}")
    if args.tokenizer_from is not None:
        flags.append(f"--tokenizer-from {args.tokenizer_from}")
    flags.append(f"--threads {args.threads}")
    command = "/tmp/trainenv/bin/python scripts/train_demo_model.py " + " ".join(flags)
    held_ppl = math.exp(held_loss)
    training = {
        "script": "scripts/train_demo_model.py",
        "command": command,
        "preset": args.preset,
        "config": {k: getattr(a, k) for k in LlamaArgs.__dataclass_fields__},
        "tie_word_embeddings": False,
        "dtype": "float32",
        "parameters": n_params,
        "safetensors_bytes": size,
        "tokenizer": "trained" if args.tokenizer_from is None else str(args.tokenizer_from),
        "corpus": {
            "python": platform.python_version(),
            "train_files": len(train_docs),
            "train_bytes": train_bytes,
            "train_tokens": len(train_stream),
            "heldout_files": [rel for rel, _ in held_docs],
            "heldout_bytes": held_bytes,
            "heldout_tokens": len(held_stream),
        },
        "steps": args.steps,
        "batch": args.batch,
        "seq": args.seq,
        "lr": args.lr,
        "warmup": args.warmup,
        "seed": args.seed,
        "threads": args.threads,
        "final_train_loss": final_train,
        "heldout_loss": held_loss,
        "heldout_ppl": held_ppl,
        "train_wall_s": round(train_wall, 1),
        "s_per_step": round(train_wall / args.steps, 3),
        "total_wall_s": round(total_wall, 1),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    (tmp / "training.json").write_text(json.dumps(training, indent=2) + "\n")
    (tmp / "MODEL_CARD.md").write_text(f"""# {title}

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
| parameters | {n_params:,} |
| `model.safetensors` | {size:,} bytes |

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
| train | {len(train_docs)} | {train_bytes:,} | {len(train_stream):,} |
| held-out | {len(held_docs)} | {held_bytes:,} | {len(held_stream):,} |

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
| final training loss (mean of last {len(recent)} steps) | {final_train:.4f} |
| held-out loss (ppl) | {held_loss:.4f} ({held_ppl:.2f}) |
| training wall time | {train_wall:.0f} s ({train_wall / args.steps:.2f} s/step) |
| total wall time | {total_wall:.0f} s |
| torch | {torch.__version__}, {platform.machine()} |

## Greedy samples (plain PyTorch reference implementation)

{sample_md}
## Reproduce

```
python3 -m venv /tmp/trainenv
/tmp/trainenv/bin/pip install torch==2.13.0 tokenizers safetensors numpy
{command}
```
""")
    # mkdtemp makes a 0700 directory; ship ordinary permissions.
    os.chmod(tmp, 0o755)
    for f in tmp.iterdir():
        os.chmod(f, 0o644)
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    print(f"wrote {out} ({size} B safetensors, {n_params} params) in {total_wall:.0f}s", flush=True)


if __name__ == "__main__":
    sys.exit(main())
