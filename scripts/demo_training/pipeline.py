"""The steps of one training run in order, from the parsed command line to the written
checkpoint."""

from __future__ import annotations

import argparse
import random
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from .card import RunSummary, write_card
from .checkpoint import publish, stage_checkpoint
from .corpus import Splits, Streams, encode_splits, load_splits, load_tokenizer, special_ids
from .model import LlamaArgs, LlamaForCausalLM, build_model, count_parameters, model_args
from .train import TrainResult, greedy_samples, heldout_loss, train


def seed_everything(threads: int, seed: int) -> float:
    """Fix torch's thread count and seed torch and :mod:`random`; returns the start time."""
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    random.seed(seed)
    return time.time()


def stdlib_splits(args: argparse.Namespace) -> Splits:
    """The training and held-out files of the running interpreter's standard library."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return load_splits(stdlib, args.train_bytes, args.heldout_bytes)


def encode_with_log(tok: Tokenizer, splits: Splits, t0: float) -> Streams:
    """:func:`encode_splits`, logging the token counts and the time since ``t0``."""
    streams = encode_splits(tok, splits)
    print(
        f"tokens: train {len(streams.train)}, held-out {len(streams.heldout)} "
        f"({splits.train_bytes / len(streams.train):.2f} B/token) [{time.time() - t0:.1f}s]",
        flush=True,
    )
    return streams


def train_with_args(
    model: LlamaForCausalLM, stream: np.ndarray, args: argparse.Namespace
) -> TrainResult:
    """:func:`~.train.train` with the command line's steps, batch, window and schedule."""
    return train(
        model,
        stream,
        steps=args.steps,
        batch=args.batch,
        seq=args.seq,
        lr=args.lr,
        warmup=args.warmup,
        seed=args.seed,
        log_every=args.log_every,
    )


def run(args: argparse.Namespace) -> None:
    """Train the model ``args`` describe and write its checkpoint, card and training.json."""
    t0 = seed_everything(args.threads, args.seed)
    splits = stdlib_splits(args)
    tok = load_tokenizer(
        splits, args.tokenizer_from, LlamaArgs.vocab_size, LlamaArgs.max_position_embeddings
    )
    config = model_args(
        args.hidden, args.intermediate, args.layers, args.heads, args.kv_heads, tok.get_vocab_size()
    )
    specials = special_ids(tok)
    streams = encode_with_log(tok, splits, t0)
    model = build_model(config, args.seed)
    result = train_with_args(model, streams.train, args)
    held_loss = heldout_loss(model, streams.heldout, args.seq, args.batch, result)
    samples = greedy_samples(model, tok)

    out: Path = args.out
    staged, state = stage_checkpoint(out, model, tok, config, specials, args.tokenizer_from)
    summary = RunSummary(
        args=args,
        config=config,
        specials=specials,
        splits=splits,
        streams=streams,
        n_params=count_parameters(model),
        state=state,
        safetensors_bytes=(staged / "model.safetensors").stat().st_size,
        result=result,
        heldout_loss=held_loss,
        samples=samples,
        total_wall_s=time.time() - t0,
    )
    write_card(staged, summary)
    publish(staged, out)
    print(
        f"wrote {out} ({summary.safetensors_bytes} B safetensors, {summary.n_params} params) "
        f"in {summary.total_wall_s:.0f}s",
        flush=True,
    )
