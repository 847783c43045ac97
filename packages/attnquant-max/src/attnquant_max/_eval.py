"""Judging checkpoints by function through MAX: every prompt position's full next-token
distribution, for perplexity, top-1 agreement and KL (``attnquant eval --forward max``).

MAX 26.7 computes logits for every prompt position only in a model built with
``enable_echo=True`` (its graph then returns ``ReturnLogits.ALL``: a graph of its own, not the
one ``serve``/``verify`` compile). Its public echo route (``echo: true, logprobs: N``) hands back
at most 7 top log-probabilities per position, too few for KL; so the full ``[T, vocab]`` logits
are read from the prefill step's model outputs: :func:`window_logprobs` wraps ``execute`` of the
one loaded pipeline model (an instance attribute, removed afterwards; no MAX module is patched)
and copies the logits it returns.

Prefix caching and chunked prefill could run a prompt in pieces or skip its cached prefix, and
the captured rows would then miss positions: both are turned off (``AutoModel``'s defaults,
passed explicitly here), and every capture is checked to hold exactly one row per prompt token.

MAX compiles ``max_length`` into the graph, so the echo model is always built at the model's
own ``max_position_embeddings`` (:func:`planned_length`), whatever the window: one compiled
graph per model shape. A window of ``T`` tokens is scored as the prompt ``window[:-1]``, whose
``T - 1`` logit rows predict ``window[1:]`` (the prompt and one new token fit in ``T``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from attnquant_core.calib import EvalResult, EvalTally
from attnquant_core.serving import ServingOptions

from ._config import GPU_ONLY_ARCHITECTURES, _architecture, require_device
from ._generate import LoadedModel, _log_softmax, decode_step_logits, load_pipeline

__all__ = [
    "ECHO_OVERRIDES",
    "MAX_ARCHITECTURES",
    "evaluate_max",
    "load_decode_pipeline",
    "load_echo_pipeline",
    "max_unavailable",
    "planned_length",
    "reference_options",
    "window_logprobs",
]

#: What an echo model is built with: all-position logits, every prompt computed whole.
ECHO_OVERRIDES: dict[str, object] = {
    "enable_echo": True,
    "enable_prefix_caching": False,
    "enable_chunked_prefill": False,
}

#: ``config.json`` architectures attnquant-max serves (GPU-only ones need ``--devices gpu``).
MAX_ARCHITECTURES = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Gemma3ForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        *GPU_ONLY_ARCHITECTURES,
    }
)


def max_unavailable(model_path: str | os.PathLike[str], devices: str = "cpu") -> str | None:
    """Why MAX cannot run ``model_path`` on ``devices`` (None: it can). Imports nothing of MAX
    but checks that it is installed."""
    arch = _architecture(model_path)
    if arch not in MAX_ARCHITECTURES:
        return f"{model_path}: architecture {arch!r} is not one attnquant-max serves"
    try:
        require_device(model_path, devices)
    except Exception as exc:  # DeviceError: e.g. Gemma on a CPU
        return str(exc)
    import importlib.util

    if importlib.util.find_spec("max") is None:
        return "MAX (the modular package) is not installed"
    return None


def planned_length(model_path: str | os.PathLike[str], seq_len: int) -> int:
    """The ``max_length`` an echo model of ``model_path`` is built with: its
    ``max_position_embeddings`` (the same for every window length, so one compiled graph), or
    ``seq_len`` when the config has none. A longer window is refused."""
    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    planned = int(text.get("max_position_embeddings") or config.get("max_position_embeddings") or 0)
    if not planned:
        return seq_len
    if seq_len > planned:
        raise ValueError(
            f"{model_path}: windows of {seq_len} tokens exceed the model's "
            f"max_position_embeddings {planned}; lower --seq-len"
        )
    return planned


def _load_scoring(
    model_path: str | os.PathLike[str],
    seq_len: int,
    overrides: Mapping[str, object] | None,
    *,
    devices: str = "cpu",
    quantization_encoding: str | None = None,
    options: ServingOptions | None = None,
) -> LoadedModel:
    """:func:`load_pipeline` for scoring windows of up to ``seq_len`` tokens, one at a time, at
    :func:`planned_length`."""
    return load_pipeline(
        model_path,
        max_length=planned_length(model_path, seq_len),
        max_batch_size=1,
        devices=devices,
        quantization_encoding=quantization_encoding,
        options=options,
        overrides=overrides,
    )


def load_echo_pipeline(
    model_path: str | os.PathLike[str], *, seq_len: int, **load: Any
) -> LoadedModel:
    """:func:`load_pipeline` built for whole-window scoring (:data:`ECHO_OVERRIDES`) of windows
    up to ``seq_len`` tokens, at :func:`planned_length`; ``load``: ``devices``,
    ``quantization_encoding``, ``options``."""
    return _load_scoring(model_path, seq_len, ECHO_OVERRIDES, **load)


def load_decode_pipeline(
    model_path: str | os.PathLike[str], *, seq_len: int, **load: Any
) -> LoadedModel:
    """:func:`load_pipeline` as ``serve`` and ``verify`` build it (last-row logits), batch of one,
    at :func:`planned_length`, for scoring windows of ``seq_len`` through decode steps; ``load``
    as for :func:`load_echo_pipeline`."""
    return _load_scoring(model_path, seq_len, None, **load)


@contextmanager
def _captured_logits(model: LoadedModel) -> Iterator[list[np.ndarray]]:
    """Every forward's logits (``[rows, vocab]`` float32) while the block runs."""
    pipeline_model: Any = model.model.pipeline._pipeline_model
    execute = pipeline_model.execute
    seen: list[np.ndarray] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        outputs = execute(*args, **kwargs)
        seen.append(np.array(outputs.logits.to_numpy(), dtype=np.float32))
        return outputs

    pipeline_model.execute = recording
    try:
        yield seen
    finally:
        del pipeline_model.execute  # the class's method again


def window_logprobs(model: LoadedModel, prompt: Sequence[int]) -> np.ndarray:
    """``log_softmax`` of MAX's logits at every position of ``prompt``: ``[n, vocab]`` float64,
    row ``t`` predicting the token after ``prompt[t]`` (the last row, the token after the
    prompt). For a window's next-token figures pass ``window[:-1]``.

    ``model`` must come from :func:`load_echo_pipeline`.
    """
    ids = [int(t) for t in prompt]
    with _captured_logits(model) as seen:
        model.model.generate([ids], max_new_tokens=1, top_k=1, ignore_eos=True)
    if not seen or seen[0].shape[0] != len(ids):
        rows = [s.shape[0] for s in seen]
        raise RuntimeError(
            f"MAX returned logits rows {rows} for a prompt of {len(ids)} tokens; expected one "
            f"forward with one row per token (load the model with load_echo_pipeline)"
        )
    return _log_softmax(seen[0])


def evaluate_max(
    paths: Sequence[str | os.PathLike[str]],
    windows: np.ndarray,
    *,
    devices: str = "cpu",
    quantization_encoding: str | None = None,
    options: ServingOptions | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    spill_bytes: int = 1 << 31,
    decode_steps: bool = False,
) -> list[EvalResult]:
    """:func:`attnquant_core.calib.evaluate` through MAX: ``paths[0]`` is the base.

    One model is loaded at a time (each builds its own KV cache); the base model's
    log-probabilities are kept for the KL of the others, in memory up to ``spill_bytes`` and
    in a temporary file above it. ``progress(checkpoint, windows_done, windows)``.

    With more than one checkpoint the base is the reference the others' KL and agreement are
    taken against, so it is served without quantization at load (:func:`reference_options`:
    ``--quant``, ``--quant-head``, ``--quant-embedding`` apply to the others): ``eval demo demo
    --quant nvfp4`` judges the load-time quantization against the model it quantizes.

    ``decode_steps``: score each window as serving computes it, its first token prefilled and
    every next one fed back as a single-row decode step (:func:`~attnquant_max.decode_step_logits`,
    on the serving graph, not the echo one), so arithmetic that runs only in decode steps
    (``--nvfp4-int8``) is what is judged; one forward per token, so slower.
    """
    import tempfile

    windows = np.asarray(windows, dtype=np.int64)
    n, T = windows.shape
    if T < 2:
        raise ValueError(f"windows of {T} token(s) predict nothing; use at least 2")
    results: list[EvalResult] = []
    base_lp: np.ndarray | None = None
    with tempfile.TemporaryDirectory(prefix="attnquant-eval-") as tmp:
        for index, path in enumerate(paths):
            tally = EvalTally(str(path))
            load = load_decode_pipeline if decode_steps else load_echo_pipeline
            reference = index == 0 and len(paths) > 1
            with load(
                path,
                seq_len=T,
                devices=devices,
                quantization_encoding=quantization_encoding,
                options=reference_options(options) if reference else options,
            ) as model:
                for i in range(n):
                    if decode_steps:
                        lp = _log_softmax(decode_step_logits(model, windows[i, :1], windows[i, 1:]))
                    else:
                        lp = window_logprobs(model, windows[i, :-1])
                    if index == 0 and len(paths) > 1:
                        if base_lp is None:
                            shape = (n, T - 1, lp.shape[-1])
                            base_lp = _store(shape, spill_bytes, Path(tmp) / "base.npy")
                        base_lp[i] = lp
                    base = None if index == 0 or base_lp is None else base_lp[i]
                    tally.add(lp, windows[i, 1:], base)
                    if progress is not None:
                        progress(str(path), i + 1, n)
            results.append(tally.result())
    return results


def reference_options(options: ServingOptions | None) -> ServingOptions | None:
    """``options`` for the base of an evaluation: the same, less quantization at load
    (``quant``, ``quant_head``, ``quant_embedding`` off), so the reference is the base itself."""
    if options is None:
        return None
    return replace(options, quant=None, quant_head=False, quant_embedding=False)


def _store(shape: tuple[int, int, int], limit: int, spill: Path) -> np.ndarray:
    """Room for the base's log-probabilities (float64): in memory, or memory-mapped above
    ``limit`` bytes."""
    if int(np.prod(shape)) * 8 <= limit:
        return np.empty(shape, np.float64)
    return np.lib.format.open_memmap(spill, mode="w+", dtype=np.float64, shape=shape)
