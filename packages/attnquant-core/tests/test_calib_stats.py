"""The calibration statistics file: written by a plain script or by attnquant, read and refused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from attnquant_core.calib import (
    CalibrationError,
    StatsWriter,
    gram_key,
    read_stats,
    stats_digest,
    whitening,
    write_stats,
)

KEY = "model.layers.3.self_attn.q_proj"


def _gram(n: int, tokens: int = 50, seed: int = 0) -> np.ndarray:
    X = np.random.default_rng(seed).standard_normal((tokens, n))
    return X.T @ X


def test_gram_key() -> None:
    assert gram_key(f"{KEY}.weight") == f"{KEY}.input_gram"
    assert gram_key(f"{KEY}.input_gram") == f"{KEY}.input_gram"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_file_written_by_a_plain_script_is_accepted(tmp_path: Path, dtype) -> None:
    # What another tool (PyTorch hooks, say) would write: nothing of attnquant involved.
    G = _gram(6).astype(dtype)
    path = tmp_path / "stats.safetensors"
    safetensors.numpy.save_file(
        {f"{KEY}.input_gram": G, "model.layers.3.mlp.down_proj.input_gram": _gram(4).astype(dtype)},
        str(path),
        metadata={"tokens": "50"},
    )
    stats = read_stats(path)
    assert stats.tokens == 50
    assert stats.keys == ["model.layers.3.mlp.down_proj.weight", f"{KEY}.weight"]
    assert f"{KEY}.weight" in stats and "model.layers.0.mlp.up_proj.weight" not in stats
    got = stats.gram(f"{KEY}.weight", in_features=6)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, G.astype(np.float64))
    assert stats.gram("model.layers.0.mlp.up_proj.weight") is None  # absent: fit unwhitened
    stats.validate()
    assert stats.digest == stats_digest(path) and stats.digest.startswith("sha256:")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_write_stats_round_trips_and_matches_safetensors(tmp_path: Path, dtype) -> None:
    grams = {f"{KEY}.weight": _gram(5), "model.layers.0.mlp.down_proj.weight": _gram(7, seed=1)}
    path = write_stats(tmp_path / "s.safetensors", grams, tokens=50, dtype=dtype)
    # The streamed writer's bytes are a valid safetensors file to the reference reader.
    plain = safetensors.numpy.load_file(str(path))
    assert set(plain) == {gram_key(k) for k in grams}
    stats = read_stats(path)
    for key, G in grams.items():
        assert plain[gram_key(key)].dtype == dtype
        np.testing.assert_allclose(stats.gram(key), G, rtol=1e-6 if dtype == np.float32 else 0)
    assert [p.name for p in tmp_path.iterdir()] == ["s.safetensors"]  # no temporary left


def test_writer_leaves_nothing_when_interrupted(tmp_path: Path) -> None:
    path = tmp_path / "s.safetensors"

    def interrupted() -> None:
        with StatsWriter(path, {"a.weight": 2, "b.weight": 2}, tokens=1) as w:
            w.write("a.weight", np.eye(2))
            raise RuntimeError("killed")

    def incomplete() -> None:
        with StatsWriter(path, {"a.weight": 2, "b.weight": 2}, tokens=1) as w:
            w.write("a.weight", np.eye(2))

    with pytest.raises(RuntimeError, match="killed"):
        interrupted()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(CalibrationError, match="'b.input_gram' was declared but never written"):
        incomplete()
    assert list(tmp_path.iterdir()) == []


def _plain(tmp_path: Path, tensors: dict, metadata: dict | None = {"tokens": "9"}) -> Path:  # noqa: B006
    path = tmp_path / "bad.safetensors"
    safetensors.numpy.save_file(tensors, str(path), metadata=metadata)
    return path


@pytest.mark.parametrize(
    ("tensors", "metadata", "match"),
    [
        ({f"{KEY}.input_gram": np.eye(3)}, None, "__metadata__ has no 'tokens'"),
        ({f"{KEY}.input_gram": np.eye(3)}, {"tokens": "many"}, "'tokens' is 'many'"),
        ({f"{KEY}.input_gram": np.eye(3)}, {"tokens": "0"}, "positive integer"),
        (
            {f"{KEY}.input_gram": np.ones((3, 4))},
            {"tokens": "9"},
            rf"'{KEY}.input_gram' has shape \[3, 4\]",
        ),
        (
            {f"{KEY}.input_gram": np.ones(3)},
            {"tokens": "9"},
            rf"'{KEY}.input_gram' has shape \[3\]",
        ),
        (
            {f"{KEY}.input_gram": np.eye(3, dtype=np.float16)},
            {"tokens": "9"},
            "is F16; grams are F32 or F64",
        ),
        ({f"{KEY}.weight": np.eye(3)}, {"tokens": "9"}, "is not a gram key"),
    ],
)
def test_malformed_headers_get_one_line_errors(tmp_path, tensors, metadata, match) -> None:
    with pytest.raises(CalibrationError, match=match) as info:
        read_stats(_plain(tmp_path, tensors, metadata))
    assert "\n" not in str(info.value)


def test_malformed_values_name_the_key(tmp_path: Path) -> None:
    nan = np.eye(3)
    nan[1, 2] = nan[2, 1] = np.nan
    asym = np.eye(3)
    asym[0, 1] = 0.5
    stats = read_stats(
        _plain(
            tmp_path,
            {
                "a.input_gram": nan,
                "b.input_gram": asym,
                "c.input_gram": np.eye(3),
                "d.input_gram": -np.eye(3),
            },
        )
    )
    for key, match in [
        ("a", "'a.input_gram' holds 2 NaN/Inf"),
        ("b", "'b.input_gram' is not symmetric"),
        ("d", "'d.input_gram' has a negative diagonal"),
    ]:
        with pytest.raises(CalibrationError, match=match) as info:
            stats.gram(f"{key}.weight")
        assert "\n" not in str(info.value) and str(stats.path) in str(info.value)
    with pytest.raises(CalibrationError, match=r"'c.input_gram' has shape \[3, 3\] but .* 4 wide"):
        stats.gram("c.weight", in_features=4)
    with pytest.raises(CalibrationError, match="'a.input_gram' holds"):
        stats.validate()


def test_not_positive_semidefinite_beyond_damping_is_refused() -> None:
    G = _gram(4)
    w, Q = np.linalg.eigh(G)
    w[0] = -0.5 * w.mean()  # far below -damping * mean(diag)
    bad = (Q * w) @ Q.T
    with pytest.raises(CalibrationError, match="'k.input_gram' is not positive semi-definite"):
        whitening(bad, where="'k.input_gram'")
    # Within the damping it is accepted (rounding of a rank-deficient gram looks like this).
    w[0] = -1e-4 * np.diagonal(G).mean()
    whitening((Q * w) @ Q.T, damping=1e-2)
