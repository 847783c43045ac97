"""Where the Mojo sources are, and the custom-op names they register."""

from __future__ import annotations

from pathlib import Path

__all__ = ["KERNEL_OPS", "kernels_path", "mojo_sources"]

#: Custom-op names registered by the Mojo package (``@compiler.register(name)``), once written.
KERNEL_OPS: tuple[str, ...] = ()


def kernels_path() -> Path:
    """The Mojo package folder to pass as ``custom_extensions=[kernels_path()]``."""
    path = Path(__file__).with_name("mojo")
    if not (path / "__init__.mojo").is_file():
        raise FileNotFoundError(
            f"{path}: the Mojo kernel package is incomplete (no __init__.mojo); "
            f"reinstall attnquant-kernels"
        )
    return path


def mojo_sources() -> list[Path]:
    """Every ``.mojo`` file of the package, sorted."""
    return sorted(kernels_path().glob("*.mojo"))
