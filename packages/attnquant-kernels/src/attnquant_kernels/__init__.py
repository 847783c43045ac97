"""attnquant-kernels: Mojo kernels for the theta identity, shipped as package data.

The kernels live in a Mojo package folder (``mojo/`` with an ``__init__.mojo``) that MAX compiles
when a graph names it in ``custom_extensions``. This module only locates them; it imports
neither numpy nor MAX.
"""

from importlib.metadata import PackageNotFoundError, version

from ._locate import KERNEL_OPS, kernels_path, mojo_sources

try:
    __version__ = version("attnquant-kernels")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    # locating the Mojo package
    "KERNEL_OPS",
    "kernels_path",
    "mojo_sources",
    "__version__",
]
