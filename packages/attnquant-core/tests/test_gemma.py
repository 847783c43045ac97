"""Core on Gemma keys: family detection, decomposition, theta round trip, budgets, alignment.

Every checkpoint here is a tiny Gemma made by :mod:`attnquant_core.tiny_gemma` (bf16 as
released), read through the public API only. Function is judged with the numpy Gemma 3
reference forward (:mod:`attnquant_core.gemma_reference`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors
import safetensors.numpy

from attnquant_core import (
    FAMILIES,
    FORMS,
    BandMismatchError,
    CheckpointError,
    ThetaCheckpoint,
    align_checkpoint,
    decompose_budget,
    decompose_checkpoint,
    open_checkpoint,
    rebuild_dense_state,
)
from attnquant_core.gemma_reference import gemma3_logits
from attnquant_core.tiny_gemma import (
    write_tiny_gemma3,
    write_tiny_gemma3_conditional,
    write_tiny_gemma4,
)

IDS = [5, 17, 200, 3, 99, 42, 7, 250, 1, 64, 128, 31]

WRITERS = {
    "gemma3": write_tiny_gemma3,
    "gemma3_conditional": write_tiny_gemma3_conditional,
    # Gemma 4 with uniform layers; the 31B shape (global layers of their own size) is below.
    "gemma4_uniform": lambda path: write_tiny_gemma4(
        path, global_head_dim=16, num_global_key_value_heads=None, attention_k_eq_v=False
    ),
}
STACKS = {
    "gemma3": "model.layers",
    "gemma3_conditional": "language_model.model.layers",
    "gemma4_uniform": "model.language_model.layers",
}


@pytest.fixture(scope="module", params=sorted(WRITERS))
def gemma(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return WRITERS[request.param](tmp_path_factory.mktemp(request.param) / "dense")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("g3") / "dense")


def _dense(path: Path) -> dict[str, np.ndarray]:
    ckpt = open_checkpoint(path)
    return {key: ckpt.get(key) for key in ckpt.keys()}


def _same_keys_and_dtypes(state: dict[str, np.ndarray], source: dict[str, np.ndarray]) -> None:
    assert set(state) == set(source)
    for key, array in state.items():
        assert array.dtype == source[key].dtype, key
        assert array.shape == source[key].shape, key


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def _logprobs(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


# -- detection --------------------------------------------------------------------------------


def test_families_detected_on_gemma_keys(gemma: Path) -> None:
    ckpt = open_checkpoint(gemma)
    assert ckpt.num_layers == 4
    assert set(ckpt.families) == set(FAMILIES)
    assert {info.stack for info in ckpt.families.values()} == {STACKS[gemma.parent.name[:-1]]}
    assert {str(info.dtype) for info in ckpt.families.values()} == {"bfloat16"}
    # Gemma's extra norms (q/k norms, pre/post feed-forward) are not projections: copied.
    others = set(ckpt.keys()) - set(ckpt.projection_keys())
    assert any(k.endswith("self_attn.q_norm.weight") for k in others)
    assert any(k.endswith("post_feedforward_layernorm.weight") for k in others)


# -- decomposition and the theta checkpoint -----------------------------------------------------


def test_passthrough_rebuild_is_bit_exact_in_bf16(gemma: Path, tmp_path: Path) -> None:
    source = _dense(gemma)
    decompose_checkpoint(gemma, tmp_path / "theta", blocks="layers", rank=0)
    theta = ThetaCheckpoint.open(tmp_path / "theta")
    assert theta.passthrough and theta.num_layers == 4
    rebuilt = dict(theta.rebuilt_state())
    _same_keys_and_dtypes(rebuilt, source)
    for key, array in rebuilt.items():
        assert array.tobytes() == source[key].tobytes(), key


@pytest.mark.parametrize(("blocks", "rank"), [(1, 16), (2, 4)])
def test_banded_round_trip(gemma: Path, tmp_path: Path, blocks: int, rank: int) -> None:
    source = _dense(gemma)
    manifest = decompose_checkpoint(gemma, tmp_path / "theta", blocks=blocks, rank=rank)
    assert manifest["blocks"] == blocks and manifest["rank"] == rank
    theta = ThetaCheckpoint.open(tmp_path / "theta", blocks=blocks)
    assert set(theta.forms.values()) == {"banded"}
    rebuilt = dict(theta.rebuilt_state())
    _same_keys_and_dtypes(rebuilt, source)
    # The theta checkpoint rebuilds what decomposing in memory rebuilds.
    in_memory = dict(rebuild_dense_state(gemma, blocks=blocks, rank=rank))
    for key, array in rebuilt.items():
        np.testing.assert_array_equal(array.astype(np.float32), in_memory[key].astype(np.float32))
    # Non-projection tensors (norms, embedding) travel unchanged; projections are approximated.
    projections = set(open_checkpoint(gemma).projection_keys())
    for key in source.keys() - projections:
        assert rebuilt[key].tobytes() == source[key].tobytes(), key
    for key in projections:
        W, R = source[key].astype(np.float64), rebuilt[key].astype(np.float64)
        assert np.linalg.norm(W - R) < np.linalg.norm(W), key
    # Theta keys and shared blocks are where the format says, under the source's stack.
    stack = open_checkpoint(gemma).families["self_attn.q_proj"].stack
    keys = set()
    for shard in (tmp_path / "theta").glob("*.safetensors"):
        with safetensors.safe_open(shard, "numpy") as f:
            keys.update(f.keys())
    assert f"{stack}.0.self_attn.q_proj.theta_s" in keys
    assert f"attnquant.shared.self_attn.q_proj.{blocks - 1}.W0" in keys


def test_theta_checkpoint_with_other_blocks_is_refused(gemma3: Path, tmp_path: Path) -> None:
    decompose_checkpoint(gemma3, tmp_path / "theta", blocks=2, rank=4)
    with pytest.raises(BandMismatchError, match="ATTNQUANT_BLOCKS"):
        ThetaCheckpoint.open(tmp_path / "theta", blocks=1)


@pytest.mark.parametrize("form", FORMS)
def test_every_budget_form(gemma3: Path, tmp_path: Path, form: str) -> None:
    source = _dense(gemma3)
    report = decompose_budget(gemma3, tmp_path / "theta", budget=0.5, forms=(form,))
    theta = ThetaCheckpoint.open(tmp_path / "theta")
    assert set(theta.forms.values()) == {form}
    rebuilt = dict(theta.rebuilt_state())
    _same_keys_and_dtypes(rebuilt, source)
    stored = sum(f["stored_parameters"] for f in report.manifest["families"].values())
    dense = sum(f["dense_parameters"] for f in report.manifest["families"].values())
    assert stored <= 0.5 * dense
    logits = gemma3_logits(_config(gemma3), rebuilt, IDS)
    assert np.isfinite(logits).all()


def test_budget_through_decompose_checkpoint(gemma3: Path, tmp_path: Path) -> None:
    """``--budget`` (auto form) as the CLI calls it."""
    source = _dense(gemma3)
    manifest = decompose_checkpoint(gemma3, tmp_path / "theta", budget=0.6)
    assert "budget" in manifest
    rebuilt = dict(ThetaCheckpoint.open(tmp_path / "theta").rebuilt_state())
    _same_keys_and_dtypes(rebuilt, source)


def test_function_at_passthrough_and_compressed(gemma3: Path, tmp_path: Path) -> None:
    config = _config(gemma3)
    base = gemma3_logits(config, _dense(gemma3), IDS)
    decompose_checkpoint(gemma3, tmp_path / "pass", blocks="layers", rank=0)
    passthrough = dict(ThetaCheckpoint.open(tmp_path / "pass").rebuilt_state())
    np.testing.assert_array_equal(gemma3_logits(config, passthrough, IDS), base)
    decompose_checkpoint(gemma3, tmp_path / "g1", blocks=1, rank=16)
    compressed = dict(ThetaCheckpoint.open(tmp_path / "g1").rebuilt_state())
    delta = np.abs(_logprobs(gemma3_logits(config, compressed, IDS)) - _logprobs(base)).max()
    assert 0.0 < delta < 5.0


# -- alignment ---------------------------------------------------------------------------------


def test_align_is_function_preserving_in_float32(tmp_path: Path) -> None:
    src = write_tiny_gemma3(tmp_path / "f32", dtype="float32")
    report = align_checkpoint(src, tmp_path / "aligned", blocks=1)
    config, source, aligned = _config(src), _dense(src), _dense(tmp_path / "aligned")
    _same_keys_and_dtypes(aligned, source)
    assert any(not np.array_equal(aligned[k], source[k]) for k in source)  # something moved
    # Gemma's q_norm/k_norm weights differ per coordinate: the q/k planes stay unrotated.
    assert any("q_norm/k_norm" in note for note in report.notes)
    np.testing.assert_allclose(
        gemma3_logits(config, aligned, IDS), gemma3_logits(config, source, IDS), atol=1e-6
    )


def test_align_in_bf16_moves_logits_by_round_off(gemma3: Path, tmp_path: Path) -> None:
    """Rotated weights are re-rounded to bf16: the aligned model differs from the source by
    bf16 round-off (~1e-2 in logits here), and the report says so. Passthrough of the aligned
    checkpoint is then exact with respect to the aligned model, not the source."""
    report = align_checkpoint(gemma3, tmp_path / "aligned", blocks=1)
    assert any("bfloat16" in note and "round-off" in note for note in report.notes)
    config, source, aligned = _config(gemma3), _dense(gemma3), _dense(tmp_path / "aligned")
    _same_keys_and_dtypes(aligned, source)
    base = gemma3_logits(config, source, IDS)
    moved = np.abs(gemma3_logits(config, aligned, IDS) - base).max()
    assert 1e-4 < moved < 5e-2
    decompose_checkpoint(tmp_path / "aligned", tmp_path / "theta", blocks="layers", rank=0)
    rebuilt = dict(ThetaCheckpoint.open(tmp_path / "theta").rebuilt_state())
    for key, array in rebuilt.items():
        assert array.tobytes() == aligned[key].tobytes(), key


# -- Gemma 4 31B's shape --------------------------------------------------------------------


def test_gemma4_31b_shape_is_grouped_and_uniform_errors_carry_no_hint(tmp_path: Path) -> None:
    """Gemma 4 31B's global layers (another head size, no v_proj) form groups of their own
    (test_gemma4_groups.py); a uniform Gemma 4 with one layer cut short is still a shape
    mismatch, with no word about global layers."""
    ckpt = open_checkpoint(write_tiny_gemma4(tmp_path / "g4"))
    assert ckpt.grouped and "self_attn.q_proj@full_attention" in ckpt.families
    assert "global" not in str(_error_of(tmp_path))


def _error_of(tmp_path: Path) -> Exception:
    """The error of a uniform Gemma 4 with one layer's q_proj cut short."""
    path = write_tiny_gemma4(
        tmp_path / "uniform",
        global_head_dim=16,
        num_global_key_value_heads=None,
        attention_k_eq_v=False,
    )
    shard = path / "model.safetensors"
    tensors = safetensors.numpy.load_file(shard)
    key = "model.language_model.layers.2.self_attn.q_proj.weight"
    tensors[key] = np.ascontiguousarray(tensors[key][:32])
    safetensors.numpy.save_file(tensors, shard)
    with pytest.raises(CheckpointError, match="shape mismatch") as info:
        open_checkpoint(path)
    return info.value
