"""``decompose --calibration-data``: calibrate in the same pass, and fit sequentially.

:func:`decompose_calibrated` takes token windows and a dense checkpoint the numpy forward runs.

* ``sequential=False``: one calibration pass (:func:`attnquant_core.calib.calibrate`, to a
  temporary statistics file) and the whitened fit of ``decompose --calibration``.
* ``sequential=True`` (SVD-LLM V2 / Basis Sharing's sequential correction): layer ``l`` is fit
  against the inputs the *compressed* model feeds it. Two hidden-state streams advance through
  the decoder together, the dense one and the compressed one. Within a layer the projections
  are fit in the order they are applied (q/k/v, o, gate/up, down), each stage's inputs taken
  from the compressed stream through the already-compressed layers and the already-compressed
  projections of this layer; each projection then minimises ``||W X - W_hat X_hat||^2 + delta
  ||W - W_hat||^2`` (:mod:`attnquant_core.fit._sequential`: the whitened fit, under the
  compressed inputs' gram, of the corrected target ``W (C^T + dI) (G_hat + dI)^-1``).

Forms and ranks (``budget``) need every layer's spectrum before anything is fit, so they are
allocated on the *dense-input* whitened spectra of one calibration pass (as ``decompose
--calibration`` does), and the sequential pass then fits with those ranks. The factors shared
across layers are not refit sequentially: a banded family's ``W0`` is the band mean of the dense
weights, a shared basis is the one the band's dense-input statistics give (it depends on
layers whose compressed inputs do not exist yet when the band starts); each layer's own factors
(``s``, ``U``, ``V``, a shared basis's coefficients) are then fit by least squares against
the compressed inputs.

Memory: one layer's dense weights and its compressed rebuild, the two hidden-state streams
``[n, T, hidden]``, and one stage's grams (``G_hat`` and ``C``, ``[in, in]`` float64).
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from .. import llama_reference as ref
from .._errors import DecompositionError
from ..fit._allocate import allocate
from ..fit._budget import _with_choices, _with_measured
from ..fit._decompose import DEFAULT_SVD, SVDOptions, check_rank
from ..fit._sequential import left_factor, refit_coefficients, sequential_error, sequential_target
from ..fit._spec import DecomposeSpec, spec_from
from ..fit._spectra import (
    _LOWRANK_SEED,
    _SIDE_SEED,
    _band_basis,
    _band_mean,
    _checkpoint_sources,
    _spectra_all,
)
from ..fit._theta_checkpoint import decompose_checkpoint
from ..fit._whiten import DEFAULT_DAMPING
from ..fit._whitened import Calibration, fit_layer_whitened
from ..forms._bands import band_of_layers, resolve_blocks
from ..io._atomic import atomic_directory, copy_side_files
from ..io._calibration import CalibrationError, read_stats
from ..io._checkpoint import open_checkpoint
from ..io._manifest import (
    basis_key,
    family_entry,
    shared_key,
    stored_of,
    theta_key,
    theta_manifest,
    write_manifest,
)
from ..io._safetensors import PlannedWriter
from ..io._theta_write import copied_specs, family_specs, plain_specs, source_digest, write_copied
from ._data import windows_digest
from ._forward import LAYER_PROJECTIONS, ModelSource, _batches, _embedded, _layer_weights
from ._forward import calibrate as run_calibration
from ._sensitivity import with_sensitivity

__all__ = ["SEQUENTIAL_STAGES", "decompose_calibrated", "windows_digest"]

#: The projections of a layer in the order the forward applies them; those of one stage share
#: one input (as the forward's ``capture`` names them).
SEQUENTIAL_STAGES: tuple[tuple[str, ...], ...] = (
    ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    ("self_attn.o_proj",),
    ("mlp.gate_proj", "mlp.up_proj"),
    ("mlp.down_proj",),
)
assert sorted(n for s in SEQUENTIAL_STAGES for n in s) == sorted(LAYER_PROJECTIONS)

OBJECTIVE = (
    "sequential: each projection minimises ||W X - W_hat X_hat||^2 + delta ||W - W_hat||^2, X "
    "its inputs in the dense model, X_hat in the model whose earlier layers and earlier "
    "projections are compressed (the whitened fit under X_hat's gram of W (C^T + dI) "
    "(G_hat + dI)^-1, C = X_hat X^T); shared W0 and bases from the dense inputs; 'errors' "
    "stay the weight error, 'output_errors' are ||W X - W_hat X_hat|| / ||W X||"
)
ALLOCATION = "forms and ranks from the dense-input whitened spectra (one calibration pass)"


class _StopLayerError(Exception):
    """Raised by a capture to end a layer's forward once the wanted input has been seen."""


class _Plan:
    """One family's form for the sequential pass, and the shared factor of its open band."""

    def __init__(self, *, form: str, blocks: int | None, side: str | None, ranks, choice=None):
        self.form, self.blocks, self.side = form, blocks, side
        self.ranks = tuple(int(r) for r in ranks)
        self.choice = choice  # the budget's FamilyChoice, when there is one
        self.band: int | None = None
        self.shared: np.ndarray | None = None  # W0 of a banded band, or a band's basis
        self.errors: list[float] = [0.0] * len(self.ranks)
        self.norms: list[float] = [0.0] * len(self.ranks)
        self.output_errors: list[float] = [0.0] * len(self.ranks)

    @property
    def bands(self) -> list[int] | None:
        return None if self.blocks is None else band_of_layers(len(self.ranks), self.blocks)


def _fit_one(
    plan: _Plan,
    name: str,
    layer: int,
    W: np.ndarray,
    target: np.ndarray,
    white,
    *,
    stack: str,
    store: np.dtype,
    read: Callable[[int], np.ndarray],
    whitened_read: Callable[[int], np.ndarray] | None,
    svd: SVDOptions,
    emit: Callable[[str, np.ndarray], None],
) -> np.ndarray:
    """Fit one projection of ``layer`` against ``target``; emit its tensors, return ``W_eff``."""
    shape = W.shape
    r = plan.ranks[layer]
    if plan.form == "lowrank":
        if r:
            fit, _ = fit_layer_whitened(
                target, None, r, white, dtype=store, svd=svd, seed=(_LOWRANK_SEED, layer)
            )
            V = fit.theta.V
            U = left_factor(target, V.astype(np.float64), white).astype(store)
        else:
            U, V = np.zeros((shape[0], 0), store), np.zeros((shape[1], 0), store)
        emit(theta_key(stack, layer, name, "U"), U)
        emit(theta_key(stack, layer, name, "V"), V)
        return U.astype(np.float64) @ V.astype(np.float64).T
    bands = plan.bands
    assert bands is not None and plan.blocks is not None
    b = bands[layer]
    members = [i for i in range(len(bands)) if bands[i] == b]
    if plan.form == "banded":
        if plan.band != b:
            plan.band, plan.shared = b, _band_mean(read, members, shape, W.dtype, store)
            emit(shared_key(name, b), plan.shared)
        W0 = plan.shared
        assert W0 is not None
        fit, _ = fit_layer_whitened(
            target, W0, r, white, dtype=store, svd=svd, seed=(plan.blocks, b, layer)
        )
        for part in ("s", "U", "V"):
            emit(theta_key(stack, layer, name, part), getattr(fit.theta, part))
        th = fit.theta
        return (
            th.s.astype(np.float64)[:, None] * W0.astype(np.float64)
            + th.U.astype(np.float64) @ th.V.astype(np.float64).T
        )
    side = plan.side
    assert side in ("in", "out") and plan.choice is not None
    c = plan.choice.candidate
    group = next(g for g, layers in enumerate(c.groups) if layer in layers)
    if plan.band != group:
        k = plan.choice.group_ranks[group]
        d = shape[1] if side == "in" else shape[0]
        basis = np.zeros((d, 0))
        if k:  # the band's basis from its dense-input statistics, as the whitened fit takes it
            basis = _band_basis(
                whitened_read or read,
                list(c.groups[group]),
                side,
                shape,
                c.caps[group],
                svd,
                (_SIDE_SEED[side], plan.blocks, group),
                vectors=True,
            )[1]
        plan.band = group
        plan.shared = np.ascontiguousarray(basis[:, :k]).astype(store)
        emit(basis_key(name, group), plan.shared)
    B = plan.shared
    assert B is not None
    coef = refit_coefficients(target, B.astype(np.float64), white, side).astype(store)
    Bd, cd = B.astype(np.float64), coef.astype(np.float64)
    if side == "in":
        emit(theta_key(stack, layer, name, "U"), coef)
        return cd @ Bd.T
    emit(theta_key(stack, layer, name, "V"), coef)
    return Bd @ cd.T


def _stage_input(
    source: ModelSource,
    weights: Mapping[str, np.ndarray],
    h: np.ndarray,
    layer: int,
    tables,
    names: tuple[str, ...],
    *,
    finish: bool,
) -> tuple[np.ndarray, np.ndarray | None]:
    """The input ``[tokens, in]`` (float64) of stage ``names`` when ``h`` passes layer ``layer``
    with ``weights``; and the layer's output when ``finish`` (else the forward stops there)."""
    got: dict[str, np.ndarray] = {}

    def capture(seen: tuple[str, ...], x: np.ndarray) -> None:
        if seen == names:
            got["x"] = x.reshape(-1, x.shape[-1]).astype(np.float64)
            if not finish:
                raise _StopLayerError

    def get(key: str) -> np.ndarray:
        if key not in weights:
            raise ref.ReferenceConfigError(f"{source.path}: no {key!r}")
        return weights[key]

    stem = f"{source.prefix}.layers.{layer}"
    try:
        out = source.decoder.layer(get, weights.__contains__, stem, h, layer, tables, capture)
    except _StopLayerError:
        out = None
    if "x" not in got:
        raise CalibrationError(f"{source.path}: layer {layer} never applied {', '.join(names)}")
    return got["x"], out


def decompose_calibrated(
    source: ModelSource,
    windows: np.ndarray,
    out: str | Path,
    *,
    sequential: bool | None = None,
    budget: float | None = None,
    blocks: int | str | None = None,
    rank: int | None = None,
    dtype: np.dtype | type | None = None,
    svd: SVDOptions = DEFAULT_SVD,
    damping: float = DEFAULT_DAMPING,
    batch: int = 8,
    data: Sequence[str] = (),
    progress: Callable[[str, int, int], None] | None = None,
    overwrite: bool = False,
    allocation: str | None = None,
    spec: DecomposeSpec | None = None,
) -> dict:
    """Calibrate ``source`` (a dense checkpoint the numpy forward runs) on ``windows`` ``[n, T]``
    and decompose it to ``out``, sequentially or not (see the module docstring).

    ``budget`` or ``blocks``/``rank`` as for :func:`attnquant_core.decompose_checkpoint`
    (``allocation="sensitivity"``: measured on ``windows``), ``sequential=None`` sequential;
    or all of them as one ``spec`` (its ``quant`` and ``calibration`` refused). ``data`` names
    the text the windows came from (recorded). ``progress(stage, done, total)`` is called per
    layer of each pass (``"calibrating"``, ``"sequential fit"``; ``"measuring sensitivity"``
    per projection). Returns the manifest; its ``"calibration"`` says whether the fit was
    sequential, the windows' digest and token count. Nothing is left at ``out`` if anything
    fails.
    """
    if spec is not None and sequential is not None:
        raise DecompositionError("pass spec= or sequential=, not both")
    spec = spec_from(spec, budget=budget, blocks=blocks, rank=rank, allocation=allocation)
    if spec.quant is not None or spec.calibration is not None:
        raise CalibrationError("decompose_calibrated: quant= and calibration= are not supported")
    budget = spec.budget
    sequential = spec.effective_sequential if sequential is None else sequential
    if source.theta:
        raise CalibrationError(f"{source.path}: a theta checkpoint; decompose a dense one")
    windows = np.asarray(windows, dtype=np.int64)
    record: dict[str, object] = {
        "sequential": bool(sequential),
        "data": [str(d) for d in data],
        "data_digest": windows_digest(windows),
        "tokens": int(windows.size),
        "sequences": int(windows.shape[0]),
        "seq_len": int(windows.shape[1]),
        "damping": damping,
    }
    ckpt = open_checkpoint(source.path)
    with tempfile.TemporaryDirectory(prefix="attnquant-calib-") as tmp:
        cal = None
        if budget is not None or not sequential:
            stats_path = Path(tmp) / "stats.safetensors"
            run_calibration(
                source,
                windows,
                stats_path,
                batch=batch,
                progress=None if progress is None else lambda d, t: progress("calibrating", d, t),
            )
            cal = Calibration(stats=read_stats(stats_path), damping=damping)
            if budget is not None and spec.effective_allocation == "sensitivity":
                cal = with_sensitivity(source, windows, cal, batch, progress, record)
        if not sequential:
            assert cal is not None
            rec = dict(record, path="calibration data, in the same pass")
            fit = DecomposeSpec(  # the fit's options, on the statistics made in this pass
                blocks=spec.blocks, rank=spec.rank, budget=budget, forms=spec.forms,
                calibration=dataclasses.replace(cal, data=rec), allocation=spec.allocation,
            )  # fmt: skip
            return decompose_checkpoint(
                ckpt, out, spec=fit, dtype=dtype, svd=svd, overwrite=overwrite
            )
        return _sequential(
            source, ckpt, windows, out, cal=cal, spec=spec, dtype=dtype, svd=svd,
            damping=damping, batch=batch, record=record, progress=progress, overwrite=overwrite,
        )  # fmt: skip


def _sequential(
    source: ModelSource,
    ckpt,
    windows: np.ndarray,
    out: str | Path,
    *,
    cal: Calibration | None,
    spec: DecomposeSpec,
    dtype,
    svd: SVDOptions,
    damping: float,
    batch: int,
    record: dict,
    progress: Callable[[str, int, int], None] | None,
    overwrite: bool,
) -> dict:
    L = ckpt.num_layers
    extra = sorted(set(ckpt.families) - set(LAYER_PROJECTIONS))
    if extra or source.num_layers != L:
        raise CalibrationError(
            f"{source.path}: families {extra} / {L} layers are not what the numpy forward "
            f"applies; fit with --calibration instead"
        )
    store = {n: np.dtype(dtype) if dtype is not None else i.dtype for n, i in ckpt.families.items()}
    plans: dict[str, _Plan] = {}
    whitened_reads: dict[str, Callable[[int], np.ndarray]] = {}
    report = None
    budget = spec.budget
    if budget is not None:
        assert cal is not None
        sources = _checkpoint_sources(ckpt, dtype, cal)
        spectra = _spectra_all(
            sources, forms=spec.forms, banded_blocks=None, shared_blocks=None,
            cap_budget=budget, svd=svd,
        )  # fmt: skip
        report = allocate(spectra, budget, spec.forms)
        for s in sources:
            ch = report.families[s.name]
            plans[s.name] = _Plan(
                form=ch.form, blocks=ch.blocks, side=ch.side, ranks=ch.ranks, choice=ch
            )
            whitened_reads[s.name] = s.whitened_get
        record["allocation"] = f"{ALLOCATION}, {spec.effective_allocation}"
        record["stats_digest"] = cal.stats.digest
    else:
        G = resolve_blocks(spec.effective_blocks, L)
        r = spec.effective_rank
        for name, info in ckpt.families.items():
            check_rank(name, info.shape, r)
            plans[name] = _Plan(form="banded", blocks=G, side=None, ranks=[r] * L)
    specs = dict(copied_specs(ckpt))
    for name, info in ckpt.families.items():
        p = plans[name]
        specs.update(plain_specs(family_specs(
            name, ckpt.stack, form=p.form, shape=info.shape, dtype=store[name],
            ranks=p.ranks, bands=p.bands, side=p.side,
        )))  # fmt: skip
    dt = np.dtype(np.float32)
    digests: dict[str, str] = {}
    with atomic_directory(Path(out), overwrite) as tmp:
        copy_side_files(ckpt.directory if ckpt.path.is_dir() else None, tmp)
        with PlannedWriter(tmp, specs) as writer:
            write_copied(writer, ckpt, copied_specs(ckpt), digests)
            h = _embedded(source, windows, dt)
            hc = h.copy()
            tables = source.decoder.tables(windows.shape[1], dt)
            for layer in range(L):
                dense_w = _layer_weights(source, layer, dt)
                comp_w = dict(dense_w)
                for names in SEQUENTIAL_STAGES:
                    last = names is SEQUENTIAL_STAGES[-1]
                    G_hat: np.ndarray | None = None
                    C: np.ndarray | None = None
                    wx2 = dict.fromkeys(names, 0.0)
                    for rows in _batches(len(h), batch):
                        X, dense_out = _stage_input(
                            source, dense_w, h[rows], layer, tables, names, finish=last
                        )
                        Xh, _ = _stage_input(
                            source, comp_w, hc[rows], layer, tables, names, finish=False
                        )
                        if last:
                            h[rows] = dense_out
                        g, c = Xh.T @ Xh, Xh.T @ X
                        G_hat = g if G_hat is None else G_hat + g
                        C = c if C is None else C + c
                        for name in names:
                            key = f"{source.prefix}.layers.{layer}.{name}.weight"
                            wx2[name] += float(np.sum((X @ dense_w[key].T.astype(np.float64)) ** 2))
                        del X, Xh
                    assert G_hat is not None and C is not None
                    for name in names:
                        info = ckpt.families[name]
                        key = info.keys[layer]
                        W = ckpt.get(key, check_finite=True)
                        digests[key] = source_digest(W)
                        Wd = np.asarray(W, np.float64)
                        target, white = sequential_target(
                            Wd, G_hat, C, damping=damping, where=f"layer {layer} {name}"
                        )
                        plan = plans[name]
                        W_eff = _fit_one(
                            plan, name, layer, W, target, white, stack=ckpt.stack,
                            store=store[name],
                            read=lambda i, keys=info.keys: ckpt.get(keys[i], check_finite=True),
                            whitened_read=whitened_reads.get(name),
                            svd=svd, emit=writer.write,
                        )  # fmt: skip
                        norm = float(np.linalg.norm(Wd))
                        plan.norms[layer] = norm
                        plan.errors[layer] = (
                            float(np.linalg.norm(Wd - W_eff)) / norm if norm > 0 else 0.0
                        )
                        err = sequential_error(Wd, W_eff, G_hat, C, wx2[name])
                        plan.output_errors[layer] = (
                            err / np.sqrt(wx2[name]) if wx2[name] > 0 else 0.0
                        )
                        comp_w[key] = W_eff.astype(dt)
                    del G_hat, C
                for rows in _batches(len(hc), batch):
                    hc[rows] = _forward_all(source, comp_w, hc[rows], layer, tables)
                del dense_w, comp_w
                if progress is not None:
                    progress("sequential fit", layer + 1, L)
        families: dict[str, dict] = {}
        choices = {}
        for name, info in ckpt.families.items():
            p = plans[name]
            extra_fields: dict[str, object] = {"output_errors": p.output_errors}
            if p.choice is not None:
                choice = _with_measured(p.choice, p.errors, p.norms)
                choices[name] = choice
                stored = choice.stored
                extra_fields.update(predicted_error=choice.error, why=choice.why)
            else:
                stored = stored_of(p.form, info.shape, p.ranks, p.bands)
            families[name] = family_entry(
                form=p.form, shape=info.shape, dtype=store[name], source_dtype=info.dtype,
                ranks=p.ranks, bands=p.bands, side=p.side, stored=stored, errors=p.errors,
                norms=p.norms, **extra_fields,
            )  # fmt: skip
        keys = sorted(ckpt.projection_keys())
        record.update(
            objective=OBJECTIVE,
            path="calibration data, in the same pass",
            digest=record["data_digest"],
            whitened=len(keys),
            unwhitened=0,
        )
        summary = None
        if report is not None:
            summary = _with_choices(report, choices).to_json()
            summary.pop("families")
            summary["allocation"] = spec.effective_allocation
        manifest = theta_manifest(
            num_layers=L,
            stack=ckpt.stack,
            families=families,
            svd=svd.to_json(),
            source={"path": str(ckpt.path), "digests": digests},
            **({} if summary is None else {"budget": summary}),
            calibration=record,
        )
        write_manifest(tmp, manifest)
    return manifest


def _forward_all(
    source: ModelSource, weights: Mapping[str, np.ndarray], h: np.ndarray, layer: int, tables
) -> np.ndarray:
    """One whole layer with ``weights`` (the compressed stream's step to the next layer)."""

    def get(key: str) -> np.ndarray:
        return weights[key]

    stem = f"{source.prefix}.layers.{layer}"
    return source.decoder.layer(get, weights.__contains__, stem, h, layer, tables, None)
