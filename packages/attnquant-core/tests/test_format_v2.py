"""Format version 2: every form in one checkpoint, and version 1 checkpoints still read."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

import attnquant_core as aq
from attnquant_core import (
    BandMismatchError,
    FamilyTheta,
    LayerTheta,
    LowRankFamily,
    SharedBasisFamily,
    ThetaCheckpoint,
    ThetaFormatError,
    ThetaModel,
    band_of_layers,
    reconstruct,
    save_theta,
)

DATA = Path(__file__).parent / "data"
L = 4


@pytest.fixture
def v1_dir(tmp_path):
    """A copy of the version-1 checkpoint written by attnquant-core before format version 2."""
    return Path(shutil.copytree(DATA / "theta_v1", tmp_path / "theta_v1"))


def test_v1_checkpoint_opens_validates_and_rebuilds_the_same_arrays(v1_dir):
    ckpt = ThetaCheckpoint.open(v1_dir)
    assert ckpt.format_version == 1
    assert ckpt.blocks == 2 and ckpt.rank == 2 and ckpt.num_layers == 3 and not ckpt.passthrough
    assert set(ckpt.forms.values()) == {"banded"}
    assert ckpt.ranks("mlp.up_proj") == [2, 2, 2]
    expected = np.load(DATA / "theta_v1_expected.npz")
    state = dict(ckpt.rebuilt_state())
    assert sorted(state) == sorted(expected.files) == ckpt.stock_keys()
    for key, array in state.items():
        assert array.dtype == expected[key].dtype and np.array_equal(array, expected[key]), key
    for name in ckpt.families:
        fam = ckpt.family(name)
        assert isinstance(fam, FamilyTheta) and fam.blocks == 2
        assert ckpt.family_theta(name).ranks == (2, 2, 2)
        for layer in range(3):
            want = expected[f"model.layers.{layer}.{name}.weight"]
            assert np.array_equal(ckpt.rebuild(name, layer), want)
    assert ckpt.load().blocks == 2
    assert ThetaCheckpoint.open(v1_dir, blocks=2).blocks == 2


def test_v1_checkpoint_keeps_its_band_checks(v1_dir):
    with pytest.raises(
        BandMismatchError,
        match=r"decomposed with blocks=2, asked to serve blocks=3: layers \[1, 2\]",
    ):
        ThetaCheckpoint.open(v1_dir, blocks=3)
    f = v1_dir / "model.safetensors"
    tensors = safetensors.numpy.load_file(f)
    del tensors["model.layers.1.mlp.down_proj.theta_U"]
    safetensors.numpy.save_file(tensors, f)
    with pytest.raises(BandMismatchError, match=r"mlp\.down_proj layer 1: .*theta_U \(missing"):
        ThetaCheckpoint.open(v1_dir)


def test_v1_manifest_cannot_name_other_forms(v1_dir):
    path = v1_dir / "attnquant.json"
    manifest = json.loads(path.read_text())
    manifest["families"]["mlp.up_proj"]["form"] = "lowrank"
    path.write_text(json.dumps(manifest))
    with pytest.raises(ThetaFormatError, match="form 'lowrank', which this version cannot read"):
        ThetaCheckpoint.open(v1_dir)


# -- a checkpoint holding every form --------------------------------------------------------------


def _mixed_model(dtype=np.float32) -> ThetaModel:
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.standard_normal(shape).astype(dtype)

    banded = FamilyTheta(
        name="self_attn.q_proj",
        shared=(r(8, 6), r(8, 6)),
        bands=tuple(band_of_layers(L, 2)),
        layers=tuple(LayerTheta(s=r(8), U=r(8, k), V=r(6, k)) for k in (2, 0, 3, 1)),
    )
    lowrank = LowRankFamily(
        name="self_attn.k_proj",
        U=tuple(r(4, k) for k in (1, 3, 0, 2)),
        V=tuple(r(6, k) for k in (1, 3, 0, 2)),
    )
    bands = band_of_layers(L, 2)
    side_in = SharedBasisFamily(
        name="mlp.up_proj",
        side="in",
        bases=(r(6, 3), r(6, 2)),
        bands=tuple(bands),
        coefs=tuple(r(10, (3, 2)[b]) for b in bands),
    )
    side_out = SharedBasisFamily(
        name="mlp.down_proj",
        side="out",
        bases=(r(6, 4),),
        bands=(0,) * L,
        coefs=tuple(r(10, 4) for _ in range(L)),
    )
    return ThetaModel(
        families={f.name: f for f in (banded, lowrank, side_in, side_out)},
        extra={"model.norm.weight": np.ones(6, dtype)},
    )


@pytest.fixture
def mixed_dir(tmp_path):
    save_theta(_mixed_model(), tmp_path / "mixed", config={"architectures": ["LlamaForCausalLM"]})
    return tmp_path / "mixed"


def test_manifest_names_the_form_bands_and_ranks_of_every_family(mixed_dir):
    manifest = json.loads((mixed_dir / "attnquant.json").read_text())
    assert manifest["format_version"] == 2 < aq.FORMAT_VERSION
    assert manifest["blocks"] == 2  # the G of the one banded family
    assert manifest["rank"] == 4 and not manifest["passthrough"]
    assert manifest["forms"] == ["banded", "lowrank", "shared_basis"]
    fams = manifest["families"]
    assert fams["self_attn.q_proj"]["ranks"] == [2, 0, 3, 1]
    assert (
        fams["self_attn.k_proj"]["form"] == "lowrank" and fams["self_attn.k_proj"]["bands"] is None
    )
    assert fams["mlp.up_proj"]["side"] == "in" and fams["mlp.up_proj"]["ranks"] == [3, 3, 2, 2]
    assert fams["mlp.down_proj"]["side"] == "out" and fams["mlp.down_proj"]["blocks"] == 1
    model = _mixed_model()
    for name, fam in model.families.items():
        assert fams[name]["stored_parameters"] == fam.stored_parameters()
        assert fams[name]["dense_parameters"] == fam.dense_parameters()
        assert fams[name]["stored_parameters"] == aq.io.stored_of(
            fams[name]["form"],
            fams[name]["shape"],
            fams[name]["ranks"],
            fams[name]["bands"],
            fams[name]["side"],
        )


def test_every_form_round_trips_bit_exact_and_rebuilt_state_is_the_identity(mixed_dir):
    model = _mixed_model()
    ckpt = ThetaCheckpoint.open(mixed_dir)
    assert ckpt.blocks == 2 and ckpt.rank == 4 and not ckpt.passthrough
    back = ckpt.load()
    assert back.forms == model.forms
    for name, fam in model.families.items():
        got = back.families[name]
        assert type(got) is type(fam) and got.ranks == fam.ranks
        for a, b in zip(fam.arrays(), got.arrays(), strict=True):
            assert a.dtype == b.dtype and np.array_equal(a, b)
    assert np.array_equal(back.extra["model.norm.weight"], np.ones(6, np.float32))
    state = dict(ckpt.rebuilt_state())
    assert sorted(state) == ckpt.stock_keys()
    for name, fam in model.families.items():
        for layer in range(L):
            want = fam.reconstruct(layer).astype(np.float32)
            assert np.array_equal(want, reconstruct(*fam.factors(layer)))
            assert np.array_equal(state[f"model.layers.{layer}.{name}.weight"], want)
            assert np.array_equal(ckpt.rebuild(name, layer), want)
            parts = ckpt.factors(name, layer)
            assert all(
                (a is None and b is None) or np.array_equal(a, b)
                for a, b in zip(parts, fam.factors(layer), strict=True)
            )


def test_family_reads_banded_only_and_family_theta_reads_every_form(mixed_dir):
    ckpt = ThetaCheckpoint.open(mixed_dir)
    assert isinstance(ckpt.family("self_attn.q_proj"), FamilyTheta)
    with pytest.raises(
        ThetaFormatError, match=r"self_attn\.k_proj is stored as 'lowrank'.*family_theta"
    ):
        ckpt.family("self_attn.k_proj")
    with pytest.raises(ThetaFormatError, match="is stored as 'shared_basis', not 'banded'"):
        ckpt.layer("mlp.up_proj", 0)
    assert isinstance(ckpt.family_theta("self_attn.k_proj"), LowRankFamily)
    assert isinstance(ckpt.family_theta("mlp.down_proj"), SharedBasisFamily)
    assert ckpt.basis("mlp.up_proj", 1).shape == (6, 2)
    with pytest.raises(ThetaFormatError, match="no family 'nope'"):
        ckpt.family_theta("nope")


def test_blocks_check_applies_to_banded_families_only(mixed_dir):
    assert ThetaCheckpoint.open(mixed_dir, blocks=2).blocks == 2
    with pytest.raises(
        BandMismatchError,
        match=r"decomposed with blocks=2, asked to serve blocks=4: layers \[1, 2, 3\]",
    ):
        ThetaCheckpoint.open(mixed_dir, blocks=4)


def test_no_banded_family_means_no_blocks(tmp_path):
    model = _mixed_model()
    families = {n: f for n, f in model.families.items() if f.form != "banded"}
    save_theta(ThetaModel(families=families), tmp_path / "t")
    ckpt = ThetaCheckpoint.open(tmp_path / "t", blocks="layers")  # nothing to check against
    assert ckpt.blocks is None and not ckpt.passthrough
    assert json.loads((tmp_path / "t" / "attnquant.json").read_text())["blocks"] is None


def test_save_refuses_mixed_dtypes_in_a_family(tmp_path):
    fam = LowRankFamily(name="f", U=(np.ones((2, 1), np.float32),), V=(np.ones((3, 1)),))
    with pytest.raises(ThetaFormatError, match="one dtype per family"):
        save_theta(ThetaModel(families={"mlp.up_proj": fam}), tmp_path / "t")
    assert not (tmp_path / "t").exists()


# -- bad input ------------------------------------------------------------------------------------


def _drop(directory: Path, key: str) -> None:
    f = directory / "model.safetensors"
    tensors = safetensors.numpy.load_file(f)
    del tensors[key]
    safetensors.numpy.save_file(tensors, f)


def _edit(directory: Path, edit) -> None:
    path = directory / "attnquant.json"
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def test_missing_basis_lists_the_layers_of_its_band(mixed_dir):
    _drop(mixed_dir, "attnquant.shared.mlp.up_proj.1.basis")
    with pytest.raises(
        ThetaFormatError,
        match=r"mlp\.up_proj layer 2: .*basis \(missing.*\| mlp\.up_proj layer 3",
    ) as e:
        ThetaCheckpoint.open(mixed_dir)
    assert not isinstance(e.value, BandMismatchError)  # not about ATTNQUANT_BLOCKS


def test_missing_lowrank_key_lists_the_layer(mixed_dir):
    _drop(mixed_dir, "model.layers.1.self_attn.k_proj.theta_V")
    with pytest.raises(ThetaFormatError, match=r"self_attn\.k_proj layer 1: .*theta_V \(missing"):
        ThetaCheckpoint.open(mixed_dir)


def test_ranks_that_disagree_with_the_tensors_list_the_layer(mixed_dir):
    _edit(mixed_dir, lambda m: m["families"]["self_attn.k_proj"].update(ranks=[2, 3, 0, 2]))
    with pytest.raises(
        ThetaFormatError, match=r"self_attn\.k_proj layer 0: .*theta_U \(float32\[4, 1\], expected"
    ):
        ThetaCheckpoint.open(mixed_dir)


def test_uneven_widths_inside_a_shared_band(mixed_dir):
    _edit(mixed_dir, lambda m: m["families"]["mlp.up_proj"].update(ranks=[3, 2, 2, 2]))
    with pytest.raises(ThetaFormatError, match=r"mlp\.up_proj: layers \[1\] record another rank"):
        ThetaCheckpoint.open(mixed_dir)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda m: m["families"]["mlp.up_proj"].update(form="sparse"), "form 'sparse'"),
        (lambda m: m["families"]["mlp.up_proj"].update(side="left"), "side 'left'"),
        (lambda m: m["families"]["mlp.up_proj"].pop("ranks"), "has no 'ranks'"),
        (lambda m: m["families"]["mlp.up_proj"].update(ranks=[1, 2]), r"ranks=\[1, 2\]"),
        (lambda m: m["families"]["mlp.up_proj"].update(bands=None), "has no 'bands'"),
        (lambda m: m.update(blocks="two"), "bad blocks"),
        (
            lambda m: m.update(format_version=aq.FORMAT_VERSION + 1),
            "newer attnquant.*upgrade attnquant-core",
        ),
    ],
)
def test_bad_manifests_are_refused(mixed_dir, edit, message):
    _edit(mixed_dir, edit)
    with pytest.raises(ThetaFormatError, match=message):
        ThetaCheckpoint.open(mixed_dir)


def test_top_level_blocks_is_checked_against_banded_families(mixed_dir):
    _edit(mixed_dir, lambda m: m.update(blocks=4))
    with pytest.raises(BandMismatchError, match=r"self_attn\.q_proj: layers \[1, 2, 3\]"):
        ThetaCheckpoint.open(mixed_dir)


def test_stray_theta_keys_are_refused(mixed_dir):
    f = mixed_dir / "model.safetensors"
    tensors = safetensors.numpy.load_file(f)
    tensors["attnquant.shared.mlp.gate_proj.0.basis"] = np.ones((2, 2), np.float32)
    safetensors.numpy.save_file(tensors, f)
    with pytest.raises(ThetaFormatError, match="does not describe: attnquant.shared.mlp.gate_proj"):
        ThetaCheckpoint.open(mixed_dir)


def test_decompose_writes_version_2_with_ranks_and_sizes(checkpoint, tmp_path):
    manifest = aq.decompose_checkpoint(checkpoint(3), tmp_path / "t", blocks=2, rank=2)
    fam = manifest["families"]["mlp.up_proj"]
    assert manifest["format_version"] == 2 and manifest["blocks"] == 2
    assert fam["form"] == "banded" and fam["ranks"] == [2, 2, 2] and fam["blocks"] == 2
    assert fam["stored_parameters"] == 2 * 40 * 24 + 3 * (40 + 2 * (40 + 24))
    assert fam["dense_parameters"] == 3 * 40 * 24
