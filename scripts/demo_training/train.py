"""The training loop: random-window batches, AdamW with warm-up and cosine decay, held-out
loss and greedy samples."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F  # noqa: N812
from tokenizers import Tokenizer

from .model import LlamaForCausalLM

#: A greedy sample: prompt, its ids, the generated ids and their decoded text.
Sample = tuple[str, list[int], list[int], str]

SAMPLE_PROMPTS = ("def ", "import os\n")
SAMPLE_TOKENS = 64


@dataclass(frozen=True)
class TrainResult:
    """What the model card reports of the training loop."""

    final_loss: float  # mean training loss of the last ``final_steps`` steps
    final_steps: int
    wall_s: float


def batch_from(
    stream: np.ndarray, starts: np.ndarray, seq: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-token targets of the ``seq``-token windows at ``starts``."""
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
    """Learning rate of ``step``: linear warm-up to ``peak``, then cosine down to 10% of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def make_optimizer(model: LlamaForCausalLM, lr: float) -> torch.optim.AdamW:
    """AdamW with weight decay 0.1 on the matrices and none on the norm weights."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def train(
    model: LlamaForCausalLM,
    stream: np.ndarray,
    *,
    steps: int,
    batch: int,
    seq: int,
    lr: float,
    warmup: int,
    seed: int,
    log_every: int,
) -> TrainResult:
    """Train ``model`` in place on random windows of ``stream`` (seeded), logging the loss."""
    vocab_size = model.args.vocab_size
    opt = make_optimizer(model, lr)
    rng = np.random.default_rng(seed)
    t_train = time.time()
    ema = None
    last_loss = float("nan")
    recent: list[float] = []
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup)
        starts = rng.integers(0, len(stream) - seq - 1, size=batch)
        x, y = batch_from(stream, starts, seq)
        logits = model(x)
        loss = F.cross_entropy(logits.reshape(-1, vocab_size), y.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        last_loss = loss.item()
        recent = [*recent, last_loss][-50:]
        ema = last_loss if ema is None else 0.95 * ema + 0.05 * last_loss
        if step % log_every == 0 or step == steps - 1:
            el = time.time() - t_train
            print(
                f"step {step:5d}  loss {last_loss:.4f}  ema {ema:.4f}  "
                f"lr {opt.param_groups[0]['lr']:.2e}  {el:.0f}s "
                f"({el / (step + 1):.2f}s/step)",
                flush=True,
            )
    train_wall = time.time() - t_train
    return TrainResult(
        final_loss=float(np.mean(recent)), final_steps=len(recent), wall_s=train_wall
    )


def heldout_loss(
    model: LlamaForCausalLM, stream: np.ndarray, seq: int, batch: int, result: TrainResult
) -> float:
    """:func:`evaluate` on the held-out stream, logged beside the final training loss."""
    loss = evaluate(model, stream, seq, batch)
    print(
        f"held-out loss {loss:.4f} (ppl {math.exp(loss):.2f}); "
        f"final train loss (mean of last {result.final_steps} steps) {result.final_loss:.4f}",
        flush=True,
    )
    return loss


def greedy_samples(model: LlamaForCausalLM, tok: Tokenizer) -> list[Sample]:
    """:data:`SAMPLE_TOKENS` greedy tokens after each of :data:`SAMPLE_PROMPTS`, printed."""
    model.eval()
    samples: list[Sample] = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok.encode(prompt, add_special_tokens=True).ids
        gen = model.greedy(ids, SAMPLE_TOKENS)
        samples.append((prompt, ids, gen, tok.decode(gen, skip_special_tokens=False)))
        print(f"--- greedy sample for {prompt!r}:\n{prompt}{samples[-1][3]}\n---", flush=True)
    return samples
