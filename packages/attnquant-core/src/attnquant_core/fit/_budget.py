"""A global budget: choose every family's form and every layer's rank for the least total error.

The budget is stored parameters over dense parameters, summed over the projection families
(``s``, ``W0``, bases, ``U`` and ``V`` all count). The objective is the total squared Frobenius
error over every layer of every family. Because the error of a truncated SVD (or of projecting
onto a shared basis) is the energy its discarded singular values carry, every candidate form
has an exact error-against-rank curve before anything is fitted:

* ``lowrank``: the SVD of each ``W_l``; a rank unit of layer ``l`` costs ``out + in`` and
  removes ``sigma_j^2``.
* ``shared_basis`` side ``in`` with ``G`` bands: the SVD of the band's layers stacked
  vertically ``[W_1; ...; W_n]`` (its Gram ``sum W_l^T W_l``, ``[in, in]``); one basis column
  costs ``in + n * out``. Side ``out``: stacked horizontally (Gram ``sum W_l W_l^T``), a
  column costs ``out + n * in``. ``G = L`` is the low-rank form, so it is left out.
* ``banded`` with ``G`` bands: a fixed ``G * out * in + L * out`` (``W0`` and ``s``), then the
  SVD of each layer's residual ``W_l - diag(s_l) W0_b``, ``out + in`` per rank unit.

Allocation: for a fixed form per family, the best ranks are taken greedily, rank units in
order of error drop per parameter, skipping those that no longer fit (each group's drops are
non-increasing, so these are always prefixes of its spectrum). The forms come from a
Lagrangian: at a price ``lam`` per stored number each family takes the (form, ranks)
minimising ``error + lam * params``, and ``lam`` is bisected to meet the budget. Because the
forms make the problem non-convex, the forms are then improved by switching one family at a
time while the total error falls, starting both from the Lagrangian forms and from "low rank
everywhere", which is the baseline "per-layer SVD with globally allocated ranks" (the same
allocator restricted to ``lowrank``). The answer is thus never worse than that baseline.

Singular values are exact (LAPACK, in float64) when the matrix's smaller side, or the Gram's
side for a shared basis, is at most :data:`BUDGET_EXACT_MAX_DIM`; above that a randomized
truncated SVD (or a randomized subspace iteration on the Gram) is taken at a cap: the rank at
which the group would spend ``min(1, 2 * budget)`` of its own dense size, the most the budget
can sensibly buy there. Ranks above the cap are not considered. The fitted factors are cut
from the very factorisations the spectra came from, so the predicted error is the achieved one
up to the rounding of storage.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from .._errors import DecompositionError
from ..forms._bands import band_of_layers
from ..forms._measure import pooled_error
from ..forms._model import ThetaFamily, ThetaModel
from ..io._atomic import atomic_directory, copy_side_files
from ..io._calibration import CalibrationStats
from ..io._checkpoint import Checkpoint, open_checkpoint
from ..io._manifest import family_entry, theta_manifest, write_manifest
from ..io._safetensors import PlannedWriter, TensorSpec
from ..io._sensitivity import read_sensitivity, sensitivity_path
from ..io._theta_write import copied_specs, family_specs, plain_specs, write_copied
from ._align_transforms import aligned_record
from ._allocate import BudgetReport, FamilyChoice, allocate, check_budget
from ._budget_fit import family_from, fit_family
from ._decompose import DEFAULT_SVD, DecomposeProgress, SVDOptions, check_family_weights
from ._gptq import rounding_fields
from ._spec import DEFAULT_ALLOCATION, DEFAULT_ROUNDING, DecomposeSpec, spec_from
from ._spectra import DEFAULT_FORMS, _check_forms, _checkpoint_sources, _Source
from ._spectra_nvfp4 import budget_spectra
from ._whitened import Calibration, as_calibration

__all__ = ["decompose_budget", "fit_budget", "resolve_allocation"]


def fit_budget(
    families: Mapping[str, Sequence[np.ndarray]],
    budget: float,
    *,
    forms: Sequence[str] = DEFAULT_FORMS,
    banded_blocks: Sequence[int] | None = None,
    shared_blocks: Sequence[int] | None = None,
    dtype: np.dtype | type | None = None,
    svd: SVDOptions = DEFAULT_SVD,
    stack: str = "model.layers",
    quant: str | None = None,
) -> tuple[ThetaModel, BudgetReport]:
    """Choose forms and ranks at ``budget`` and fit them, in memory.

    Parameters
    ----------
    families : mapping of name to a sequence of ndarray (out, in)
        Every family's weights in layer order; every family has the same number of layers.
    budget : float in (0, 1]
        Stored parameters over dense parameters, over all the families.
    forms : sequence of str
        The forms a family may take (``lowrank``, ``shared_basis``, ``banded``).
    banded_blocks, shared_blocks : sequence of int, optional
        The ``G`` tried for banded and shared-basis families (defaults: ``1, 2, 4, L//2`` and
        ``1, 2, 3, 4, L//4, L//2``; shared bases at ``G = L`` are the low-rank form).
    dtype : dtype, optional
        Storage dtype; defaults to each family's weights' dtype.
    quant : "nvfp4", optional
        Let banded families store ``W0`` in NVFP4 (at ``G = L`` and the banded ``G``), and
        count ``budget`` in bytes for every form: stored bytes over the dense weights' bytes
        (:mod:`attnquant_core.fit._spectra_nvfp4`). Every ``in`` must be a multiple of 16.

    Returns
    -------
    model : ThetaModel
        The fitted families, each in its chosen form.
    report : BudgetReport
        What was chosen and why, predicted and measured errors, and the baseline.
    """
    budget = check_budget(budget)
    forms = _check_forms(forms)
    if not families:
        raise DecompositionError("fit_budget needs at least one family")
    sources: list[_Source] = []
    counts = set()
    for name, weights in families.items():
        weights = list(weights)
        shape = check_family_weights(name, weights)
        counts.add(len(weights))
        src_dtype = np.dtype(weights[0].dtype)
        sources.append(
            _Source(
                name,
                (int(shape[0]), int(shape[1])),
                len(weights),
                src_dtype,
                np.dtype(dtype) if dtype is not None else src_dtype,
                weights.__getitem__,
            )
        )
    if len(counts) != 1:
        raise DecompositionError(
            "every family needs the same number of layers; got "
            + ", ".join(f"{s.name}: {s.num_layers}" for s in sources)
        )
    spectra = budget_spectra(
        sources,
        quant=quant,
        forms=forms,
        banded_blocks=banded_blocks,
        shared_blocks=shared_blocks,
        cap_budget=budget,
        svd=svd,
    )
    report = allocate(spectra, budget, forms)
    fitted: dict[str, ThetaFamily] = {}
    choices: dict[str, FamilyChoice] = {}
    for s in spectra:
        choice = report.families[s.source.name]
        tensors: dict[str, np.ndarray] = {}
        errors, norms = fit_family(s.source, choice, stack=stack, svd=svd, emit=tensors.__setitem__)
        fitted[s.source.name] = family_from(stack, choice, tensors, s.source.num_layers)
        choices[s.source.name] = _with_measured(choice, errors, norms)
    model = ThetaModel(families=fitted, stack=stack)
    return model, _with_choices(report, choices)


def _with_measured(choice: FamilyChoice, errors: list[float], norms: list[float]) -> FamilyChoice:
    from dataclasses import replace

    return replace(choice, measured_error=pooled_error(errors, norms))


def _with_choices(report: BudgetReport, choices: dict[str, FamilyChoice], **kw) -> BudgetReport:
    from dataclasses import replace

    return replace(report, families=choices, **kw)


def decompose_budget(
    src: str | Path | Checkpoint,
    out: str | Path,
    *,
    budget: float | None = None,
    forms: Sequence[str] = DEFAULT_FORMS,
    banded_blocks: Sequence[int] | None = None,
    shared_blocks: Sequence[int] | None = None,
    dtype: np.dtype | type | None = None,
    svd: SVDOptions = DEFAULT_SVD,
    progress: Callable[[DecomposeProgress], None] | None = None,
    max_shard_bytes: int = 2 << 30,
    overwrite: bool = False,
    aligned_from: str | Path | None = None,
    calibration: str | Path | CalibrationStats | Calibration | None = None,
    quant: str | None = None,
    rounding: str = DEFAULT_ROUNDING,
    allocation: str | None = None,
    spec: DecomposeSpec | None = None,
) -> BudgetReport:
    """Decompose a checkpoint at a global ``budget`` into a theta checkpoint (format v2) at ``out``.

    Two streamed passes, one family at a time: the spectra of every candidate form (one layer,
    band mean or Gram held at a time), then, after the allocation, the chosen form's tensors,
    written in place. ``attnquant.json`` says per family the form, bands, ranks, measured and
    predicted errors, stored parameters and why, and the budget's totals with the per-layer
    SVD baseline. Returns the :class:`BudgetReport` (its ``manifest`` is ``attnquant.json``).
    Nothing is left at ``out`` if anything fails. ``aligned_from`` as for
    :func:`attnquant_core.decompose_checkpoint`.

    ``calibration`` (a statistics file, see :mod:`attnquant_core.calib`): every fit minimises
    the output error ``||(W - W_hat) X||`` over the calibration inputs instead of the weight
    error, and the allocation follows the whitened spectra; a projection without statistics
    is fit unwhitened. Shared bases are then tried on the output side only. The manifest
    records the statistics' digest and token count under ``"calibration"``.

    ``quant="nvfp4"``: a banded family may store each band's ``W0`` in NVFP4 (format version 4
    when one does), and ``budget`` is then stored bytes over the dense projections' bytes for
    every form (:mod:`attnquant_core.fit._spectra_nvfp4`); each family's entry records
    ``stored_bytes``, and ``quant`` where its ``W0`` is quantized. ``rounding``: as in
    :func:`attnquant_core.decompose_checkpoint` (GPTQ for a quantized ``W0`` whose band the
    statistics cover, both in its spectra and in its fit).

    ``allocation`` (with ``calibration``): ``"global"`` splits the budget by whitened error
    drop per parameter, each layer's whitened spectrum scaled to its weight's energy;
    ``"sensitivity"`` weighs each projection's squared output error by the KL it costs the
    model (:mod:`attnquant_core.calib._sensitivity`), read from beside the statistics file
    (``attnquant calibrate --sensitivity``), or given as a ``Calibration`` whose
    ``error_weights`` hold them. Unset, it is ``"sensitivity"`` where those were measured and
    ``"global"`` where not (:func:`resolve_allocation`). A calibrated manifest's ``"budget"``
    records the one used under ``"allocation"``.

    ``spec``: ``budget=``, ``forms=``, ``calibration=``, ``quant=``, ``rounding=`` and
    ``allocation=`` as one :class:`~attnquant_core.DecomposeSpec` (validated when made),
    instead of those keywords.
    """
    spec = spec_from(
        spec,
        budget=budget,
        forms=forms,
        calibration=calibration,
        quant=quant,
        rounding=rounding,
        allocation=allocation,
    )
    budget = check_budget(spec.budget)  # a spec without a budget: refused in one line
    forms, quant, rounding = tuple(spec.forms), spec.quant, spec.rounding
    cal = as_calibration(spec.calibration)
    allocation = resolve_allocation(spec.allocation, cal)
    cal = weighted_calibration(cal, allocation)
    if cal is None and allocation == "sensitivity":
        raise DecompositionError(
            "allocation='sensitivity' weighs each projection's output error by what it costs "
            "the model: pass calibration= (statistics with their sensitivities measured)"
        )
    ckpt = src if isinstance(src, Checkpoint) else open_checkpoint(src)
    aligned = None if aligned_from is None else aligned_record(ckpt)
    sources = _checkpoint_sources(ckpt, dtype, cal, rounding)
    spectra = budget_spectra(
        sources,
        quant=quant,
        forms=forms,
        banded_blocks=banded_blocks,
        shared_blocks=shared_blocks,
        cap_budget=budget,
        svd=svd,
        progress=progress,
    )
    report = allocate(spectra, budget, forms)
    copied = copied_specs(ckpt)
    specs: dict[str, TensorSpec] = dict(copied)
    for s in sources:
        c = report.families[s.name]
        specs.update(
            plain_specs(
                family_specs(
                    s.name,
                    ckpt.stack,
                    form=c.form,
                    shape=s.shape,
                    dtype=s.store,
                    ranks=c.ranks,
                    bands=None if c.blocks is None else band_of_layers(s.num_layers, c.blocks),
                    side=c.side,
                    layers=ckpt.families[s.name].layers,
                    family=ckpt.families[s.name].family,
                    quant=c.quant,
                )
            )
        )
    digests: dict[str, str] = {}
    families: dict[str, dict] = {}
    choices: dict[str, FamilyChoice] = {}
    with atomic_directory(Path(out), overwrite) as tmp:
        copy_side_files(ckpt.directory if ckpt.path.is_dir() else None, tmp)
        with PlannedWriter(tmp, specs, max_shard_bytes=max_shard_bytes) as writer:
            write_copied(writer, ckpt, copied, digests)
            for s in sources:
                info = ckpt.families[s.name]
                choice = report.families[s.name]
                layer_digests: dict[int, str] = {}
                errors, norms = fit_family(
                    s,
                    choice,
                    stack=ckpt.stack,
                    svd=svd,
                    emit=writer.write,
                    progress=progress,
                    digests=layer_digests,
                    layers=info.layers,
                    family=info.family,
                )
                keys = info.keys
                digests.update({keys[i]: d for i, d in layer_digests.items()})
                choice = _with_measured(choice, errors, norms)
                choices[s.name] = choice
                families[s.name] = family_entry(
                    form=choice.form,
                    shape=s.shape,
                    dtype=s.store,
                    source_dtype=s.dtype,
                    ranks=choice.ranks,
                    bands=None
                    if choice.blocks is None
                    else band_of_layers(s.num_layers, choice.blocks),
                    side=choice.side,
                    stored=choice.stored,
                    errors=errors,
                    norms=norms,
                    predicted_error=choice.error,
                    why=choice.why,
                    **(
                        {}
                        if choice.stored_bytes is None
                        else {"stored_bytes": choice.stored_bytes}
                        if choice.quant is None
                        else {
                            "quant": choice.quant,
                            "stored_bytes": choice.stored_bytes,
                            **_gptq_record(choice, info.keys, cal, rounding),
                        }
                    ),
                    **(
                        {}
                        if info.group is None
                        else {
                            "family": info.family,
                            "group": info.group,
                            "layers": list(info.layers),
                        }
                    ),
                )
        report = _with_choices(report, choices)
        summary = report.to_json()
        summary.pop("families")
        if cal is not None:  # how the whitened errors were weighed (none without statistics)
            summary["allocation"] = allocation
        manifest = theta_manifest(
            num_layers=ckpt.num_layers,
            stack=ckpt.stack,
            families=families,
            svd=svd.to_json(),
            source={"path": str(aligned_from or ckpt.path), "digests": digests},
            aligned=aligned,
            budget=summary,
            **({} if cal is None else {"calibration": cal.record(sorted(ckpt.projection_keys()))}),
        )
        write_manifest(tmp, manifest)
    return _with_choices(report, choices, manifest=manifest)


def resolve_allocation(allocation: str | None, cal: Calibration | None) -> str:
    """The allocation a budget fit uses: ``allocation`` where given; unset, ``"sensitivity"``
    where sensitivities were measured for ``cal`` (its ``error_weights``, or the file
    ``attnquant calibrate --sensitivity`` writes beside its statistics), else
    :data:`DEFAULT_ALLOCATION`. On SmolLM2-135M the measured sensitivities cut KL by 40-53% at
    float budgets 0.8 and 0.5 (docs/real-models.md), so they are used wherever they exist."""
    if allocation is not None:
        return allocation
    if cal is not None and (
        cal.error_weights is not None or sensitivity_path(cal.stats.path).is_file()
    ):
        return "sensitivity"
    return DEFAULT_ALLOCATION


def weighted_calibration(cal: Calibration | None, allocation: str) -> Calibration | None:
    """``cal`` as ``allocation`` weighs it: without ``error_weights`` for ``"global"``; with the
    sensitivities for ``"sensitivity"`` (``cal``'s own, else those beside its statistics file,
    recorded in its ``data``)."""
    if cal is None:
        return None
    if allocation != "sensitivity":
        return cal if cal.error_weights is None else dataclasses.replace(cal, error_weights=None)
    if cal.error_weights is not None:
        return cal
    path = sensitivity_path(cal.stats.path)
    sens = read_sensitivity(path, stats_digest=cal.stats.digest)
    data = {**(cal.data or {}), "sensitivity": sens.record(path)}
    return dataclasses.replace(cal, data=data, error_weights=sens.weights)


def _gptq_record(
    choice: FamilyChoice, keys: Sequence[str], cal: Calibration | None, rounding: str
) -> dict[str, str]:
    """A quantized choice's ``"rounding"`` (:func:`~attnquant_core.fit._gptq.rounding_fields`):
    GPTQ rounded the bands whose every layer the statistics cover."""
    if cal is None or rounding != "gptq" or choice.blocks is None:
        return {}
    bands = band_of_layers(len(keys), choice.blocks)
    covered = sum(
        all(keys[i] in cal.stats for i in range(len(keys)) if bands[i] == b)
        for b in range(choice.blocks)
    )
    return rounding_fields(covered, choice.blocks)
