"""Alignment (--align): the aligned model computes the same function, and layers come closer.

Function preservation is checked through the numpy Llama forward of
``attnquant_core.llama_reference``; the scrambled-copies tests build layers as independently
permuted/rotated copies of one base layer (transforms written here, independently of the
module) and check that alignment undoes them down to the noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from attnquant_core import (
    MANIFEST_FILE,
    DecompositionError,
    decompose_checkpoint,
    open_checkpoint,
)
from attnquant_core.fit import (
    ALIGN_MANIFEST_FILE,
    ALIGN_TRANSFORMS_FILE,
    AlignError,
    align_checkpoint,
    align_state,
    load_align_transforms,
    unalign_state,
)
from attnquant_core.llama_reference import ReferenceConfigError, llama_logits

IDS = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]
ATTN = [f"self_attn.{x}_proj.weight" for x in "qkvo"]
MLP = [f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]


def tiny_llama(
    *,
    layers: int = 3,
    hidden: int = 32,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 8,
    intermediate: int = 48,
    vocab: int = 50,
    seed: int = 0,
    dtype: type | np.dtype = np.float64,
    prefix: str = "model",
    arch: str = "LlamaForCausalLM",
) -> tuple[dict, dict[str, np.ndarray]]:
    """A random Llama (config and state) with GQA and rotary embeddings."""
    rng = np.random.default_rng(seed)
    config = {
        "architectures": [arch],
        "model_type": "llama",
        "hidden_size": hidden,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100.0,
        "rope_scaling": None,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
    }

    def w(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape) / np.sqrt(shape[-1])

    state = {
        f"{prefix}.embed_tokens.weight": rng.standard_normal((vocab, hidden)),
        f"{prefix}.norm.weight": 1 + 0.1 * rng.standard_normal(hidden),
        "lm_head.weight": w(vocab, hidden),
    }
    for i in range(layers):
        p = f"{prefix}.layers.{i}."
        state[p + "self_attn.q_proj.weight"] = 2 * w(heads * head_dim, hidden)
        state[p + "self_attn.k_proj.weight"] = 2 * w(kv_heads * head_dim, hidden)
        state[p + "self_attn.v_proj.weight"] = w(kv_heads * head_dim, hidden)
        state[p + "self_attn.o_proj.weight"] = w(hidden, heads * head_dim)
        state[p + "mlp.gate_proj.weight"] = w(intermediate, hidden)
        state[p + "mlp.up_proj.weight"] = w(intermediate, hidden)
        state[p + "mlp.down_proj.weight"] = w(hidden, intermediate)
        state[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(hidden)
        state[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(hidden)
    return config, {k: v.astype(dtype) for k, v in state.items()}


def scrambled_copies(config: dict, state: dict, *, noise: float, seed: int = 1) -> dict:
    """Every layer := a random function-preserving transform of layer 0, plus relative noise."""
    rng = np.random.default_rng(seed)
    nh, nkv, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    n_rep, half = nh // nkv, d // 2
    out = dict(state)
    base = {s: state[f"model.layers.0.{s}"] for s in ATTN + MLP}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        perm = rng.permutation(config["intermediate_size"])
        gate, up = base["mlp.gate_proj.weight"][perm], base["mlp.up_proj.weight"][perm]
        down = base["mlp.down_proj.weight"][:, perm]
        H = config["hidden_size"]
        q = base[ATTN[0]].reshape(nh, d, H)
        k = base[ATTN[1]].reshape(nkv, d, H)
        v = base[ATTN[2]].reshape(nkv, d, H)
        o = base[ATTN[3]].T.reshape(nh, d, H)  # per query head: its o columns, transposed
        kv_perm = rng.permutation(nkv)
        q_perm = np.concatenate([kv_perm[j] * n_rep + rng.permutation(n_rep) for j in range(nkv)])
        q, o, k, v = q[q_perm].copy(), o[q_perm].copy(), k[kv_perm].copy(), v[kv_perm].copy()
        for j in range(nkv):
            R = np.linalg.qr(rng.standard_normal((d, d)))[0]
            group = slice(j * n_rep, (j + 1) * n_rep)
            v[j] = R @ v[j]
            o[group] = R @ o[group]  # o columns @ R^T, in the transposed layout
            theta = rng.uniform(-np.pi, np.pi, half)[:, None]
            c, s = np.cos(theta), np.sin(theta)
            for X in (k[j : j + 1], q[group]):
                x1, x2 = X[:, :half].copy(), X[:, half:].copy()
                X[:, :half], X[:, half:] = c * x1 - s * x2, s * x1 + c * x2
        new = {
            ATTN[0]: q.reshape(nh * d, H),
            ATTN[1]: k.reshape(nkv * d, H),
            ATTN[2]: v.reshape(nkv * d, H),
            ATTN[3]: o.reshape(nh * d, H).T,
            MLP[0]: gate,
            MLP[1]: up,
            MLP[2]: down,
        }
        for s, W in new.items():
            out[p + s] = W + noise * np.std(W) * rng.standard_normal(W.shape)
    return out


def assert_same_logits(config, before, after, *, dtype=np.float64, rtol=1e-10, prefix="model"):
    ref = llama_logits(config, before, IDS, dtype=dtype, prefix=prefix)
    got = llama_logits(config, after, IDS, dtype=dtype, prefix=prefix)
    scale = float(np.abs(ref).max())
    assert np.abs(got - ref).max() <= rtol * scale, np.abs(got - ref).max() / scale


def changed(a: dict, b: dict) -> set[str]:
    return {k for k in a if not np.array_equal(np.asarray(a[k]), np.asarray(b[k]))}


def write_model(directory: Path, config: dict, state: dict) -> Path:
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "tokenizer.json").write_text("{}")
    safetensors.numpy.save_file(
        {k: np.ascontiguousarray(v) for k, v in state.items()}, directory / "model.safetensors"
    )
    return directory


# -- the function is preserved ------------------------------------------------------------------


def test_float64_logits_agree_and_weights_changed():
    config, state = tiny_llama()
    aligned, transforms = align_state(config, state)
    assert_same_logits(config, state, aligned, rtol=1e-10)
    touched = changed(state, aligned)
    assert touched <= {f"model.layers.{i}.{s}" for i in range(3) for s in ATTN + MLP}
    # The middle layer is round 1's target, so its neurons may keep their order; not the others.
    assert {f"model.layers.{i}.{s}" for i in (0, 2) for s in ATTN + MLP} <= touched
    for key in state:
        assert aligned[key].dtype == state[key].dtype and aligned[key].shape == state[key].shape
    assert set(transforms.distances) == {s.removesuffix(".weight") for s in ATTN + MLP}


def test_float32_logits_agree_to_float32_round_off():
    config, state = tiny_llama(dtype=np.float32)
    aligned, _ = align_state(config, state)
    assert all(a.dtype == np.float32 for a in aligned.values())
    assert_same_logits(config, state, aligned, dtype=np.float32, rtol=1e-5)
    assert_same_logits(config, state, aligned, dtype=np.float64, rtol=1e-5)


def test_transforms_are_valid_symmetries():
    config, state = tiny_llama(layers=4, heads=6, kv_heads=2)
    _, t = align_state(config, state)
    for i in range(4):
        kv = t.arrays[f"layers.{i}.attn.kv_perm"]
        q = t.arrays[f"layers.{i}.attn.q_perm"]
        rot = t.arrays[f"layers.{i}.attn.vo_rot"]
        assert sorted(kv) == [0, 1] and sorted(q) == list(range(6))
        assert np.array_equal(q // 3, np.repeat(kv, 3))  # a query head stays with its kv head
        assert np.allclose(rot @ rot.transpose(0, 2, 1), np.eye(8), atol=1e-12)
        assert np.allclose(np.linalg.det(rot) ** 2, 1)
        assert t.arrays[f"layers.{i}.attn.qk_angle"].shape == (2, 4)
        assert sorted(t.arrays[f"layers.{i}.mlp.perm"]) == list(range(48))


# -- alignment helps ---------------------------------------------------------------------------


def test_scrambled_copies_are_symmetries_of_the_base_layer():
    """The test's own transforms preserve the function (checks them, GQA grouping included)."""
    config, base = tiny_llama(layers=3, hidden=48, heads=8, kv_heads=2, head_dim=16)
    for i in (1, 2):
        for s in ATTN + MLP:
            base[f"model.layers.{i}.{s}"] = base[f"model.layers.0.{s}"]
    scrambled = scrambled_copies(config, base, noise=0.0)
    assert changed(base, scrambled)
    assert_same_logits(config, base, scrambled, rtol=1e-10)


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_scrambled_copies_are_recovered(kv_heads):
    config, base = tiny_llama(layers=4, hidden=48, heads=8, kv_heads=kv_heads, head_dim=16)
    noise = 0.02
    state = scrambled_copies(config, base, noise=noise)
    aligned, t = align_state(config, state, rounds=3)
    assert_same_logits(config, state, aligned, rtol=1e-10)
    for name, (before, after) in t.distances.items():
        assert before > 0.5, name  # scrambled: the layers are far from their mean
        assert after < 2 * noise, (name, after)  # aligned: only the noise is left
        assert before / after > 20, name


def test_alignment_lowers_distance_on_a_random_model():
    config, state = tiny_llama(layers=4)
    _, t = align_state(config, state)
    for name, (before, after) in t.distances.items():
        assert after <= before, name


def test_blocks_equal_layers_changes_nothing():
    config, state = tiny_llama()
    aligned, t = align_state(config, state, blocks="layers")
    assert not changed(state, aligned)
    assert all(before == after == 0.0 for before, after in t.distances.values())
    assert any("nothing to align" in note for note in t.notes)


def test_two_bands_align_within_each_band():
    config, base = tiny_llama(layers=4, hidden=48, heads=8, kv_heads=2, head_dim=16)
    state = scrambled_copies(config, base, noise=0.02)
    aligned, t = align_state(config, state, blocks=2)
    assert t.blocks == 2
    assert_same_logits(config, state, aligned)
    assert all(after < 0.05 for _, after in t.distances.values())


# -- round trips and records ------------------------------------------------------------------------


def test_unalign_restores_the_original_parametrisation():
    config, state = tiny_llama(dtype=np.float32)
    aligned, t = align_state(config, state)
    restored = unalign_state(aligned, t)
    for key in state:
        assert restored[key].dtype == state[key].dtype
        if ".mlp." in key or "layernorm" in key or "layers" not in key:
            assert np.array_equal(restored[key], state[key]), key  # permutations: exact
        else:
            np.testing.assert_allclose(restored[key], state[key], rtol=0, atol=1e-6)


def test_unalign_float64_is_round_off_close():
    config, state = tiny_llama()
    aligned, t = align_state(config, state)
    restored = unalign_state(aligned, t)
    assert max(float(np.abs(restored[k] - state[k]).max()) for k in state) < 1e-13


def test_align_checkpoint_writes_atomically_and_records_the_transforms(tmp_path):
    config, state = tiny_llama(dtype=np.float32)
    src = write_model(tmp_path / "src", config, state)
    out = tmp_path / "aligned"
    report = align_checkpoint(src, out, rounds=2)
    assert report.path == out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["aligned", "src"]  # no temp dir left
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        [
            "config.json",
            "tokenizer.json",
            "model.safetensors",
            ALIGN_TRANSFORMS_FILE,
            ALIGN_MANIFEST_FILE,
            "attnquant.digests.json",  # every tensor's digest (issue 16)
        ]
    )
    assert not ALIGN_TRANSFORMS_FILE.endswith(".safetensors")
    ckpt = open_checkpoint(out)
    assert ckpt.keys() == sorted(state)
    dense = {k: ckpt.get(k) for k in ckpt.keys()}
    assert all(dense[k].dtype == np.float32 and dense[k].shape == state[k].shape for k in state)
    assert_same_logits(config, state, dense, dtype=np.float32, rtol=1e-5)

    manifest = json.loads((out / ALIGN_MANIFEST_FILE).read_text())
    assert manifest["format"] == "attnquant-align" and manifest["format_version"] == 1
    assert (manifest["blocks"], manifest["rounds"], manifest["num_layers"]) == (1, 2, 3)
    assert manifest["stack"] == "model.layers"
    assert manifest["applied"]["mlp_neuron_permutation"] is True
    assert manifest["applied"]["vo_rotation"] is True
    for name, fam in manifest["families"].items():
        assert fam["distance_after"] <= fam["distance_before"], name
        assert report.distances[name] == (fam["distance_before"], fam["distance_after"])
    with np.load(out / ALIGN_TRANSFORMS_FILE) as npz:
        assert sorted(npz.files) == sorted(manifest["arrays"])
        assert npz["layers.2.attn.vo_rot"].shape == (2, 8, 8)
        assert npz["layers.2.attn.qk_angle"].shape == (2, 4)
        assert npz["layers.2.attn.q_perm"].shape == (4,)
        assert npz["layers.2.attn.kv_perm"].shape == (2,)
        assert npz["layers.2.mlp.perm"].shape == (48,)
    assert "family" in report.table() and "mlp.down_proj" in report.table()

    restored = unalign_state(dense, load_align_transforms(out))
    for key in state:
        np.testing.assert_allclose(restored[key], state[key], rtol=0, atol=1e-6)

    with pytest.raises(FileExistsError):
        align_checkpoint(src, out)
    align_checkpoint(src, out, overwrite=True)


ALIGNED_RECORD = {
    "applied": True,
    "transforms": ALIGN_MANIFEST_FILE,
    "note": "weights and source digests are those of the aligned copy; the same function",
}


@pytest.mark.parametrize("how", ["banded", "budget"])
def test_decomposing_an_aligned_copy_records_it_in_the_manifest(tmp_path, how):
    """``aligned_from=``: core writes the ``aligned`` entry and names the original as the source
    (what ``decompose --align`` records), in one write, with the transforms beside it."""
    config, state = tiny_llama(dtype=np.float32)
    src = write_model(tmp_path / "src", config, state)
    aligned = align_checkpoint(src, tmp_path / "aligned", rounds=2).path
    out = tmp_path / "theta"
    kw = {"budget": 0.5} if how == "budget" else {"blocks": 1, "rank": 2}
    manifest = decompose_checkpoint(aligned, out, aligned_from=src, **kw)
    assert manifest == json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["aligned"] == ALIGNED_RECORD
    assert list(manifest)[-2:] == ["source", "aligned"]
    assert manifest["source"]["path"] == str(src)
    assert set(manifest["source"]["digests"]) == set(state)
    assert (out / ALIGN_MANIFEST_FILE).is_file() and (out / ALIGN_TRANSFORMS_FILE).is_file()

    plain = decompose_checkpoint(aligned, tmp_path / "plain", **kw)
    assert "aligned" not in plain and plain["source"]["path"] == str(aligned)


def test_aligned_from_refuses_a_copy_that_was_not_aligned(tmp_path):
    config, state = tiny_llama(dtype=np.float32)
    src = write_model(tmp_path / "src", config, state)
    with pytest.raises(AlignError, match="not an aligned copy"):
        decompose_checkpoint(src, tmp_path / "theta", rank=2, aligned_from=src)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_align_checkpoint_failure_leaves_nothing(tmp_path):
    config, state = tiny_llama(dtype=np.float32)
    state["model.layers.2.mlp.up_proj.weight"][3, 4] = np.nan
    src = write_model(tmp_path / "src", config, state)
    with pytest.raises(AlignError, match=r"model\.layers\.2\.mlp\.up_proj\.weight.*NaN"):
        align_checkpoint(src, tmp_path / "aligned")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_sharded_checkpoint(tmp_path):
    config, state = tiny_llama(dtype=np.float32)
    src = write_model(tmp_path / "src", config, state)
    align_checkpoint(src, tmp_path / "aligned", max_shard_bytes=20_000)
    out = tmp_path / "aligned"
    assert (out / "model.safetensors.index.json").is_file()
    dense = {k: v for k, v in ((k, open_checkpoint(out).get(k)) for k in state)}
    assert_same_logits(config, state, dense, dtype=np.float32, rtol=1e-5)


def test_bfloat16_checkpoint(tmp_path):
    config, state = tiny_llama(dtype=ml_dtypes.bfloat16)
    src = write_model(tmp_path / "src", config, state)
    report = align_checkpoint(src, tmp_path / "aligned")
    ckpt = open_checkpoint(tmp_path / "aligned")
    dense = {k: ckpt.get(k) for k in ckpt.keys()}
    assert all(a.dtype == ml_dtypes.bfloat16 for a in dense.values())
    assert any("bfloat16" in note and "not bit for bit" in note for note in report.notes)
    perm = report.transforms.arrays["layers.1.mlp.perm"]
    # Permutations are exact even in bfloat16; rotations are rounded.
    assert np.array_equal(
        dense["model.layers.1.mlp.gate_proj.weight"],
        state["model.layers.1.mlp.gate_proj.weight"][perm],
    )
    assert np.array_equal(
        dense["model.layers.1.mlp.down_proj.weight"],
        state["model.layers.1.mlp.down_proj.weight"][:, perm],
    )
    assert_same_logits(config, state, dense, rtol=3e-2)


def test_prefixed_stack():
    config, state = tiny_llama(prefix="model.language_model")
    aligned, t = align_state(config, state)
    assert t.stack == "model.language_model.layers"
    assert changed(state, aligned)
    assert_same_logits(config, state, aligned, prefix="model.language_model")


def test_biases_move_with_their_rows():
    config, state = tiny_llama(arch="Qwen2ForCausalLM")
    rng = np.random.default_rng(5)
    for i in range(3):
        p = f"model.layers.{i}."
        for name, n in (("q", 32), ("k", 16), ("v", 16), ("o", 32)):
            state[p + f"self_attn.{name}_proj.bias"] = 0.3 * rng.standard_normal(n)
        for name, n in (("gate", 48), ("up", 48), ("down", 32)):
            state[p + f"mlp.{name}_proj.bias"] = 0.3 * rng.standard_normal(n)
    aligned, t = align_state(config, state)
    assert "model.layers.1.self_attn.v_proj.bias" in changed(state, aligned)
    assert "model.layers.1.self_attn.o_proj.bias" not in changed(state, aligned)
    assert_same_logits(config, state, aligned)
    restored = unalign_state(aligned, t)
    assert max(float(np.abs(restored[k] - state[k]).max()) for k in state) < 1e-13


def test_qk_norm_planes_with_uneven_weights_stay_unrotated():
    config, state = tiny_llama(arch="Qwen3ForCausalLM")
    rng = np.random.default_rng(3)
    for i in range(3):
        q_norm = 1 + 0.2 * rng.standard_normal(8)
        q_norm[4:] = q_norm[:4]  # every plane even in q_norm ...
        k_norm = q_norm.copy()
        k_norm[1] += 0.5  # ... except plane 1 in k_norm
        state[f"model.layers.{i}.self_attn.q_norm.weight"] = q_norm
        state[f"model.layers.{i}.self_attn.k_norm.weight"] = k_norm
    aligned, t = align_state(config, state)
    assert_same_logits(config, state, aligned)
    angles = np.stack([t.arrays[f"layers.{i}.attn.qk_angle"] for i in range(3)])
    assert np.all(angles[:, :, 1] == 0)
    assert np.count_nonzero(angles[:, :, [0, 2, 3]])
    assert any("q_norm/k_norm" in note for note in t.notes)


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 4),
    kv_heads=st.integers(1, 3),
    n_rep=st.integers(1, 3),
    half_dim=st.integers(1, 4),
    intermediate=st.integers(1, 12),
    seed=st.integers(0, 2**16),
    data=st.data(),
)
def test_property_function_preserved(layers, kv_heads, n_rep, half_dim, intermediate, seed, data):
    blocks = data.draw(st.integers(1, layers))
    rounds = data.draw(st.integers(1, 3))
    config, state = tiny_llama(
        layers=layers,
        hidden=12,
        heads=kv_heads * n_rep,
        kv_heads=kv_heads,
        head_dim=2 * half_dim,
        intermediate=intermediate,
        vocab=20,
        seed=seed,
    )
    aligned, t = align_state(config, state, blocks=blocks, rounds=rounds)
    ref = llama_logits(config, state, IDS[:7])
    got = llama_logits(config, aligned, IDS[:7])
    assert np.abs(got - ref).max() <= 1e-9 * max(1.0, float(np.abs(ref).max()))
    restored = unalign_state(aligned, t)
    assert max(float(np.abs(restored[k] - state[k]).max()) for k in state) < 1e-12


# -- refused inputs ------------------------------------------------------------------------------


def _one_line(exc: pytest.ExceptionInfo) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_refuses_unknown_architecture():
    config, state = tiny_llama(arch="GPT2LMHeadModel")
    config["model_type"] = "gpt2"
    with pytest.raises(AlignError, match="unknown architecture GPT2LMHeadModel") as exc:
        align_state(config, state)
    _one_line(exc)


def test_refuses_odd_head_dim():
    config, state = tiny_llama(heads=4, kv_heads=2, head_dim=3, hidden=12)
    with pytest.raises(AlignError, match="head_dim=3 is odd") as exc:
        align_state(config, state)
    _one_line(exc)


def test_refuses_shapes_that_contradict_the_config():
    config, state = tiny_llama()
    config["num_key_value_heads"] = 1
    with pytest.raises(AlignError, match=r"k_proj\.weight has shape \[16, 32\]") as exc:
        align_state(config, state)
    _one_line(exc)


def test_refuses_unknown_per_layer_tensor():
    config, state = tiny_llama()
    state["model.layers.1.self_attn.sinks"] = np.zeros(4)
    with pytest.raises(AlignError, match=r"model\.layers\.1\.self_attn\.sinks") as exc:
        align_state(config, state)
    _one_line(exc)


def test_refuses_partial_rotary_and_missing_families_and_bad_arguments():
    config, state = tiny_llama()
    with pytest.raises(AlignError, match="partial_rotary_factor"):
        align_state({**config, "partial_rotary_factor": 0.5}, state)
    no_v = {k: v for k, v in state.items() if "v_proj" not in k}
    with pytest.raises(AlignError, match="self_attn.v_proj is missing"):
        align_state(config, no_v)
    with pytest.raises(AlignError, match="rounds must be an int >= 1"):
        align_state(config, state, rounds=0)
    with pytest.raises(DecompositionError, match="blocks=4 is outside 1..3"):
        align_state(config, state, blocks=4)
    with pytest.raises(AlignError, match="no config.json"):
        align_state(None, state)  # type: ignore[arg-type]


def test_refuses_a_lone_file_without_config(tmp_path):
    config, state = tiny_llama(dtype=np.float32)
    src = write_model(tmp_path / "src", config, state) / "model.safetensors"
    with pytest.raises(AlignError, match="no config.json") as exc:
        align_checkpoint(src, tmp_path / "out")
    _one_line(exc)
    assert not (tmp_path / "out").exists()


def test_load_transforms_refuses_a_plain_directory(tmp_path):
    with pytest.raises(AlignError, match="not an aligned checkpoint"):
        load_align_transforms(tmp_path)


# -- the reference forward -----------------------------------------------------------------------


def test_reference_is_causal():
    config, state = tiny_llama()
    full = llama_logits(config, state, IDS)
    prefix = llama_logits(config, state, IDS[:5])
    np.testing.assert_allclose(full[:5], prefix, rtol=1e-12, atol=1e-12)


def test_reference_gqa_equals_mha_with_repeated_kv_heads():
    config, state = tiny_llama(heads=4, kv_heads=2)
    mha = dict(state)
    for i in range(3):
        for name in ("k", "v"):
            key = f"model.layers.{i}.self_attn.{name}_proj.weight"
            mha[key] = np.repeat(state[key].reshape(2, 8, 32), 2, axis=0).reshape(32, 32)
    np.testing.assert_allclose(
        llama_logits({**config, "num_key_value_heads": 4}, mha, IDS),
        llama_logits(config, state, IDS),
        rtol=1e-12,
        atol=1e-12,
    )


def test_reference_tied_embeddings_and_refusals():
    config, state = tiny_llama()
    tied = {k: v for k, v in state.items() if k != "lm_head.weight"}
    with pytest.raises(ReferenceConfigError, match="lm_head"):
        llama_logits(config, tied, IDS)
    tied["lm_head.weight"] = state["model.embed_tokens.weight"]
    expected = llama_logits(config, tied, IDS)
    del tied["lm_head.weight"]
    np.testing.assert_array_equal(
        llama_logits({**config, "tie_word_embeddings": True}, tied, IDS), expected
    )
    with pytest.raises(ReferenceConfigError, match="yarn"):
        llama_logits({**config, "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, state, IDS)
    with pytest.raises(ReferenceConfigError, match="gelu"):
        llama_logits({**config, "hidden_act": "gelu"}, state, IDS)


def test_reference_llama3_rope_scaling_changes_only_long_wavelengths():
    from attnquant_core.llama_reference import rope_inv_freq

    config = {"rope_theta": 500000.0}
    scaled = {
        **config,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    }
    base, got = rope_inv_freq(config, 128), rope_inv_freq(scaled, 128)
    assert got[0] == base[0]  # the fastest plane is untouched
    np.testing.assert_allclose(got[-1], base[-1] / 8)  # the slowest is divided by the factor
    assert np.all(got <= base)
