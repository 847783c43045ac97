"""attnquant-cli: the ``attnquant`` command (decompose, serve, generate, verify).

``cli(args)`` runs the command line and returns its exit code, for tests and for embedding.
"""

from importlib.metadata import PackageNotFoundError, version

from ._app import app, cli, main
from ._demo import demo_model_path

try:
    __version__ = version("attnquant-cli")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    # the command line
    "app",
    "cli",
    "main",
    # the embedded demo model
    "demo_model_path",
    "__version__",
]
