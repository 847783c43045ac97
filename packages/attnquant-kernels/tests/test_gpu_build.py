"""The GPU variants compile for NVIDIA, AMD and Apple Metal targets on a machine without a GPU.

``mojo build --target-accelerator <arch> --emit asm`` of a harness that instantiates every GPU
kernel (float32 and bfloat16, both activations): it produces one device-code file per kernel
(PTX for NVIDIA, AMDGCN, LLVM IR for Metal) and never runs anything. Running them needs the
device (the ``gpu`` nox session of the repository).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from attnquant_kernels import kernels_path

pytestmark = pytest.mark.slow

HARNESS = Path(__file__).with_name("mojo") / "gpu_harness.mojo"


def _mojo() -> str:
    found = shutil.which("mojo", path=str(Path(sys.executable).parent)) or shutil.which("mojo")
    if found is None:  # pragma: no cover - the test group installs modular (and mojo)
        pytest.fail("the mojo compiler is not installed (modular==26.7.* brings it)")
    return found


@pytest.mark.parametrize(
    ("accelerator", "suffix"),
    [("sm_90", ".ptx"), ("gfx942", ".amdgcn"), ("apple-m1", ".ll")],
    ids=["nvidia-h100", "amd-mi300", "apple-m1"],
)
def test_gpu_kernels_compile_for(accelerator: str, suffix: str, tmp_path: Path):
    shutil.copytree(kernels_path(), tmp_path / "aqk")
    shutil.copy(HARNESS, tmp_path / "harness.mojo")
    out = tmp_path / "asm" / "harness.s"
    out.parent.mkdir()
    done = subprocess.run(
        [
            _mojo(),
            "build",
            "--target-accelerator",
            accelerator,
            "-I",
            str(tmp_path),
            "--emit",
            "asm",
            "-o",
            str(out),
            str(tmp_path / "harness.mojo"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    kernels = sorted(p.name for p in out.parent.iterdir() if p.suffix == suffix)
    # float32 and bfloat16; projections: x and the float32 intermediate of the MLP
    assert sum("_theta_kernel" in k for k in kernels) >= 6, kernels
    assert sum("_project_kernel" in k for k in kernels) >= 3, kernels
    assert sum("_nvfp4_kernel" in k for k in kernels) >= 2, kernels  # float32 and bfloat16
    assert sum("_lowrank_kernel" in k for k in kernels) >= 2, kernels
