"""The locator finds the installed Mojo package."""

from __future__ import annotations

import attnquant_kernels as ak


def test_kernels_path_is_a_mojo_package():
    path = ak.kernels_path()
    assert path.is_dir()
    assert (path / "__init__.mojo").is_file()
    assert path / "__init__.mojo" in ak.mojo_sources()


def test_version_comes_from_metadata():
    assert ak.__version__ == "0.1.0"
