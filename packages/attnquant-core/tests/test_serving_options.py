"""Serving options: flags over ATTNQUANT_* over defaults, the process boundary, path selection."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from attnquant_core.serving import (
    LEGACY_PATH_VARIABLES,
    OPTIONS,
    PATH_CHOICES,
    ConfigError,
    ServingOptions,
    options_table,
)


def test_defaults_from_an_empty_environment() -> None:
    options = ServingOptions.from_env({})
    assert options == ServingOptions()
    assert options.path == "auto"
    assert options.blocks is None
    assert options.rank == 16
    assert options.qkv_fuse is True
    assert options.fused_mlp is True
    assert options.quant is None
    assert options.quant_head is False
    assert options.quant_embedding is False
    assert options.nvfp4_kernel == "auto"
    assert options.worker_nice == 19


def test_every_option_is_a_field_with_a_flag_a_variable_and_a_table_row() -> None:
    assert [spec.field for spec in OPTIONS] == [f.name for f in dataclasses.fields(ServingOptions)]
    table = options_table()
    for spec in OPTIONS:
        assert spec.variable == f"ATTNQUANT_{spec.field.upper()}"
        assert spec.flag.startswith(f"--{spec.field.replace('_', '-')}")
        assert f"`{spec.flag}`" in table and f"`{spec.variable}`" in table
    for variable in LEGACY_PATH_VARIABLES:
        assert variable in table


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        ServingOptions().rank = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("variable", "value", "field", "expected"),
    [
        ("ATTNQUANT_PATH", "gemm", "path", "gemm"),
        ("ATTNQUANT_PATH", " Custom-Op ", "path", "custom-op"),
        ("ATTNQUANT_PATH", "", "path", "auto"),
        ("ATTNQUANT_BLOCKS", "1", "blocks", 1),
        ("ATTNQUANT_BLOCKS", " 4 ", "blocks", 4),
        ("ATTNQUANT_BLOCKS", "layers", "blocks", "layers"),
        ("ATTNQUANT_BLOCKS", "LAYERS", "blocks", "layers"),
        ("ATTNQUANT_BLOCKS", "", "blocks", None),
        ("ATTNQUANT_RANK", "0", "rank", 0),
        ("ATTNQUANT_RANK", "64", "rank", 64),
        ("ATTNQUANT_QKV_FUSE", "0", "qkv_fuse", False),
        ("ATTNQUANT_FUSED_MLP", "False", "fused_mlp", False),
        ("ATTNQUANT_QUANT", "nvfp4", "quant", "nvfp4"),
        ("ATTNQUANT_QUANT", "NVFP4", "quant", "nvfp4"),
        ("ATTNQUANT_NVFP4_KERNEL", "fused", "nvfp4_kernel", "fused"),
        ("ATTNQUANT_NVFP4_KERNEL", "Dequantize", "nvfp4_kernel", "dequantize"),
        ("ATTNQUANT_NVFP4_KERNEL", "", "nvfp4_kernel", "auto"),
        ("ATTNQUANT_QUANT_HEAD", "1", "quant_head", True),
        ("ATTNQUANT_QUANT_HEAD", "", "quant_head", False),
        ("ATTNQUANT_QUANT_EMBEDDING", "1", "quant_embedding", True),
        ("ATTNQUANT_WORKER_NICE", "0", "worker_nice", 0),
        ("ATTNQUANT_WORKER_NICE", " 19 ", "worker_nice", 19),
        ("ATTNQUANT_WORKER_NICE", "", "worker_nice", 19),
    ],
)
def test_each_variable_parses(variable: str, value: str, field: str, expected: object) -> None:
    assert getattr(ServingOptions.from_env({variable: value}), field) == expected


@pytest.mark.parametrize(
    ("env", "path"),
    [
        ({}, "auto"),
        ({"ATTNQUANT_PRECOMPUTE_OUTSIDE": "1"}, "precompute-outside"),
        ({"ATTNQUANT_PRECOMPUTE_OUTSIDE": "true", "ATTNQUANT_GEMM": "1"}, "precompute-outside"),
        ({"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0"}, "in-graph"),
        ({"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_GEMM": "1"}, "gemm"),
        ({"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_GEMM": "off"}, "custom-op"),
        ({"ATTNQUANT_GEMM": "1"}, "gemm"),
        ({"ATTNQUANT_PRECOMPUTE": "1"}, "precompute"),
        ({"ATTNQUANT_PRECOMPUTE": "1", "ATTNQUANT_PRECOMPUTE_OUTSIDE": "0"}, "precompute"),
        ({"ATTNQUANT_PRECOMPUTE": "no"}, "auto"),
    ],
)
def test_the_older_path_variables_still_choose_the_path(env: dict[str, str], path: str) -> None:
    assert ServingOptions.from_env(env).path == path


@pytest.mark.parametrize(
    ("variable", "value", "allowed"),
    [
        ("ATTNQUANT_PATH", "stock", "auto, precompute-outside"),
        ("ATTNQUANT_BLOCKS", "0", "'layers'"),
        ("ATTNQUANT_BLOCKS", "-2", "'layers'"),
        ("ATTNQUANT_BLOCKS", "two", "'layers'"),
        ("ATTNQUANT_BLOCKS", "1.5", "'layers'"),
        ("ATTNQUANT_RANK", "-1", ">= 0"),
        ("ATTNQUANT_RANK", "sixteen", ">= 0"),
        ("ATTNQUANT_RANK", "8.0", ">= 0"),
        ("ATTNQUANT_PRECOMPUTE_OUTSIDE", "2", "1/0"),
        ("ATTNQUANT_PRECOMPUTE", "maybe", "1/0"),
        ("ATTNQUANT_GEMM", "maybe", "1/0"),
        ("ATTNQUANT_QKV_FUSE", "y", "1/0"),
        ("ATTNQUANT_FUSED_MLP", "enabled", "1/0"),
        ("ATTNQUANT_QUANT", "int4", "'nvfp4'"),
        ("ATTNQUANT_NVFP4_KERNEL", "mojo", "auto, fused, dequantize"),
        ("ATTNQUANT_QUANT_HEAD", "nvfp4", "1/0"),
        ("ATTNQUANT_WORKER_NICE", "20", "from 0 to 19"),
        ("ATTNQUANT_WORKER_NICE", "-5", "from 0 to 19"),
        ("ATTNQUANT_WORKER_NICE", "low", "from 0 to 19"),
    ],
)
def test_bad_values_name_variable_value_and_what_is_allowed(
    variable: str, value: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as info:
        ServingOptions.from_env({variable: value})
    message = str(info.value)
    assert variable in message and repr(value) in message and allowed in message
    assert info.value.variable == variable
    assert isinstance(info.value, ValueError)


def test_a_path_and_an_older_path_variable_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="ATTNQUANT_GEMM.*unset when ATTNQUANT_PATH is set"):
        ServingOptions.from_env({"ATTNQUANT_PATH": "gemm", "ATTNQUANT_GEMM": "1"})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"blocks": 0},
        {"blocks": "all"},
        {"blocks": True},
        {"rank": -1},
        {"quant": "fp8"},
        {"path": "stock"},
        {"nvfp4_kernel": "mojo"},
        {"qkv_fuse": 1},
        {"worker_nice": 20},
        {"worker_nice": -1},
        {"worker_nice": True},
        {"worker_nice": "5"},
    ],
)
def test_constructor_validates_naming_the_flag(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="^--"):
        ServingOptions(**kwargs)  # type: ignore[arg-type]


options_strategy = st.builds(
    ServingOptions,
    path=st.sampled_from(PATH_CHOICES),
    blocks=st.one_of(st.none(), st.just("layers"), st.integers(1, 1 << 20)),
    rank=st.integers(0, 1 << 20),
    quant=st.sampled_from([None, "nvfp4"]),
    quant_head=st.booleans(),
    quant_embedding=st.booleans(),
    nvfp4_kernel=st.sampled_from(["auto", "fused", "dequantize"]),
    qkv_fuse=st.booleans(),
    fused_mlp=st.booleans(),
    worker_nice=st.integers(0, 19),
)


@given(
    options=options_strategy,
    stale=st.dictionaries(st.sampled_from(LEGACY_PATH_VARIABLES), st.sampled_from(["0", "1"])),
)
def test_the_process_boundary_hands_the_options_over_exactly(
    options: ServingOptions, stale: dict[str, str]
) -> None:
    """What ``attnquant serve`` writes for its ``max serve`` child reads back as the same value,
    whatever older path variables the parent's environment held."""
    env = options.to_env({"PATH": "/bin", **stale})
    assert ServingOptions.from_env(env) == options
    assert env["PATH"] == "/bin"
    assert not set(LEGACY_PATH_VARIABLES) & set(env)


def test_a_flag_wins_over_a_variable_which_wins_over_the_default() -> None:
    env = {"ATTNQUANT_RANK": "4", "ATTNQUANT_PRECOMPUTE_OUTSIDE": "0"}
    options = ServingOptions.from_sources({"rank": 8, "quant": None}, env)
    assert (options.rank, options.path, options.quant) == (8, "in-graph", None)
    assert ServingOptions.from_sources({}, {}) == ServingOptions()
    with pytest.raises(TypeError, match="unknown serving options"):
        ServingOptions.from_sources({"gemm": True}, {})
