"""The installed version of attnquant-core (recorded as the writer of every manifest)."""

from importlib.metadata import PackageNotFoundError, version

__all__ = ["__version__"]

try:
    __version__ = version("attnquant-core")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"
