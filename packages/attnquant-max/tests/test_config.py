"""ATTNQUANT_* parsing, start-up refusal of unimplemented paths, and path selection."""

from __future__ import annotations

import dataclasses

import pytest

from attnquant_max import (
    ENV_VARIABLES,
    AttnquantConfig,
    ConfigError,
    require_implemented,
    serving_path,
    use_gemm_formulation,
)


def test_defaults_from_an_empty_environment() -> None:
    config = AttnquantConfig.from_env({})
    assert config == AttnquantConfig()
    assert config.blocks is None
    assert config.rank == 16
    assert config.precompute_outside is True
    assert config.precompute is False
    assert config.gemm is None
    assert config.qkv_fuse is True
    assert config.fused_mlp is True
    assert config.quant is None
    assert config.quant_head is False
    require_implemented(config)


def test_every_documented_variable_is_a_field() -> None:
    fields = {f"ATTNQUANT_{f.name.upper()}" for f in dataclasses.fields(AttnquantConfig)}
    assert set(ENV_VARIABLES) == fields


def test_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        AttnquantConfig().rank = 3  # type: ignore[misc]


@pytest.mark.parametrize(
    ("variable", "value", "field", "expected"),
    [
        ("ATTNQUANT_BLOCKS", "1", "blocks", 1),
        ("ATTNQUANT_BLOCKS", " 4 ", "blocks", 4),
        ("ATTNQUANT_BLOCKS", "layers", "blocks", "layers"),
        ("ATTNQUANT_BLOCKS", "LAYERS", "blocks", "layers"),
        ("ATTNQUANT_BLOCKS", "", "blocks", None),
        ("ATTNQUANT_RANK", "0", "rank", 0),
        ("ATTNQUANT_RANK", "64", "rank", 64),
        ("ATTNQUANT_PRECOMPUTE_OUTSIDE", "0", "precompute_outside", False),
        ("ATTNQUANT_PRECOMPUTE_OUTSIDE", "true", "precompute_outside", True),
        ("ATTNQUANT_PRECOMPUTE", "1", "precompute", True),
        ("ATTNQUANT_PRECOMPUTE", "no", "precompute", False),
        ("ATTNQUANT_GEMM", "1", "gemm", True),
        ("ATTNQUANT_GEMM", "0", "gemm", False),
        ("ATTNQUANT_GEMM", "off", "gemm", False),
        ("ATTNQUANT_GEMM", "", "gemm", None),
        ("ATTNQUANT_QKV_FUSE", "0", "qkv_fuse", False),
        ("ATTNQUANT_FUSED_MLP", "False", "fused_mlp", False),
        ("ATTNQUANT_QUANT", "nvfp4", "quant", "nvfp4"),
        ("ATTNQUANT_QUANT", "NVFP4", "quant", "nvfp4"),
        ("ATTNQUANT_NVFP4_KERNEL", "fused", "nvfp4_kernel", "fused"),
        ("ATTNQUANT_NVFP4_KERNEL", "Dequantize", "nvfp4_kernel", "dequantize"),
        ("ATTNQUANT_NVFP4_KERNEL", "", "nvfp4_kernel", "auto"),
        ("ATTNQUANT_QUANT_HEAD", "1", "quant_head", True),
        ("ATTNQUANT_QUANT_HEAD", "", "quant_head", False),
    ],
)
def test_each_variable_parses(variable: str, value: str, field: str, expected: object) -> None:
    config = AttnquantConfig.from_env({variable: value})
    assert getattr(config, field) == expected


@pytest.mark.parametrize(
    ("variable", "value", "allowed"),
    [
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
    ],
)
def test_bad_values_name_variable_value_and_what_is_allowed(
    variable: str, value: str, allowed: str
) -> None:
    with pytest.raises(ConfigError) as info:
        AttnquantConfig.from_env({variable: value})
    message = str(info.value)
    assert variable in message
    assert repr(value) in message
    assert allowed in message
    assert info.value.variable == variable
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    "kwargs", [{"blocks": 0}, {"blocks": "all"}, {"blocks": True}, {"rank": -1}, {"quant": "fp8"}]
)
def test_constructor_validates_too(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        AttnquantConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("env", "api", "variable"),
    [
        ({"ATTNQUANT_QUANT": "nvfp4", "ATTNQUANT_PRECOMPUTE": "1"}, "cpu", "ATTNQUANT_QUANT"),
        (
            {
                "ATTNQUANT_QUANT": "nvfp4",
                "ATTNQUANT_PRECOMPUTE_OUTSIDE": "0",
                "ATTNQUANT_GEMM": "1",
            },
            "cpu",
            "precompute-outside",
        ),
    ],
)
def test_unimplemented_paths_fail_at_startup(env: dict[str, str], api: str, variable: str) -> None:
    config = AttnquantConfig.from_env(env)
    with pytest.raises(NotImplementedError, match=variable) as info:
        require_implemented(config, api)
    assert "precompute-outside" in str(info.value).lower()


@pytest.mark.parametrize(
    ("env", "api", "path"),
    [
        ({}, "cuda", "precompute-outside"),
        ({"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0"}, "cpu", "custom-op"),
        ({"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0"}, "cuda", "gemm"),
        ({"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_GEMM": "1"}, "metal", "gemm"),
        ({"ATTNQUANT_PRECOMPUTE_OUTSIDE": "0", "ATTNQUANT_GEMM": "0"}, "cuda", "custom-op"),
        ({"ATTNQUANT_PRECOMPUTE": "1"}, "cpu", "precompute"),
        ({"ATTNQUANT_PRECOMPUTE": "1", "ATTNQUANT_PRECOMPUTE_OUTSIDE": "0"}, "cpu", "precompute"),
        ({"ATTNQUANT_QUANT": "nvfp4"}, "cpu", "precompute-outside"),
        ({"ATTNQUANT_QUANT": "nvfp4"}, "cuda", "precompute-outside"),
    ],
)
def test_serving_path(env: dict[str, str], api: str, path: str) -> None:
    config = AttnquantConfig.from_env(env)
    assert serving_path(config, api) == path
    require_implemented(config, api)


def test_serving_path_reads_the_accelerator_only_when_needed() -> None:
    assert serving_path(AttnquantConfig()) == "precompute-outside"
    assert serving_path(AttnquantConfig(precompute_outside=False)) in ("gemm", "custom-op")


@pytest.mark.parametrize(
    ("gemm", "api", "rank", "expected"),
    [
        # an explicit ATTNQUANT_GEMM wins everywhere
        (True, "metal", 16, True),
        (False, "cuda", 16, False),
        (False, "cpu", 128, False),
        (True, "cpu", 16, True),
        # auto: NVIDIA -> GEMM
        (None, "cuda", 16, True),
        (None, "cuda", 256, True),
        # auto: Apple Metal -> custom op up to r = 64, GEMM above
        (None, "metal", 16, False),
        (None, "metal", 64, False),
        (None, "metal", 65, True),
        # auto: CPU -> custom op up to r = 64 (benchmarks/bench_kernels.py), GEMM above
        (None, "cpu", 16, False),
        (None, "cpu", 64, False),
        (None, "cpu", 65, True),
        # auto: AMD -> GEMM; an unknown API -> GEMM
        (None, "hip", 16, True),
        (None, "tpu", 16, True),
    ],
)
def test_path_selection(gemm: bool | None, api: str, rank: int, expected: bool) -> None:
    assert use_gemm_formulation(AttnquantConfig(gemm=gemm, rank=rank), api) is expected
