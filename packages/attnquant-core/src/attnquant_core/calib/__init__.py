"""Calibration: the input statistics of each projection, and fitting for the output error.

* The statistics format (public, model-agnostic): one safetensors file, key
  ``<projection weight key without .weight>.input_gram`` holding ``sum_t x_t x_t^T`` over the
  calibration tokens (float32 or float64, ``[in, in]``), ``__metadata__ {"tokens": "<count>"}``.
  :func:`read_stats`, :func:`write_stats`, :class:`StatsWriter`, :func:`stats_digest`.
* Whitened fitting (SVD-LLM, Basis Sharing): :func:`whitening` makes ``S`` with
  ``S S^T = G + delta I``; :func:`whitened_svd`, :func:`whitened_row_scale`,
  :func:`whitened_residual_svd` and :func:`whitened_shared_basis` minimise
  ``||(W - W_hat) X||_F``.
* Sequential correction (SVD-LLM V2, Basis Sharing): :func:`decompose_calibrated` calibrates
  in the same pass and fits each layer against the inputs of the already-compressed layers
  (:func:`sequential_target`: ``||W X - W_hat X_hat||`` as a whitened fit of a corrected target).
* Making statistics: :func:`read_texts`, :func:`token_stream` and :func:`token_windows` turn
  text into token windows; :func:`calibrate` runs them through a checkpoint
  (:func:`open_source`, dense or theta) layer by layer in numpy and writes the grams.
* Sensitivity: :func:`measure_sensitivity` measures what a unit of each projection's squared
  output error costs in KL, for ``decompose --budget --allocation sensitivity``; the weights
  live beside the statistics file (:func:`sensitivity_path`, :func:`read_sensitivity`).
* Judging by function: :func:`evaluate` gives perplexity, top-1 agreement and KL against a
  base model on held-out windows.
"""

from ..fit._sequential import (
    left_factor,
    refit_coefficients,
    sequential_error,
    sequential_target,
)
from ..fit._whiten import (
    DEFAULT_DAMPING,
    Whitening,
    output_error,
    whitened_residual_svd,
    whitened_row_scale,
    whitened_shared_basis,
    whitened_spectrum,
    whitened_svd,
    whitening,
)
from ..io._calibration import (
    GRAM_SUFFIX,
    CalibrationError,
    CalibrationStats,
    StatsWriter,
    gram_key,
    read_stats,
    stats_digest,
    write_stats,
)
from ._data import (
    DEFAULT_SAMPLES,
    DEFAULT_SEQ_LEN,
    read_texts,
    token_stream,
    token_windows,
    windows_digest,
)
from ._evaluate import EvalResult, EvalTally, evaluate
from ._forward import (
    CalibrationReport,
    ModelSource,
    calibrate,
    final_hidden,
    open_source,
    output_head,
    peak_rss_bytes,
)
from ._sensitivity import (
    PROBE_RATIO,
    SENSITIVITY_SAMPLES,
    SENSITIVITY_SUFFIX,
    Sensitivity,
    measure_sensitivity,
    read_sensitivity,
    sensitivity_path,
    with_sensitivity,
)
from ._sequential import SEQUENTIAL_STAGES, decompose_calibrated

__all__ = [
    # the statistics file
    "GRAM_SUFFIX",
    "CalibrationError",
    "CalibrationStats",
    "StatsWriter",
    "gram_key",
    "read_stats",
    "stats_digest",
    "write_stats",
    # whitened fitting
    "DEFAULT_DAMPING",
    "Whitening",
    "output_error",
    "whitened_residual_svd",
    "whitened_row_scale",
    "whitened_shared_basis",
    "whitened_spectrum",
    "whitened_svd",
    "whitening",
    # sequential correction: fit against the compressed model's own inputs
    "SEQUENTIAL_STAGES",
    "decompose_calibrated",
    "left_factor",
    "refit_coefficients",
    "sequential_error",
    "sequential_target",
    "windows_digest",
    # making statistics: text, tokens, the layer-by-layer forward
    "DEFAULT_SAMPLES",
    "DEFAULT_SEQ_LEN",
    "CalibrationReport",
    "ModelSource",
    "calibrate",
    "final_hidden",
    "open_source",
    "output_head",
    "peak_rss_bytes",
    "read_texts",
    "token_stream",
    "token_windows",
    # what each projection's output error costs: the sensitivity allocation
    "PROBE_RATIO",
    "SENSITIVITY_SAMPLES",
    "SENSITIVITY_SUFFIX",
    "Sensitivity",
    "measure_sensitivity",
    "read_sensitivity",
    "sensitivity_path",
    "with_sensitivity",
    # judging by function
    "EvalResult",
    "EvalTally",
    "evaluate",
]
