"""The layer-by-layer numpy forward behind ``calibrate`` and ``eval``.

All calibration sequences advance through the decoder one layer at a time: the layer's
weights are loaded (a theta checkpoint's projections rebuilt), the hidden states of every
sequence pass through it in batches, and the layer is dropped before the next is loaded. So
the memory is one layer's weights, the hidden states ``[n, T, hidden]`` and, when
calibrating, one layer's grams (written to the statistics file as each layer finishes).

The math is :mod:`attnquant_core.llama_reference`'s (Llama family: Llama 2/3, Mistral,
Qwen2/3 without sliding windows) or :mod:`attnquant_core.gemma_reference`'s (Gemma 3 text
decoders: ``Gemma3ForCausalLM``, and the text part of ``Gemma3ForConditionalGeneration``),
chosen from ``config.json``; both are driven through the same layer loop by a
:class:`Decoder`.
"""

from __future__ import annotations

import json
import logging
import resource
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property, partial
from pathlib import Path
from typing import Any

import numpy as np
from scipy.linalg.blas import dsyrk as _dsyrk

from .. import gemma_reference as gemma
from .. import llama_reference as ref
from ..io import (
    FAMILIES,
    ThetaCheckpoint,
    is_theta_checkpoint,
    open_checkpoint,
    parse_projection_key,
)
from ..io._calibration import CalibrationError, StatsWriter

__all__ = [
    "CalibrationReport",
    "Decoder",
    "ModelSource",
    "accumulate_gram",
    "calibrate",
    "final_hidden",
    "open_source",
    "peak_rss_bytes",
    "symmetrize_gram",
]

logger = logging.getLogger(__name__)

#: Projections of one Llama or Gemma 3 layer, in the order their grams are written: the
#: repeated families of every checkpoint.
LAYER_PROJECTIONS = FAMILIES


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """A checkpoint as the forward reads it: config, keys, and one tensor at a time.

    ``get`` returns the stored array (a theta checkpoint's projection is rebuilt dense).
    """

    path: Path
    config: dict
    keys: frozenset[str]
    get: Callable[[str], np.ndarray]
    prefix: str = "model"
    theta: bool = False

    def has_key(self, key: str) -> bool:
        return key in self.keys

    @property
    def text_config(self) -> dict:
        """The decoder's config: ``text_config`` of a multimodal config, else ``config``."""
        return self.config.get("text_config", self.config)

    @cached_property
    def decoder(self) -> Decoder:
        """The reference forward's per-layer pieces for this checkpoint's architecture."""
        return decoder_for(self.path, self.config)

    @property
    def num_layers(self) -> int:
        return self.decoder.num_layers(self.has_key, self.prefix)


@dataclass(frozen=True, kw_only=True)
class Decoder:
    """One architecture's reference forward, a piece at a time, as the layer loop drives it.

    ``tables(T, dtype)`` is whatever ``layer`` needs besides the weights (the rotary tables);
    ``layer(get, has_key, stem, h, index, tables, capture)`` is one decoder layer, ``get``
    returning a tensor in the compute dtype.
    """

    hidden: int
    #: ``num_attention_heads * head_dim``: the input width of ``o_proj``.
    attn_width: int
    num_layers: Callable[[Callable[[str], bool], str], int]
    embed: Callable[[np.ndarray, np.dtype], np.ndarray]
    tables: Callable[[int, np.dtype], Any]
    layer: Callable[..., np.ndarray]
    final_norm: Callable[[np.ndarray, np.ndarray], np.ndarray]
    #: ``head(get, has_key, prefix)``: the output head ``[vocab, hidden]``.
    head: Callable[[ref.Getter, Callable[[str], bool], str], np.ndarray]


def _llama(path: Path, config: dict) -> Decoder:
    """:mod:`attnquant_core.llama_reference`: RMSNorm, RoPE, GQA, SiLU-gated MLP."""
    spec = ref.llama_spec(config)

    def layer(get, has_key, stem, h, index, tables, capture) -> np.ndarray:  # see Decoder
        return ref.llama_layer(spec, get, has_key, stem, h, *tables, capture=capture)

    return Decoder(
        hidden=spec.hidden,
        attn_width=spec.n_heads * spec.head_dim,
        num_layers=partial(ref.num_layers, config),
        embed=lambda rows, dtype: np.asarray(rows, dtype=dtype),
        tables=partial(ref.rope_tables, config, spec),
        layer=layer,
        final_norm=lambda h, w: ref._rms_norm(h, w, spec.eps),
        head=lambda get, has_key, prefix: ref.llama_head(config, get, has_key, prefix)[1],
    )


def _gemma3(path: Path, config: dict) -> Decoder:
    """:mod:`attnquant_core.gemma_reference`: scaled embedding, ``1 + w`` norms, sliding and
    global layers, GELU-tanh MLP. The embedding scale is rounded to the stored embedding's
    dtype, as ``transformers`` rounds it to the weight's."""
    spec = gemma.gemma3_spec(config)

    def layer(get, has_key, stem, h, index, tables, capture) -> np.ndarray:  # see Decoder
        return gemma.gemma3_layer(
            spec, get, stem, h, tables, layer=index, has_key=has_key, capture=capture
        )

    def head(get: ref.Getter, has_key: Callable[[str], bool], prefix: str) -> np.ndarray:
        if spec.final_softcap:
            raise ref.ReferenceConfigError(
                f"{path}: final_logit_softcapping={spec.final_softcap}: the numpy eval does not "
                f"apply it (calibrate does not need it)"
            )
        return gemma.gemma3_head(get, has_key, prefix)[1]

    return Decoder(
        hidden=spec.hidden,
        attn_width=spec.n_heads * spec.head_dim,
        num_layers=lambda has_key, prefix: len(spec.layer_types),
        embed=lambda rows, dtype: gemma.gemma3_embed(
            spec, rows, dtype=dtype, embed_scale_dtype=rows.dtype
        ),
        tables=partial(gemma.gemma3_rope_tables, config, spec),
        layer=layer,
        final_norm=lambda h, w: gemma.gemma_norm(h, w, spec.eps),
        head=head,
    )


#: Architectures whose decoder layer is the Llama reference's (RMSNorm, RoPE, GQA, SiLU-gated
#: MLP, optional biases and q/k norms).
LLAMA_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
#: Gemma 3 text decoders (the Gemma reference's), with the ``model_type`` they must carry.
GEMMA3_ARCHITECTURES = ("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")
GEMMA3_MODEL_TYPES = ("gemma3_text", "gemma3")
ARCHITECTURES = LLAMA_ARCHITECTURES + GEMMA3_ARCHITECTURES


def decoder_for(path: Path, config: dict) -> Decoder:
    """The forward ``config`` asks for (``architectures``, and for Gemma 3 its ``model_type``);
    refuse, in one line, a checkpoint whose layers the numpy forward would compute wrongly."""
    archs = config.get("architectures") or []
    if any(a in LLAMA_ARCHITECTURES for a in archs):
        return _llama(path, config)
    if any(a in GEMMA3_ARCHITECTURES for a in archs) and (
        config.get("model_type") in GEMMA3_MODEL_TYPES
    ):
        return _gemma3(path, config)
    raise ref.ReferenceConfigError(
        f"{path}: architectures {archs} is not one the numpy forward runs "
        f"({', '.join(ARCHITECTURES)}; Gemma 3 with model_type {' or '.join(GEMMA3_MODEL_TYPES)}"
        f"); write the statistics with another tool in the public format (see "
        f"attnquant_core.calib) and pass them to decompose --calibration"
    )


def check_architecture(path: Path, config: dict) -> None:
    """Refuse, in one line, a checkpoint whose layers the numpy forward would compute wrongly."""
    decoder_for(path, config)


def _prefix(stack: str) -> str:
    """``model.layers`` (core's name of the layer stack) -> ``model`` (the reference's prefix)."""
    return stack[: -len(".layers")] if stack.endswith(".layers") else stack


def open_source(path: str | Path) -> ModelSource:
    """Open a dense or theta checkpoint directory for the numpy forward.

    A theta checkpoint is read through core's public API: the stock keys are its
    ``ThetaCheckpoint.stock_keys()``, each projection is rebuilt with ``rebuild``.
    """
    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CalibrationError(f"{config_file}: missing; the numpy forward needs config.json")
    config = json.loads(config_file.read_text())
    check_architecture(path, config)  # the spec too: a config it cannot run fails here
    if is_theta_checkpoint(path):
        theta = ThetaCheckpoint.open(path)
        stock = frozenset(theta.stock_keys())
        copied = set(theta.copied_keys())

        def get_theta(key: str) -> np.ndarray:
            if key in copied:
                return theta.tensors.get(key)
            parsed = parse_projection_key(key)
            if parsed is None or parsed[2] not in theta.families:
                raise CalibrationError(f"{path}: no {key!r}")
            return theta.rebuild(parsed[2], parsed[1])

        return ModelSource(
            path=path,
            config=config,
            keys=stock,
            get=get_theta,
            prefix=_prefix(theta.stack),
            theta=True,
        )
    ckpt = open_checkpoint(path)
    return ModelSource(
        path=path,
        config=config,
        keys=frozenset(ckpt.keys()),
        get=ckpt.get,
        prefix=_prefix(ckpt.stack),
    )


def _layer_weights(source: ModelSource, layer: int, dtype: np.dtype) -> dict[str, np.ndarray]:
    stem = f"{source.prefix}.layers.{layer}."
    return {k: np.asarray(source.get(k), dtype=dtype) for k in source.keys if k.startswith(stem)}


def _batches(n: int, batch: int) -> Iterator[slice]:
    for start in range(0, n, batch):
        yield slice(start, min(n, start + batch))


def _embedded(source: ModelSource, windows: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """The embedded windows ``[n, T, hidden]``; refuses ids outside the vocabulary."""
    windows = np.asarray(windows, dtype=np.int64)
    if windows.ndim != 2 or not windows.size:
        raise CalibrationError("token windows must be a non-empty [n, T] array")
    embed_key = f"{source.prefix}.embed_tokens.weight"
    if not source.has_key(embed_key):
        raise ref.ReferenceConfigError(f"{source.path}: no {embed_key!r}")
    embed = source.get(embed_key)
    if windows.min() < 0 or windows.max() >= embed.shape[0]:
        raise CalibrationError(f"token ids outside 0..{embed.shape[0] - 1} of {embed_key!r}")
    return source.decoder.embed(embed[windows], dtype)


def _forward_layers(
    source: ModelSource,
    windows: np.ndarray,
    *,
    dtype: np.dtype,
    batch: int,
    capture: ref.Capture | None = None,
    after_layer: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """Hidden states ``[n, T, hidden]`` after the last layer (before the final norm).

    ``capture`` sees each projection's input, batch by batch; ``after_layer(done, total)`` is
    called when every window has passed layer ``done - 1``.
    """
    decoder = source.decoder
    windows = np.asarray(windows, dtype=np.int64)
    h = _embedded(source, windows, dtype)
    tables = decoder.tables(windows.shape[1], dtype)
    num_layers = source.num_layers
    for layer in range(num_layers):
        weights = _layer_weights(source, layer, dtype)

        def get(key: str, weights: dict = weights) -> np.ndarray:
            if key not in weights:
                raise ref.ReferenceConfigError(f"{source.path}: no {key!r}")
            return weights[key]

        stem = f"{source.prefix}.layers.{layer}"
        for rows in _batches(len(h), batch):
            h[rows] = decoder.layer(
                get, weights.__contains__, stem, h[rows], layer, tables, capture
            )
        del weights
        if after_layer is not None:
            after_layer(layer + 1, num_layers)
    return h


def final_hidden(
    source: ModelSource,
    windows: np.ndarray,
    *,
    dtype: np.dtype | type = np.float32,
    batch: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> np.ndarray:
    """Final-normed hidden states ``[n, T, hidden]`` of ``windows``; logits are ``h @ head.T``."""
    dt = np.dtype(dtype)
    h = _forward_layers(source, windows, dtype=dt, batch=batch, after_layer=progress)
    norm = np.asarray(source.get(f"{source.prefix}.norm.weight"), dtype=dt)
    return source.decoder.final_norm(h, norm)


def output_head(source: ModelSource, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """``lm_head.weight`` ``[vocab, hidden]``, or the tied embedding."""
    return source.decoder.head(
        lambda key: np.asarray(source.get(key), dtype=dtype), source.has_key, source.prefix
    )


#: Bytes of the float64 copy of a projection's input made at a time while its gram accumulates.
GRAM_CHUNK_BYTES = 64 << 20


def accumulate_gram(
    acc: np.ndarray | None, x: np.ndarray, *, chunk_bytes: int = GRAM_CHUNK_BYTES
) -> np.ndarray:
    """``acc + sum_t x_t x_t^T`` (``x`` is ``[..., in]``) in float64, in place, upper triangle.

    ``acc`` is None (a new ``[in, in]`` Fortran-ordered float64 gram is made) or a previous
    return value. BLAS ``dsyrk`` adds into ``acc`` itself, so no second ``[in, in]`` array is
    made (``acc += x.T @ x`` makes one: 512 MiB at ``in`` 8192), and ``x`` is converted to
    float64 ``chunk_bytes`` at a time rather than whole. Only the upper triangle
    (``i <= j``) is accumulated: call :func:`symmetrize_gram` once when done.
    """
    flat = x.reshape(-1, x.shape[-1])
    n = flat.shape[1]
    if acc is None:
        acc = np.zeros((n, n), np.float64, order="F")
    rows = max(1, chunk_bytes // (8 * n))
    for start in range(0, len(flat), rows):
        chunk = np.asarray(flat[start : start + rows], dtype=np.float64)  # [k, n], C order
        # chunk.T is [n, k] in Fortran order: dsyrk's A, so it is not copied; C = A A^T + C.
        out = _dsyrk(1.0, chunk.T, beta=1.0, c=acc, trans=0, lower=0, overwrite_c=1)
        if out is not acc:  # pragma: no cover - f2py copies only a C that is not Fortran-ordered
            acc[...] = out
        del chunk, out  # before the next chunk is made
    return acc


def symmetrize_gram(G: np.ndarray, *, block: int = 512) -> np.ndarray:
    """Copy the upper triangle of ``G`` onto its lower one, in place, ``block`` rows at a time."""
    n = G.shape[0]
    for start in range(0, n, block):
        stop = min(n, start + block)
        diag = G[start:stop, start:stop]
        diag[...] = np.triu(diag) + np.triu(diag, 1).T
        G[stop:, start:stop] = G[start:stop, stop:].T
    return G


@dataclass(frozen=True, kw_only=True)
class CalibrationReport:
    """What a calibration run did: tokens, sequences, grams written, peak memory."""

    path: Path
    tokens: int
    sequences: int
    seq_len: int
    grams: int
    peak_rss_bytes: int


def calibrate(
    source: ModelSource,
    windows: np.ndarray,
    output: str | Path,
    *,
    dtype: np.dtype | type = np.float32,
    stats_dtype: np.dtype | type = np.float32,
    batch: int = 8,
    progress: Callable[[int, int], None] | None = None,
) -> CalibrationReport:
    """Run ``windows`` ``[n, T]`` through ``source`` layer by layer and write every projection's
    input gram ``sum_t x_t x_t^T`` (accumulated in float64) to ``output``.

    The grams of layer ``l`` are written as soon as layer ``l`` has seen every window, so only
    one layer's grams are held.
    """
    windows = np.asarray(windows, dtype=np.int64)
    decoder = source.decoder
    inner = source.text_config.get("intermediate_size")
    widths = {
        "self_attn.o_proj": decoder.attn_width,
        "mlp.down_proj": int(inner) if inner else None,
    }
    shapes: dict[str, int] = {}
    for layer in range(source.num_layers):
        for name in LAYER_PROJECTIONS:
            key = f"{source.prefix}.layers.{layer}.{name}.weight"
            if not source.has_key(key):
                raise ref.ReferenceConfigError(f"{source.path}: no {key!r}")
            if widths.get(name, decoder.hidden) is None:  # no intermediate_size in the config
                widths[name] = int(np.shape(source.get(key))[1])
            shapes[key] = int(widths.get(name) or decoder.hidden)
    tokens = int(windows.size)
    # One gram per distinct input: q/k/v share one, gate/up share one (written under each key).
    grams: dict[tuple[str, ...], np.ndarray] = {}

    def capture(names: tuple[str, ...], x: np.ndarray) -> None:
        grams[names] = accumulate_gram(grams.get(names), x)

    with StatsWriter(output, shapes, tokens=tokens, dtype=stats_dtype) as writer:

        def layer_done(done: int, total: int) -> None:
            for names, G in grams.items():  # capture order is LAYER_PROJECTIONS order
                symmetrize_gram(G)
                for name in names:
                    writer.write(f"{source.prefix}.layers.{done - 1}.{name}.weight", G)
            grams.clear()
            if progress is not None:
                progress(done, total)

        _forward_layers(
            source,
            windows,
            dtype=np.dtype(dtype),
            batch=batch,
            capture=capture,
            after_layer=layer_done,
        )
    return CalibrationReport(
        path=Path(output),
        tokens=tokens,
        sequences=int(windows.shape[0]),
        seq_len=int(windows.shape[1]),
        grams=len(shapes),
        peak_rss_bytes=peak_rss_bytes(),
    )
