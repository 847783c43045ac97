"""DecomposeSpec: decompose's options, their defaults in one place, each refused in one line."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnquant_core import DecomposeSpec, DecompositionError, decompose_checkpoint
from attnquant_core.calib import DEFAULT_SAMPLES as CALIB_SAMPLES
from attnquant_core.calib import DEFAULT_SEQ_LEN as CALIB_SEQ_LEN
from attnquant_core.fit import (
    DEFAULT_BLOCKS,
    DEFAULT_FORMS,
    DEFAULT_QUANT_BLOCKS,
    DEFAULT_RANK,
    DEFAULT_ROUNDING,
    DEFAULT_SAMPLES,
    DEFAULT_SEQ_LEN,
    DEFAULT_SEQUENTIAL,
    decompose_budget,
    parse_budget,
)
from attnquant_core.testing import make_weights, write_checkpoint


def test_defaults() -> None:
    spec = DecomposeSpec()
    assert (spec.blocks, spec.rank, spec.budget, spec.quant, spec.calibration) == (None,) * 5
    assert spec.effective_blocks == DEFAULT_BLOCKS == 1
    assert spec.effective_rank == DEFAULT_RANK == 16
    assert spec.effective_samples == DEFAULT_SAMPLES == CALIB_SAMPLES == 128
    assert spec.effective_seq_len == DEFAULT_SEQ_LEN == CALIB_SEQ_LEN == 512
    assert spec.effective_sequential is DEFAULT_SEQUENTIAL is True
    assert spec.rounding == DEFAULT_ROUNDING == "gptq"
    assert spec.forms == DEFAULT_FORMS and spec.calibration_data == () and not spec.align
    # a 4-bit band mean is a poor W0: with quant, no blocks is passthrough
    assert DecomposeSpec(quant="nvfp4").effective_blocks == DEFAULT_QUANT_BLOCKS == "layers"
    assert DecomposeSpec(quant="nvfp4", blocks=2).effective_blocks == 2


def test_values_are_normalised_and_the_spec_is_frozen() -> None:
    spec = DecomposeSpec(blocks=" Layers ", forms=["banded", "banded"], calibration_data=["t"])
    assert spec.blocks == "layers" and spec.forms == ("banded",)
    assert spec.calibration_data == (Path("t"),)
    assert DecomposeSpec(blocks="3").blocks == 3
    assert DecomposeSpec(budget="0.25", spelling="cli").budget == 0.25
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.rank = 3  # type: ignore[misc]
    assert DecomposeSpec(rank=2) == DecomposeSpec(rank=2, spelling="cli")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"blocks": "two"}, "blocks='two' is not an integer or 'layers'"),
        ({"blocks": 0}, "blocks=0 is below 1"),
        ({"blocks": 1.5}, "blocks must be an int or 'layers'"),
        ({"blocks": True}, "blocks must be an int or 'layers'"),
        ({"rank": -1}, "rank must be a non-negative int, got -1"),
        ({"rank": "3"}, "rank must be a non-negative int"),
        ({"budget": 0}, r"budget=0 is outside \(0, 1\]"),
        ({"budget": 1.5}, r"budget=1\.5 is outside \(0, 1\]"),
        ({"budget": "0.5"}, r"budget must be a number in \(0, 1\]"),
        ({"budget": 0.5, "rank": 2}, "pass either budget= or blocks=/rank=, not both"),
        ({"forms": ["svd"]}, "forms \\['svd'\\]: choose one or more of"),
        ({"forms": []}, "choose one or more of"),
        ({"quant": "int4"}, "quant='int4' is not a W0 quantization; choose one of nvfp4"),
        ({"rounding": "up"}, "rounding='up' is not a W0 rounding; choose one of gptq, nearest"),
        ({"quant": "nvfp4", "calibration_data": ["t"]}, "quant= with calibration_data="),
        ({"calibration": "s", "calibration_data": ["t"]}, "give one"),
        ({"sequential": True}, "sequential=True needs calibration_data="),
        ({"samples": 4}, "samples=/seq_len= apply to calibration_data= only"),
        ({"seq_len": 64}, "samples=/seq_len= apply to calibration_data= only"),
        ({"samples": 0, "calibration_data": ["t"]}, "samples must be an int >= 1, got 0"),
        ({"seq_len": 1, "calibration_data": ["t"]}, "seq_len must be an int >= 2, got 1"),
        ({"calibration_data": ["t"], "align": True}, "calibration_data= with align=True"),
        ({"calibration": "s", "align": True}, "calibration= with align=True"),
        ({"spelling": "shell"}, "spelling='shell'"),
    ],
)
def test_each_invalid_value_is_refused_in_one_line(kwargs: dict, message: str) -> None:
    with pytest.raises(DecompositionError, match=message) as info:
        DecomposeSpec(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quant": "int4"}, "--quant 'int4': choose one of nvfp4"),
        ({"rounding": "up"}, "--rounding 'up': choose one of gptq, nearest"),
        ({"budget": "half"}, "--budget 'half' is not a number"),
        ({"budget": "0"}, r"--budget 0: must be in \(0, 1\]"),
        ({"budget": "0.5", "blocks": "2"}, "give either --budget or --blocks/--rank, not both"),
        ({"sequential": True}, "--sequential needs --calibration-data PATH"),
        ({"samples": 4}, "--samples/--seq-len apply to --calibration-data only"),
        ({"calibration": "s", "align": True}, "--calibration with --align"),
    ],
)
def test_the_command_line_spelling_names_the_options(kwargs: dict, message: str) -> None:
    with pytest.raises(DecompositionError, match=message):
        DecomposeSpec(**kwargs, spelling="cli")


@given(st.floats(allow_nan=True, allow_infinity=True))
def test_a_budget_is_kept_exactly_when_in_the_unit_interval_else_refused(value: float) -> None:
    if math.isfinite(value) and 0.0 < value <= 1.0:
        assert DecomposeSpec(budget=value).budget == value
        assert parse_budget(repr(value)) == value
    else:
        with pytest.raises(DecompositionError, match="outside"):
            DecomposeSpec(budget=value)
        with pytest.raises(DecompositionError, match="must be in"):
            parse_budget(repr(value))


@given(st.integers(-50, 50), st.integers(-50, 50))
def test_blocks_and_rank_accepted_exactly_when_in_range(blocks: int, rank: int) -> None:
    if blocks >= 1 and rank >= 0:
        spec = DecomposeSpec(blocks=blocks, rank=rank)
        assert (spec.effective_blocks, spec.effective_rank) == (blocks, rank)
        assert DecomposeSpec(blocks=str(blocks)).blocks == blocks
    else:
        with pytest.raises(DecompositionError):
            DecomposeSpec(blocks=blocks, rank=rank)


def test_core_functions_take_a_spec_or_their_keywords(tmp_path: Path) -> None:
    src = write_checkpoint(tmp_path / "src", make_weights(3))
    by_spec = decompose_checkpoint(src, tmp_path / "a", spec=DecomposeSpec(blocks=2, rank=2))
    by_keywords = decompose_checkpoint(src, tmp_path / "b", blocks=2, rank=2)
    assert by_spec["families"] == by_keywords["families"]
    with pytest.raises(DecompositionError, match="pass spec= or rank=, not both"):
        decompose_checkpoint(src, tmp_path / "c", rank=3, spec=DecomposeSpec(blocks=2))
    with pytest.raises(DecompositionError, match=r"budget must be a number in \(0, 1\], got None"):
        decompose_budget(src, tmp_path / "d", spec=DecomposeSpec())
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()
