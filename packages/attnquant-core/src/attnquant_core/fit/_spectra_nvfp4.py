"""A budget counted in bytes, where a banded family's ``W0`` may be stored in NVFP4.

``decompose_budget(..., quant="nvfp4")`` lets the banded form store each band's ``W0`` in
4.5 bits a weight (:mod:`attnquant_core.forms._nvfp4`) beside the float forms. Parameters no
longer measure size then (a 4-bit weight is not a float32 one), so every candidate of every
family is costed in **bytes**, one currency for all:

* float forms: every stored number at the storage dtype's size (``s``, ``W0``, bases, ``U``,
  ``V``), so their allocation is the parameter one scaled by the item size;
* banded with an NVFP4 ``W0`` at ``G`` bands: a fixed ``G * nvfp4_bytes(out, in)`` (one
  4-bit code a weight, one E4M3 scale per 16, one float32 per band: exactly
  :attr:`NVFP4Tensor.nbytes`) plus ``L * out`` for ``s``, then ``(out + in)`` numbers per rank
  unit, at the storage dtype's size;
* the budget divides the dense projections' bytes at their source dtype.

The quantized candidate's error curve is the spectrum of its true residual
``W_l - diag(s_l) Q(W0_b)`` (``Q`` the NVFP4 round trip of the float32 band mean, ``s`` least
squares against it, rounded to the storage dtype; whitened with calibration statistics), the
very matrix the fit factors, so ranks are allocated on the post-quantization residual and the
predicted error is the achieved one. It is tried at ``G = L`` (passthrough: each layer's own
weight in 4 bits) and at the ``G`` the float banded form tries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from ..forms._nvfp4 import NVFP4Tensor
from ..io._manifest import nvfp4_bytes
from . import _spectra
from ._band_gains import band_residual_gains
from ._decompose import DecomposeProgress, SVDOptions, check_quant, quantized_band
from ._gptq import band_gram
from ._spectra import (
    Candidate,
    Getter,
    _band_mean,
    _blocks_set,
    _cap,
    _matrix_gains,
    _Source,
    _Spectra,
    _spectra_all,
)

__all__ = ["NVFP4_SEED", "budget_spectra", "in_bytes", "nvfp4_band"]


#: Seeds the sketches of the quantized residuals apart from the float banded ones.
NVFP4_SEED = 3_000_017


def nvfp4_band(
    get: Getter, layers: Sequence[int], src: _Source, band: int
) -> tuple[NVFP4Tensor, np.ndarray]:
    """A band's ``W0`` in NVFP4 (the float32 band mean, quantized) and its dequantization.

    Rounded by GPTQ against the band's summed grams where statistics cover every layer of it
    (and ``src.rounding`` is ``"gptq"``), else to nearest. The spectra and the fit both call
    this, so both see the same ``Q(W0)``.
    """
    mean = _band_mean(get, layers, src.shape, src.dtype, np.dtype(np.float32))
    gram = band_gram(src.white, layers) if src.rounding == "gptq" else None
    return quantized_band(mean, f"{src.name} band {band}", gram)


def _nvfp4_candidates(
    spectra: _Spectra,
    *,
    quant: str,
    banded_blocks: Sequence[int] | None,
    cap_budget: float,
    svd: SVDOptions,
    progress: Callable[[DecomposeProgress], None] | None,
) -> list[Candidate]:
    """The banded candidates with an NVFP4 ``W0``, at ``G = L`` and the float banded ``G``s."""
    src = spectra.source
    name, (out_dim, in_dim), L = src.name, src.shape, src.num_layers
    per = src.store.itemsize
    full = min(out_dim, in_dim)
    layer_cap = (
        full
        if full <= _spectra.BUDGET_EXACT_MAX_DIM  # read late: tests lower it
        else _cap(full, out_dim * in_dim, out_dim + in_dim, cap_budget)
    )
    Gs = sorted({*_blocks_set(banded_blocks, (1, 2, 4, L // 2), L), L})
    candidates, done = [], 0

    def tick() -> None:
        nonlocal done
        if progress is not None:
            progress(DecomposeProgress(name, done, len(Gs) * L, float("nan"), stage="nvfp4"))
        done += 1

    for G in Gs:
        gains, base = band_residual_gains(
            src.get,
            src.white,
            L,
            src.store,
            G,
            lambda b, layers: nvfp4_band(src.get, layers, src, b)[1],
            lambda R, seed: _matrix_gains(R, layer_cap, svd, seed),
            seed=lambda b, layer, G=G: (NVFP4_SEED, G, b, layer),
            on_layer=tick,
        )
        candidates.append(
            Candidate(
                family=name,
                form="banded",
                blocks=G,
                side=None,
                fixed=G * nvfp4_bytes(src.shape) + L * out_dim * per,
                base=base,
                unit_cost=np.full(L, (out_dim + in_dim) * per, np.int64),
                gains=tuple(gains),
                groups=tuple((layer,) for layer in range(L)),
                caps=(layer_cap,) * L,
                quant=quant,
            )
        )
    return candidates


def in_bytes(
    spectra: Sequence[_Spectra],
    *,
    quant: str,
    forms: Sequence[str],
    banded_blocks: Sequence[int] | None,
    cap_budget: float,
    svd: SVDOptions,
    progress: Callable[[DecomposeProgress], None] | None = None,
) -> list[_Spectra]:
    """Every family's candidates costed in bytes, plus (when ``banded`` is allowed) its banded
    candidates with a ``quant`` ``W0``; the allocation then divides the dense bytes."""
    out = []
    for s in spectra:
        per = s.source.store.itemsize
        # The float forms store every number at the storage dtype: their costs times its size.
        candidates = [
            replace(c, fixed=c.fixed * per, unit_cost=c.unit_cost * per) for c in s.candidates
        ]
        if "banded" in forms:
            candidates += _nvfp4_candidates(
                s,
                quant=quant,
                banded_blocks=banded_blocks,
                cap_budget=cap_budget,
                svd=svd,
                progress=progress,
            )
        out.append(replace(s, candidates=tuple(candidates), currency="bytes"))
    return out


def budget_spectra(
    sources: Sequence[_Source],
    *,
    quant: str | None,
    forms: Sequence[str],
    banded_blocks: Sequence[int] | None,
    shared_blocks: Sequence[int] | None,
    cap_budget: float,
    svd: SVDOptions,
    progress: Callable[[DecomposeProgress], None] | None = None,
) -> list[_Spectra]:
    """The spectra a budget allocates over: in stored numbers (``quant=None``, as always), or
    in bytes with the quantized banded candidates added. Refuses, before any spectrum is
    taken, a ``quant`` that is unknown or a family NVFP4 cannot hold (``in % 16``)."""
    for s in sources:
        check_quant(s.name, s.shape, quant)
    spectra = _spectra_all(
        sources,
        forms=forms,
        banded_blocks=banded_blocks,
        shared_blocks=shared_blocks,
        cap_budget=cap_budget,
        svd=svd,
        progress=progress,
    )
    if quant is None:
        return spectra
    return in_bytes(
        spectra,
        quant=quant,
        forms=forms,
        banded_blocks=banded_blocks,
        cap_budget=cap_budget,
        svd=svd,
        progress=progress,
    )
