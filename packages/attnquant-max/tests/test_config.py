"""Path selection from the serving options: what each path means on a device, and refusals."""

from __future__ import annotations

import pytest

from attnquant_max import ServingOptions, require_implemented, serving_path, use_gemm_formulation


@pytest.mark.parametrize("path", ["in-graph", "gemm", "custom-op", "precompute"])
def test_quantizing_at_load_refuses_an_in_graph_path_at_startup(path: str) -> None:
    with pytest.raises(NotImplementedError, match=f"--quant nvfp4.*not --path {path}") as info:
        require_implemented(ServingOptions(path=path, quant="nvfp4"))  # type: ignore[arg-type]
    assert "\n" not in str(info.value)
    require_implemented(ServingOptions(quant="nvfp4"))
    require_implemented(ServingOptions(path="precompute-outside", quant="nvfp4"))


@pytest.mark.parametrize(
    ("path", "api", "compressed", "expected"),
    [
        ("auto", "cpu", False, "precompute-outside"),
        ("auto", "cpu", True, "custom-op"),
        ("auto", "cuda", True, "gemm"),
        ("precompute-outside", "cpu", True, "precompute-outside"),
        ("in-graph", "cpu", False, "custom-op"),
        ("in-graph", "cuda", False, "gemm"),
        ("gemm", "metal", False, "gemm"),
        ("custom-op", "cuda", False, "custom-op"),
        ("precompute", "cpu", False, "precompute"),
    ],
)
def test_serving_path(path: str, api: str, compressed: bool, expected: str) -> None:
    options = ServingOptions(path=path)  # type: ignore[arg-type]
    assert serving_path(options, api, compressed=compressed) == expected


def test_serving_path_reads_the_accelerator_only_when_needed() -> None:
    assert serving_path(ServingOptions()) == "precompute-outside"
    assert serving_path(ServingOptions(path="in-graph")) in ("gemm", "custom-op")


@pytest.mark.parametrize(
    ("path", "api", "rank", "expected"),
    [
        # an explicit formulation wins everywhere
        ("gemm", "metal", 16, True),
        ("custom-op", "cuda", 16, False),
        ("custom-op", "cpu", 128, False),
        ("gemm", "cpu", 16, True),
        # in-graph: NVIDIA -> GEMM
        ("in-graph", "cuda", 16, True),
        ("in-graph", "cuda", 256, True),
        # in-graph: Apple Metal -> custom op up to r = 64, GEMM above
        ("in-graph", "metal", 16, False),
        ("in-graph", "metal", 64, False),
        ("in-graph", "metal", 65, True),
        # in-graph: CPU -> custom op up to r = 64 (benchmarks/bench_kernels.py), GEMM above
        ("in-graph", "cpu", 16, False),
        ("in-graph", "cpu", 64, False),
        ("in-graph", "cpu", 65, True),
        # in-graph: AMD -> GEMM; an unknown API -> GEMM
        ("in-graph", "hip", 16, True),
        ("in-graph", "tpu", 16, True),
    ],
)
def test_formulation_selection(path: str, api: str, rank: int, expected: bool) -> None:
    options = ServingOptions(path=path, rank=rank)  # type: ignore[arg-type]
    assert use_gemm_formulation(options, api) is expected
