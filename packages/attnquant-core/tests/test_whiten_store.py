"""Each gram is read, checked and factored once, in bounded memory, with unchanged results.

* ``whitening`` adds the damping on the diagonal in place: bit for bit the factor of
  ``G + delta * np.eye(n)`` (Cholesky and eigen fallback, ``-0.0`` entries, float32 input),
  with no identity-sized temporaries;
* ``CalibrationStats`` reads a gram in row blocks (no float32 copy of it) and checks it in
  row blocks (no ``G - G^T`` of its size), with the same one-line errors;
* :class:`WhiteningStore`: one factorisation per distinct gram (q/k/v share one), factors
  beyond its memory bound spilled to disk and read back bit for bit; a budget and a
  ``blocks``/``rank`` decomposition factor each distinct gram once.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from attnquant_core import decompose_budget, decompose_checkpoint
from attnquant_core.calib import CalibrationError, read_stats, whitening
from attnquant_core.fit._whitened import Calibration, WhiteningStore, as_calibration
from attnquant_core.io import _calibration
from attnquant_core.io._calibration import check_gram, write_stats


def _reference(G: np.ndarray, damping: float = 1e-2):
    """The factor as ``whitening`` made it before: ``cholesky(G + delta * np.eye(n))``, else
    the eigendecomposition of ``(G + G^T) / 2``."""
    G = np.asarray(G, dtype=np.float64)
    mean_diag = float(np.mean(np.diagonal(G))) if G.size else 0.0
    delta = damping * mean_diag if mean_diag > 0 else max(damping, 1e-12)
    try:
        return np.linalg.cholesky(G + delta * np.eye(G.shape[0])), delta, None
    except np.linalg.LinAlgError:
        w, Q = np.linalg.eigh(0.5 * (G + G.T))
        eigen = np.sqrt(np.maximum(w, 0.0) + delta)
        return Q * eigen, delta, eigen


def _gram(n: int, tokens: int, seed: int = 0) -> np.ndarray:
    X = np.random.default_rng(seed).standard_normal((n, tokens))
    X[: n // 4] *= 30.0
    return X @ X.T


def _same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("overwrite", [False, True])
@pytest.mark.parametrize(
    "case", ["full-rank", "negative-zero", "float32", "eigen-fallback", "all-zero"]
)
def test_whitening_is_bit_identical_to_the_identity_sum(case: str, overwrite: bool) -> None:
    damping = 1e-2
    if case == "full-rank":
        G = _gram(48, 200)
    elif case == "negative-zero":  # G + 0.0 turns -0.0 into +0.0 off the diagonal
        G = _gram(48, 200)
        G[3, 5] = G[5, 3] = -0.0
    elif case == "float32":
        G = _gram(48, 200).astype(np.float32)
    elif case == "eigen-fallback":  # rank-deficient, undamped: Cholesky fails
        G, damping = _gram(48, 10), 0.0
    else:
        G = np.zeros((8, 8))
    given = G.copy()
    factor, delta, eigen = _reference(G, damping)
    white = whitening(G, damping=damping, overwrite=overwrite)
    assert white.delta == delta
    assert _same_bits(white.factor, factor)
    assert (white.eigen is None) == (eigen is None)
    if eigen is not None:
        assert white.eigen is not None and _same_bits(white.eigen, eigen)
    if not overwrite or case == "eigen-fallback" or given.dtype != np.float64:
        assert _same_bits(G, given)  # untouched (restored bit for bit after a failed Cholesky)


def test_whitening_allocates_no_identity_sized_temporaries() -> None:
    n = 384
    nbytes = n * n * 8
    G = _gram(n, 2 * n)
    # Besides G: the factor, and one copy of G unless G may be overwritten (a float32 G's
    # float64 copy is owned: damped in place). Before: np.eye(n), its scaled copy and the sum
    # (2 n x n at once, 3 for a float32 G), and no way to damp in place.
    for dtype, overwrite, most in (
        (np.float64, False, 2),
        (np.float64, True, 1),
        (np.float32, False, 2),
    ):
        A = G.astype(dtype)
        tracemalloc.start()
        whitening(A, overwrite=overwrite)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < (most + 0.25) * nbytes, (dtype, overwrite, peak / nbytes)


def test_check_gram_works_in_row_blocks(monkeypatch) -> None:
    n = 256
    G = _gram(n, 300)
    monkeypatch.setattr(_calibration, "_BLOCK_BYTES", 16 * n * 8)
    tracemalloc.start()
    check_gram(G, "g")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 0.25 * n * n * 8  # before: G - G^T and its |.|, each n x n
    bad = G.copy()
    bad[7, 200] += 1e-2 * float(
        np.abs(G).max()
    )  # asymmetric beyond rounding, in another block than its mirror
    with pytest.raises(CalibrationError) as err:
        check_gram(bad, "'k'")
    scale, asym = float(np.abs(bad).max()), float(np.abs(bad - bad.T).max())
    assert str(err.value) == (
        f"'k' is not symmetric (max |G - G^T| = {asym:.3g}, max |G| = {scale:.3g}); "
        f"a gram is sum_t x_t x_t^T"
    )
    nan = G.copy()
    nan[0, 1] = nan[250, 3] = np.nan
    nan[100, 100] = np.inf
    with pytest.raises(CalibrationError, match=r"^'k' holds 3 NaN/Inf value\(s\); recompute"):
        check_gram(nan, "'k'")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_read_gram_is_the_stored_gram_and_its_digest(tmp_path, monkeypatch, dtype) -> None:
    n = 96
    G = _gram(n, 120).astype(dtype)
    H = _gram(n, 120, seed=1).astype(dtype)
    path = write_stats(
        tmp_path / "s.safetensors",
        {"a.weight": G, "b.weight": G, "c.weight": H},
        tokens=5,
        dtype=dtype,
    )
    monkeypatch.setattr(_calibration, "_BLOCK_BYTES", 7 * n * np.dtype(dtype).itemsize)
    stats = read_stats(path)
    ga, da = stats.read_gram("a.weight")
    gb, db = stats.read_gram("b.weight")
    assert _same_bits(gb, ga)
    gc, dc = stats.read_gram("c.weight")
    stored = safetensors.numpy.load_file(str(path))
    assert _same_bits(ga, stored["a.input_gram"].astype(np.float64))
    assert _same_bits(gc, stored["c.input_gram"].astype(np.float64))
    assert _same_bits(stats.gram("a.weight"), ga)
    assert da == db != dc and da.startswith("sha256:")
    # The float64 gram and a block of rows: no whole stored-dtype copy, no n x n check temporary.
    tracemalloc.start()
    stats.gram("c.weight")
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1.25 * n * n * 8, peak / (n * n * 8)


def _stats_file(tmp_path: Path) -> Path:
    qkv, o, down = _gram(24, 60, 0), _gram(24, 60, 1), _gram(40, 90, 2)
    grams = {}
    for p in ("q", "k", "v"):
        grams[f"model.layers.0.self_attn.{p}_proj.weight"] = qkv
    grams["model.layers.0.self_attn.o_proj.weight"] = o
    grams["model.layers.0.mlp.down_proj.weight"] = down
    return write_stats(tmp_path / "s.safetensors", grams, tokens=60, dtype=np.float64)


@pytest.mark.parametrize("memory_bytes", [1 << 30, 0, 24 * 24 * 8])
def test_store_factors_each_distinct_gram_once(tmp_path, memory_bytes) -> None:
    cal = as_calibration(_stats_file(tmp_path))
    assert cal is not None
    object.__setattr__(cal, "store", WhiteningStore(memory_bytes, directory=tmp_path))
    keys = [
        ("model.layers.0.self_attn.q_proj.weight", 24),
        ("model.layers.0.self_attn.k_proj.weight", 24),
        ("model.layers.0.self_attn.v_proj.weight", 24),
        ("model.layers.0.self_attn.o_proj.weight", 24),
        ("model.layers.0.mlp.down_proj.weight", 40),
    ]
    first = {k: cal.whitening(k, n) for k, n in keys}
    for _ in range(3):
        for k, n in keys:
            white = cal.whitening(k, n)
            assert white is not None
            assert _same_bits(white.factor, first[k].factor)
            assert not white.factor.flags.writeable
            ref, _, _ = _reference(cal.stats.gram(k))
            assert _same_bits(white.factor, ref)
    assert cal.store.computed == 3  # q/k/v's one gram, o_proj's, down_proj's
    assert (cal.store.loaded > 0) == (memory_bytes < 1 << 30)
    assert cal.whitening("model.layers.0.mlp.up_proj.weight", 24) is None
    with pytest.raises(CalibrationError, match="the projection's input is 7 wide"):
        cal.whitening("model.layers.0.mlp.down_proj.weight", 7)
    spilled = list(tmp_path.glob("attnquant-whitening-*"))
    assert len(spilled) == (0 if memory_bytes >= 1 << 30 else 1)
    cal.store.close()
    assert not list(tmp_path.glob("attnquant-whitening-*"))


def test_store_spills_and_reads_back_an_eigen_factor(tmp_path) -> None:
    G = _gram(16, 4)  # rank 4: undamped Cholesky fails
    path = write_stats(tmp_path / "e.safetensors", {"x.weight": G}, tokens=4, dtype=np.float64)
    cal = Calibration(stats=read_stats(path), damping=0.0)
    object.__setattr__(cal, "store", WhiteningStore(0, directory=tmp_path))
    a, b = cal.whitening("x.weight", 16), cal.whitening("x.weight", 16)
    assert a is not None and b is not None and a.eigen is not None and b.eigen is not None
    assert _same_bits(a.factor, b.factor) and _same_bits(a.eigen, b.eigen)
    assert cal.store.computed == 1 and cal.store.loaded == 1


def _tensors(directory: Path) -> dict[str, bytes]:
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update({k: v.tobytes() for k, v in safetensors.numpy.load_file(str(f)).items()})
    return out


@pytest.mark.parametrize("how", ["budget", "blocks"])
def test_a_decomposition_factors_each_distinct_gram_once(tiny_calibrated, tmp_path, how) -> None:
    directory, stats, _ = tiny_calibrated
    outs = []
    for memory_bytes in (1 << 30, 0):  # all held; all spilled to disk and read back
        cal = as_calibration(stats)
        assert cal is not None
        object.__setattr__(cal, "store", WhiteningStore(memory_bytes, directory=tmp_path))
        out = tmp_path / f"{how}-{memory_bytes}"
        if how == "budget":
            decompose_budget(directory, out, budget=0.5, calibration=cal)
        else:
            decompose_checkpoint(directory, out, blocks=1, rank=3, calibration=cal)
        # 2 layers x (q/k/v's input, o_proj's, gate/up's, down_proj's)
        assert cal.store.computed == 8
        outs.append(out)
        cal.store.close()
    assert _tensors(outs[0]) == _tensors(outs[1])
    manifests = [json.loads((o / "attnquant.json").read_text()) for o in outs]
    assert manifests[0]["families"] == manifests[1]["families"]
