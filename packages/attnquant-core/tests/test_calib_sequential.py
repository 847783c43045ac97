"""Sequential correction: closed-form least squares against exact numpy solves, and the
sequential fit of a tiny model against the non-sequential whitened one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from attnquant_core import ThetaCheckpoint
from attnquant_core.calib import (
    decompose_calibrated,
    left_factor,
    open_source,
    refit_coefficients,
    sequential_error,
    sequential_target,
    whitened_svd,
    whitening,
    windows_digest,
)
from attnquant_core.calib._forward import _forward_layers
from attnquant_core.fit._whitened import fit_layer_whitened
from attnquant_core.testing import llama_config, make_weights

LAYERS = 3
CONFIG = llama_config(LAYERS)


def _inputs(rng: np.random.Generator, n_in: int, N: int) -> tuple[np.ndarray, np.ndarray]:
    """Skewed dense inputs ``X`` and compressed inputs ``X_hat`` close to them."""
    X = rng.standard_normal((n_in, N)) * np.geomspace(10, 0.1, n_in)[:, None]
    return X, X + 0.3 * rng.standard_normal((n_in, N))


def _J(W, W_hat, X, X_hat) -> float:
    return float(np.linalg.norm(W @ X - W_hat @ X_hat))


@settings(max_examples=15, deadline=None)
@given(
    out=st.integers(2, 12),
    n_in=st.integers(2, 10),
    seed=st.integers(0, 2**16),
)
def test_target_is_the_exact_least_squares_map(out: int, n_in: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    X, X_hat = _inputs(rng, n_in, 4 * n_in + 8)
    W = rng.standard_normal((out, n_in))
    target, white = sequential_target(W, X_hat @ X_hat.T, X_hat @ X.T, damping=0.0)
    exact = np.linalg.lstsq(X_hat.T, (W @ X).T, rcond=None)[0].T  # argmin ||W X - M X_hat||
    np.testing.assert_allclose(target, exact, rtol=1e-7, atol=1e-8)
    assert white.delta == 0.0
    # The error from grams is the error of the outputs.
    W_hat = rng.standard_normal((out, n_in))
    got = sequential_error(W, W_hat, X_hat @ X_hat.T, X_hat @ X.T, float(np.sum((W @ X) ** 2)))
    assert got == pytest.approx(_J(W, W_hat, X, X_hat), rel=1e-8)


@settings(max_examples=15, deadline=None)
@given(out=st.integers(3, 12), n_in=st.integers(3, 10), seed=st.integers(0, 2**16))
def test_lowrank_u_is_the_least_squares_u_and_beats_the_whitened_fits(
    out: int, n_in: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    X, X_hat = _inputs(rng, n_in, 5 * n_in + 8)
    W = rng.standard_normal((out, n_in))
    r = max(1, min(out, n_in) // 2)
    target, white = sequential_target(W, X_hat @ X_hat.T, X_hat @ X.T, damping=0.0)
    fit, _ = fit_layer_whitened(target, None, r, white, dtype=np.dtype(np.float64))
    V = fit.theta.V
    U = left_factor(target, V, white)
    # U = argmin ||W X - U V^T X_hat||, the exact numpy solve for this V:
    U_exact = np.linalg.lstsq((V.T @ X_hat).T, (W @ X).T, rcond=None)[0].T
    np.testing.assert_allclose(U, U_exact, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(U, fit.theta.U, rtol=1e-6, atol=1e-8)  # the SVD's U already is
    seq = _J(W, U @ V.T, X, X_hat)
    for G in (X @ X.T, X_hat @ X_hat.T):  # whitened by the dense or the compressed inputs
        Uw, Vw, _ = whitened_svd(W, whitening(G, damping=0.0), r)
        assert seq <= _J(W, Uw @ Vw.T, X, X_hat) * (1 + 1e-9)


@settings(max_examples=15, deadline=None)
@given(side=st.sampled_from(["in", "out"]), seed=st.integers(0, 2**16))
def test_shared_basis_coefficients_are_least_squares(side: str, seed: int) -> None:
    rng = np.random.default_rng(seed)
    out, n_in, k = 7, 6, 3
    X, X_hat = _inputs(rng, n_in, 40)
    W = rng.standard_normal((out, n_in))
    target, white = sequential_target(W, X_hat @ X_hat.T, X_hat @ X.T, damping=0.0)
    B = np.linalg.qr(rng.standard_normal((n_in if side == "in" else out, k)))[0]
    coef = refit_coefficients(target, B, white, side)  # type: ignore[arg-type]
    if side == "in":  # W ~ U B^T: U = argmin ||W X - U B^T X_hat||
        exact = np.linalg.lstsq((B.T @ X_hat).T, (W @ X).T, rcond=None)[0].T
        np.testing.assert_allclose(coef, exact, rtol=1e-6, atol=1e-8)
    else:  # W ~ B C: C = argmin ||W X - B C X_hat||, vec(B C X_hat) = (X_hat^T kron B) vec(C)
        A = np.kron(X_hat.T, B)
        c = np.linalg.lstsq(A, (W @ X).reshape(-1, order="F"), rcond=None)[0]
        np.testing.assert_allclose(coef.T, c.reshape(k, n_in, order="F"), rtol=1e-6, atol=1e-8)


def test_no_compression_upstream_is_the_whitened_fit() -> None:
    rng = np.random.default_rng(3)
    X, _ = _inputs(rng, 8, 50)
    W = rng.standard_normal((5, 8))
    target, white = sequential_target(W, X @ X.T, X @ X.T)
    np.testing.assert_allclose(target, W, rtol=1e-9, atol=1e-10)
    np.testing.assert_allclose(white.gram(), whitening(X @ X.T).gram())


def tiny_llama(directory: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    state = {
        k: (v / math.sqrt(v.shape[-1]) if v.ndim == 2 else v)
        for k, v in make_weights(LAYERS, seed=1).items()
    }
    for layer in range(LAYERS):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            state[f"model.layers.{layer}.{norm}.weight"] = np.ones(24, np.float32)
    state["model.embed_tokens.weight"] = rng.standard_normal((16, 24)).astype(np.float32)
    state["lm_head.weight"] = (rng.standard_normal((16, 24)) / 3).astype(np.float32)
    directory.mkdir(parents=True, exist_ok=True)
    safetensors.numpy.save_file(state, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(CONFIG))
    return directory, state


def _last_layer_inputs(path: Path, windows: np.ndarray) -> dict[str, np.ndarray]:
    """Each projection's input at the last layer, ``[tokens, in]``, in the model at ``path``
    (a theta checkpoint is rebuilt; every earlier projection of the layer is its own)."""
    got: dict[str, np.ndarray] = {}
    layer = {"n": 0}

    def capture(names, x) -> None:
        if names[0] == "self_attn.q_proj":
            layer["n"] += 1
        if layer["n"] == LAYERS:
            for name in names:
                got[name] = x.reshape(-1, x.shape[-1]).astype(np.float64)

    _forward_layers(open_source(path), windows, dtype=np.float32, batch=64, capture=capture)
    return got


@pytest.fixture(scope="module")
def fitted(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("sequential")
    directory, state = tiny_llama(tmp / "tiny")
    windows = np.random.default_rng(0).integers(0, 16, size=(12, 16))
    source = open_source(directory)
    out = {"dir": directory, "state": state, "windows": windows}
    for seq in (True, False):
        path = tmp / f"theta-{seq}"
        out[seq] = (path, decompose_calibrated(source, windows, path, sequential=seq, rank=2))
    return out


def test_sequential_lowers_the_error_against_the_dense_outputs(fitted) -> None:
    windows, state = fitted["windows"], fitted["state"]
    dense = _last_layer_inputs(fitted["dir"], windows)
    errors = {}
    for seq in (True, False):
        path, manifest = fitted[seq]
        theta = ThetaCheckpoint.open(path)
        comp = _last_layer_inputs(path, windows)
        total = 0.0
        for name, X in dense.items():
            W = state[f"model.layers.{LAYERS - 1}.{name}.weight"].astype(np.float64)
            W_hat = theta.rebuild(name, LAYERS - 1).astype(np.float64)
            err = float(np.linalg.norm(X @ W.T - comp[name] @ W_hat.T))
            total += err**2
            if seq:  # the manifest's output error is this measurement
                rel = err / float(np.linalg.norm(X @ W.T))
                recorded = manifest["families"][name]["output_errors"][LAYERS - 1]
                assert recorded == pytest.approx(rel, rel=2e-3, abs=1e-5)
        errors[seq] = total
    assert errors[True] < errors[False]


def test_manifest_records_the_sequential_fit(fitted) -> None:
    windows = fitted["windows"]
    seq, plain = fitted[True][1]["calibration"], fitted[False][1]["calibration"]
    for record in (seq, plain):
        assert record["data_digest"] == windows_digest(windows)
        assert record["tokens"] == windows.size == 12 * 16
    assert seq["sequential"] is True and plain["sequential"] is False
    assert "X_hat" in seq["objective"] and seq["whitened"] == 7 * LAYERS
    assert plain["digest"].startswith("sha256:")  # the same-pass statistics' digest
    assert fitted[True][1]["families"]["mlp.down_proj"]["form"] == "banded"
    assert windows_digest(windows) != windows_digest(windows[:, ::-1])


def test_budget_sequential_keeps_the_dense_allocation(tmp_path: Path, fitted) -> None:
    source = open_source(fitted["dir"])
    windows = fitted["windows"]
    seq = decompose_calibrated(source, windows, tmp_path / "s", budget=0.5)
    plain = decompose_calibrated(source, windows, tmp_path / "p", budget=0.5, sequential=False)
    assert seq["calibration"]["allocation"].startswith("forms and ranks from the dense-input")
    for name, fam in seq["families"].items():
        assert fam["form"] == plain["families"][name]["form"]
        assert fam["ranks"] == plain["families"][name]["ranks"]
    assert seq["budget"]["stored_over_dense"] == plain["budget"]["stored_over_dense"] <= 0.5
    theta = ThetaCheckpoint.open(tmp_path / "s")
    assert np.isfinite(theta.rebuild("mlp.down_proj", LAYERS - 1)).all()


@pytest.mark.parametrize("conditional", [False, True])
def test_gemma3_fits_sequentially(tmp_path: Path, conditional: bool) -> None:
    """Gemma 3 (bf16, sliding and global layers; the multimodal wrapper's text decoder too)."""
    from attnquant_core.tiny_gemma import write_tiny_gemma3, write_tiny_gemma3_conditional

    writer = write_tiny_gemma3_conditional if conditional else write_tiny_gemma3
    path = writer(tmp_path / "gemma")
    source = open_source(path)
    vocab = source.get(f"{source.prefix}.embed_tokens.weight").shape[0]
    windows = np.random.default_rng(0).integers(0, vocab, size=(4, 12))
    manifest = decompose_calibrated(source, windows, tmp_path / "theta", rank=2)
    assert manifest["calibration"]["sequential"] is True
    theta = ThetaCheckpoint.open(tmp_path / "theta")
    for name, family in manifest["families"].items():
        assert all(np.isfinite(e) for e in family["output_errors"]), name
        W = theta.rebuild(name, source.num_layers - 1)
        assert np.isfinite(np.asarray(W, np.float32)).all()
