"""In-process generation through MAX: greedy tokens, teacher-forced log-probs, logit parity.

The primitives behind ``attnquant verify`` and ``attnquant generate``. ``max.pipelines``
takes ~15 s to import, so it is imported inside :func:`load_pipeline` only.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from attnquant_core.serving import ServingOptions

from ._config import require_device, require_implemented

__all__ = [
    "AGREEMENT_THRESHOLD",
    "DELTA_THRESHOLD",
    "LoadedModel",
    "ParityReport",
    "decode_logprobs",
    "decode_step_logits",
    "greedy_generate",
    "greedy_logprobs",
    "load_pipeline",
    "logit_parity",
]

logger = logging.getLogger(__name__)

#: How a base is served for comparison: the stock graph, whatever the checkpoint.
STOCK = ServingOptions(path="precompute-outside")

#: Native-equivalent (docs/serving-paths.md): max |logprob delta| below this ...
DELTA_THRESHOLD = 1.0
#: ... and greedy-token agreement at least this.
AGREEMENT_THRESHOLD = 0.9
#: A base position whose top two log-probabilities are closer than this (nats) is a near-tie:
#: a greedy miss there says little about the theta model (:attr:`ParityReport.near_ties`).
NEAR_TIE = 0.1


@dataclass
class LoadedModel:
    """A MAX text-generation model loaded in-process, with its tokenizer.

    Close it (or use it as a context manager) to release the KV cache.
    """

    path: Path
    model: Any  # max.pipelines.AutoModel
    tokenizer: Any  # max.pipelines.AutoTokenizer
    max_batch_size: int
    max_length: int

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` as a completion prompt (special tokens added as serve does)."""
        return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    @property
    def weight_bytes(self) -> int | None:
        """Bytes of the weights the compiled decoder holds (attnquant Llama models; else None)."""
        pipeline = getattr(self.model, "pipeline", None)
        value = getattr(getattr(pipeline, "_pipeline_model", None), "weight_bytes", None)
        return int(value) if value else None

    def close(self) -> None:
        self.model.close()

    def __enter__(self) -> LoadedModel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def load_pipeline(
    model_path: str | os.PathLike[str],
    *,
    max_length: int,
    max_batch_size: int = 1,
    devices: str = "cpu",
    quantization_encoding: str | None = None,
    options: ServingOptions | None = None,
    overrides: Mapping[str, object] | None = None,
) -> LoadedModel:
    """Load ``model_path`` (theta or dense) through the attnquant MAX architectures.

    Parameters
    ----------
    model_path : path
        A local checkpoint directory.
    max_length : int
        Longest prompt plus continuation, in tokens.
    max_batch_size : int
        Rows per forward; teacher-forced scoring batches prefixes up to this.
    devices : str
        MAX's devices string: ``"cpu"``, ``"gpu"``, ``"gpu:0"``.
    quantization_encoding : str, optional
        ``float32`` on CPU when not given; MAX's default elsewhere.
    options : ServingOptions, optional
        What this load serves (default: the ``ATTNQUANT_*`` variables). The attnquant
        architectures are registered with MAX bound to them for this load.
    overrides : mapping, optional
        More flat ``PipelineArgs`` fields for ``AutoModel`` (e.g. ``enable_echo``).
    """
    options = ServingOptions.from_env() if options is None else options
    require_implemented(options)
    require_device(model_path, devices, quantization_encoding, max_length)  # say why not
    if quantization_encoding is None and devices == "cpu":
        quantization_encoding = "float32"
    from max.pipelines import AutoModel, AutoTokenizer

    _register_architectures(options)
    fields: dict[str, object] = {"max_length": max_length}
    if quantization_encoding is not None:
        fields["quantization_encoding"] = quantization_encoding
    fields.update(overrides or {})
    model = AutoModel(str(model_path), max_batch_size=max_batch_size, devices=devices, **fields)
    tokenizer = AutoTokenizer(str(model_path))
    return LoadedModel(
        path=Path(model_path),
        model=model,
        tokenizer=tokenizer,
        max_batch_size=max_batch_size,
        max_length=max_length,
    )


def _register_architectures(options: ServingOptions) -> None:
    """Register the attnquant architectures with MAX, bound to ``options``, for the next load.

    MAX looks the architecture up by name when a model is loaded; registering the variants
    whose weight adapter carries ``options`` (with ``allow_override``, as MAX does for
    ``custom_architectures``) is how a load in this process receives them.
    """
    from max.pipelines.lib.arch_lookup import ARCH_LOOKUP

    from .architectures import build_architectures

    # MAX warns at every override; replacing our own registration is the point, so its logger
    # is quietened for the call (a real problem raises, and is not a warning).
    quiet = logging.getLogger("max.pipelines")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        for arch in build_architectures(options):
            ARCH_LOOKUP.register(arch, allow_override=True)
    finally:
        quiet.setLevel(level)


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def greedy_generate(model: LoadedModel, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """The ``max_new_tokens`` greedy (top-1) tokens after ``prompt``, EOS ignored."""
    result = model.model.generate(
        [list(prompt)], max_new_tokens=max_new_tokens, top_k=1, ignore_eos=True
    )
    return list(result.sequences[0][len(prompt) :])


@dataclass(frozen=True)
class TokenScores:
    """Teacher-forced scores of a continuation, one entry per continuation token.

    Attributes
    ----------
    logprobs : ndarray of shape (n,)
        ``log p(continuation[t] | prompt + continuation[:t])``, float64.
    greedy : ndarray of shape (n,)
        The model's top-1 token at each of those positions.
    margin : ndarray of shape (n,) or None
        Its top-1 minus its top-2 log-probability there (how close the greedy choice was).
    """

    logprobs: np.ndarray
    greedy: np.ndarray
    margin: np.ndarray | None = None

    @classmethod
    def from_logits(cls, logits: np.ndarray, continuation: Sequence[int]) -> TokenScores:
        """The scores of ``continuation`` from the next-token ``logits`` ``[n, vocab]`` of each
        of its positions (any forward's: MAX's, or a numpy reference's)."""
        logp = _log_softmax(logits)
        top2 = np.partition(logp, -2, axis=-1)[:, -2:]
        return cls(
            logprobs=logp[np.arange(len(continuation)), list(continuation)],
            greedy=logp.argmax(axis=-1),
            margin=top2[:, 1] - top2[:, 0],
        )


def greedy_logprobs(
    model: LoadedModel, prompt: Sequence[int], continuation: Sequence[int]
) -> TokenScores:
    """Teacher-forced log-probabilities of ``continuation`` after ``prompt``.

    Each prefix ``prompt + continuation[:t]`` is one row of a one-step forward
    (rows batched up to ``model.max_batch_size``), and the next-token logits of
    each row give ``log p(continuation[t])`` and the model's greedy token there.
    """
    prompt, continuation = list(prompt), list(continuation)
    if not prompt:
        raise ValueError("greedy_logprobs needs a non-empty prompt")
    prefixes = [prompt + continuation[:t] for t in range(len(continuation))]
    rows: list[np.ndarray] = []
    for start in range(0, len(prefixes), model.max_batch_size):
        chunk = prefixes[start : start + model.max_batch_size]
        result = model.model.generate(
            chunk, max_new_tokens=1, top_k=1, ignore_eos=True, output_logits=True
        )
        rows.extend(np.asarray(logits[0]) for logits in result.logits)
    if not rows:
        return TokenScores(np.zeros(0), np.zeros(0, dtype=np.int64), np.zeros(0))
    return TokenScores.from_logits(np.stack(rows), continuation)


class _TeacherForcing:
    """A logits processor (MAX's documented in-place hook) that copies each forward's
    next-token logits row and then leaves the greedy sampler only ``tokens[t]`` to pick, so
    forward ``t + 1`` is a decode step on ``prompt + tokens[: t + 1]``."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = [int(t) for t in tokens]
        self.rows: list[np.ndarray] = []

    def __call__(self, inputs: Any) -> None:
        from max.driver import Buffer

        logits = inputs.logits
        self.rows.append(np.array(logits[-1, :].to_numpy(), dtype=np.float32))
        forced = np.full(tuple(logits.shape), np.finfo(np.float32).min, dtype=np.float32)
        forced[-1, self.tokens[min(len(self.rows), len(self.tokens)) - 1]] = 0.0
        # The copy is enqueued: wait for it while ``forced`` (its source) is still alive.
        logits.inplace_copy_from(Buffer.from_numpy(forced).to(logits.device))
        logits.device.synchronize()


def decode_step_logits(
    model: LoadedModel, prompt: Sequence[int], continuation: Sequence[int]
) -> np.ndarray:
    """Next-token logits ``[len(continuation), vocab]`` (float32) of ``continuation`` after
    ``prompt`` as a served model computes them: ``prompt`` prefilled once (row 0 is its last
    row), then each continuation token fed back as one single-row decode step on the KV cache
    (row ``t`` predicts ``continuation[t]``), the greedy choice forced to it."""
    from max.pipelines.context import EOSTracker, SamplingParams, TextContext, TokenBuffer
    from max.pipelines.lib.generate import GenerateIterator

    prompt, continuation = [int(t) for t in prompt], [int(t) for t in continuation]
    if not prompt or not continuation:
        raise ValueError("decode_step_logits needs a non-empty prompt and continuation")
    forcing = _TeacherForcing(continuation)
    context = TextContext(
        max_length=len(prompt) + len(continuation),
        tokens=TokenBuffer(np.asarray(prompt, dtype=np.int64)),
        eos_tracker=EOSTracker(eos_token_ids=set()),
        sampling_params=SamplingParams(
            top_k=1,
            max_new_tokens=len(continuation),
            ignore_eos=True,
            seed=0,
            logits_processors=[forcing],
        ),
    )
    with GenerateIterator.from_contexts(
        model.model.pipeline, [context], caller="decode_step_logits()"
    ) as batch:
        for _ in batch:
            pass
        generated = batch.sequences[0][len(prompt) :]
    if generated != continuation or len(forcing.rows) != len(continuation):
        raise RuntimeError(
            f"MAX decoded {len(forcing.rows)} forward(s) to {generated[:8]}... for a forced "
            f"continuation of {len(continuation)} token(s) {continuation[:8]}...: the logits "
            "processor did not steer the greedy sampler"
        )
    return np.stack(forcing.rows)


def decode_logprobs(
    model: LoadedModel, prompt: Sequence[int], continuation: Sequence[int]
) -> TokenScores:
    """:func:`greedy_logprobs` through decode steps (:func:`decode_step_logits`): the scores
    serving produces token by token. :func:`greedy_logprobs` runs each prefix as one whole
    forward, so it never takes what runs only in decode steps (``--nvfp4-int8``, below 8
    rows a step)."""
    return TokenScores.from_logits(decode_step_logits(model, prompt, continuation), continuation)


@dataclass(frozen=True, kw_only=True)
class ParityReport:
    """Logit parity of a served theta model against its base (docs/serving-paths.md).

    Attributes
    ----------
    max_abs_logprob_delta : float
        Largest ``|log p_base(t) - log p_theta(t)|`` over every scored token.
    agreement : float
        Fraction of positions where the theta model's greedy token is the base's.
    native_equivalent : bool
        ``max_abs_logprob_delta < 1.0`` and ``agreement >= 0.9``.
    num_prompts, num_tokens : int
        What was scored.
    miss_margins : tuple of float
        The base's top-1 minus top-2 log-probability at each position where the theta model's
        greedy token differs, ascending (empty where the base's margins are unknown): misses
        at near-ties are the ones any small perturbation makes.
    near_ties : int or None
        Positions where the base's margin is under :data:`NEAR_TIE` nats, missed or not.
    base_weight_bytes, theta_weight_bytes : int or None
        Bytes of the weights each compiled decoder holds, where known
        (:attr:`LoadedModel.weight_bytes`): what NVFP4 or an in-graph path saves.
    decode_max_abs_logprob_delta, decode_agreement : float or None
        The same two figures with the theta model scored through single-row decode steps
        (:func:`decode_logprobs`), as serving runs it token by token, where measured: arithmetic
        that runs only in decode steps (``--nvfp4-int8``) is judged here, and
        ``native_equivalent`` then needs both bounds met on both scorings.
    """

    max_abs_logprob_delta: float
    agreement: float
    native_equivalent: bool
    num_prompts: int
    num_tokens: int
    miss_margins: tuple[float, ...] = ()
    near_ties: int | None = None
    base_weight_bytes: int | None = None
    theta_weight_bytes: int | None = None
    decode_max_abs_logprob_delta: float | None = None
    decode_agreement: float | None = None

    def with_decode_steps(self, decode: ParityReport) -> ParityReport:
        """This report with ``decode`` (the theta model scored through decode steps on the
        same continuations) as its decode-step figures, and the verdict over both."""
        return replace(
            self,
            decode_max_abs_logprob_delta=decode.max_abs_logprob_delta,
            decode_agreement=decode.agreement,
            native_equivalent=self.native_equivalent and decode.native_equivalent,
        )

    @classmethod
    def from_scores(
        cls,
        base: Sequence[TokenScores],
        theta: Sequence[TokenScores],
        tokens: Sequence[Sequence[int]],
    ) -> ParityReport:
        deltas = [np.abs(b.logprobs - t.logprobs) for b, t in zip(base, theta, strict=True)]
        agree = [t.greedy == np.asarray(c) for t, c in zip(theta, tokens, strict=True)]
        n = sum(len(c) for c in tokens)
        delta = float(max((d.max() for d in deltas if d.size), default=0.0))
        agreement = float(sum(int(a.sum()) for a in agree) / n) if n else 1.0
        margins = [b.margin for b in base]
        known = all(m is not None for m in margins)
        misses = (
            sorted(float(x) for m, a in zip(margins, agree, strict=True) for x in m[~a])
            if known
            else []
        )
        return cls(
            max_abs_logprob_delta=delta,
            agreement=agreement,
            native_equivalent=delta < DELTA_THRESHOLD and agreement >= AGREEMENT_THRESHOLD,
            num_prompts=len(tokens),
            num_tokens=n,
            miss_margins=tuple(misses),
            near_ties=int(sum((m < NEAR_TIE).sum() for m in margins)) if known else None,
        )


@contextmanager
def _loaded(model: str | os.PathLike[str] | LoadedModel, **kwargs: Any) -> Iterator[LoadedModel]:
    """``model`` itself when already loaded (left open), else loaded here and closed after."""
    if isinstance(model, LoadedModel):
        yield model
        return
    loaded = load_pipeline(model, **kwargs)
    try:
        yield loaded
    finally:
        loaded.close()


def logit_parity(
    base_path: str | os.PathLike[str] | LoadedModel,
    theta_path: str | os.PathLike[str] | LoadedModel,
    prompts: Sequence[str | Sequence[int]],
    max_new_tokens: int,
    *,
    max_length: int = 512,
    max_batch_size: int = 8,
    devices: str = "cpu",
    quantization_encoding: str | None = None,
    options: ServingOptions | None = None,
) -> ParityReport:
    """Compare ``theta_path`` served by attnquant with ``base_path`` served unchanged.

    The base model's greedy continuation of each prompt is generated, then scored
    teacher-forced on both models, and on the theta model once more through single-row decode
    steps (:func:`decode_logprobs`, one prompt at a time: batch-1 decoding as served). Each
    side is a checkpoint directory, loaded here one at a time, or a :class:`LoadedModel` (used
    and left open). Prompts are text (encoded with the base tokenizer) or token ids.

    A base loaded here ignores ``options``: it is served on the stock path
    (precompute-outside: a dense base as it is, a theta base rebuilt once at load,
    unquantized), so ``logit_parity(B, B, options=...)`` with an in-graph path or NVFP4 checks
    that execution path against the stock graph on the same checkpoint. The theta side serves
    ``options`` (default: the ``ATTNQUANT_*`` variables).
    """
    options = ServingOptions.from_env() if options is None else options
    common: dict[str, Any] = {
        "max_length": max_length,
        "max_batch_size": max_batch_size,
        "devices": devices,
        "quantization_encoding": quantization_encoding,
    }
    with _loaded(base_path, options=STOCK, **common) as base:
        base_bytes = base.weight_bytes
        encoded = [base.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        continuations = [greedy_generate(base, ids, max_new_tokens) for ids in encoded]
        base_scores = [
            greedy_logprobs(base, ids, cont)
            for ids, cont in zip(encoded, continuations, strict=True)
        ]
    with _loaded(theta_path, options=options, **common) as theta:
        theta_bytes = theta.weight_bytes
        theta_scores = [
            greedy_logprobs(theta, ids, cont)
            for ids, cont in zip(encoded, continuations, strict=True)
        ]
        decode_scores = [
            decode_logprobs(theta, ids, cont)
            for ids, cont in zip(encoded, continuations, strict=True)
        ]
    report = replace(
        ParityReport.from_scores(base_scores, theta_scores, continuations),
        base_weight_bytes=base_bytes,
        theta_weight_bytes=theta_bytes,
    ).with_decode_steps(ParityReport.from_scores(base_scores, decode_scores, continuations))
    logger.info(
        "logit parity %s vs %s: max |dlogp| %.4g (decode steps %.4g), agreement %.3f (%.3f) -> %s",
        getattr(theta_path, "path", theta_path),
        getattr(base_path, "path", base_path),
        report.max_abs_logprob_delta,
        report.decode_max_abs_logprob_delta,
        report.agreement,
        report.decode_agreement,
        "native-equivalent" if report.native_equivalent else "NOT native-equivalent",
    )
    return report
