"""The locator, the op names, the rank limit: no MAX, no numpy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import attnquant_kernels as ak


def test_kernels_path_is_a_mojo_package():
    path = ak.kernels_path()
    assert path.is_dir()
    assert (path / "__init__.mojo").is_file()
    assert path / "__init__.mojo" in ak.mojo_sources()


def test_every_op_has_its_source_and_registration():
    names = {p.name for p in ak.mojo_sources()}
    assert ak.KERNEL_OPS == (
        "generated_linear",
        "generated_mlp",
        "generated_linear_nvfp4",
        "nvfp4_dequantize",
        "generated_lowrank",
        "generated_linear_nvfp4_tiled",
        "generated_linear_nvfp4_tiled_a8",
    )
    for op in ak.KERNEL_OPS:
        assert f"{op}.mojo" in names
        source = (ak.kernels_path() / f"{op}.mojo").read_text()
        assert f'@compiler.register("{op}")' in source


def test_mojo_and_python_agree_on_the_rank_limit():
    common = (ak.kernels_path() / "_common.mojo").read_text()
    assert f"comptime MAX_RANK = {ak.MAX_RANK}" in common
    assert ak.MAX_RANK == 64


def test_version_comes_from_metadata():
    import tomllib

    pyproject = Path(__file__).parents[1] / "pyproject.toml"
    assert ak.__version__ == tomllib.loads(pyproject.read_text())["project"]["version"]


def test_import_needs_neither_numpy_nor_max():
    code = (
        "import sys, attnquant_kernels; "
        "bad = [m for m in ('numpy', 'max') if m in sys.modules]; "
        "sys.exit(f'imported {bad}' if bad else 0)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("rank", [0, 1, 16, 63, 64])
def test_check_rank_accepts_up_to_64(rank: int):
    assert ak.check_rank(rank) == rank


def test_rank_65_is_refused_naming_the_gemm_path():
    with pytest.raises(ak.RankError, match=r"ATTNQUANT_GEMM=1") as info:
        ak.check_rank(65, op="generated_mlp", what="down")
    message = str(info.value)
    assert "generated_mlp" in message and "down rank r=65" in message and "64" in message
    assert isinstance(info.value, ValueError)
    assert info.value.rank == 65


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_check_rank_rejects_non_ranks(bad: object):
    with pytest.raises(ValueError, match="whole number"):
        ak.check_rank(bad)  # type: ignore[arg-type]
