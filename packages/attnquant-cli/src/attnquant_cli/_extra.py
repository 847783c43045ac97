"""The ``serve`` extra: attnquant-max (and MAX with it) is optional for the ``attnquant`` command.

``pip install attnquant-cli`` runs decompose, calibrate, analyze, export, check and
``eval --forward numpy`` in numpy (attnquant-core); serve, generate, verify, bench and
``eval --forward max`` need attnquant-max, which ``pip install 'attnquant-cli[serve]'`` brings.
A command that needs it and finds it missing says so in one line (exit 2).
"""

from __future__ import annotations

from attnquant_core import AttnquantError

__all__ = ["SERVE_EXTRA", "ServeExtraError", "require_max"]

#: How to install what serving needs.
SERVE_EXTRA = "pip install 'attnquant-cli[serve]'"
#: The modules whose absence means the extra is not installed (MAX is attnquant-max's own
#: dependency, so an attnquant-max without it is a partial install of the extra too).
_EXTRA_MODULES = ("attnquant_max", "max")


class ServeExtraError(AttnquantError, ImportError):
    """A command that serves through MAX, run where attnquant-max is not installed."""


def require_max(command: str) -> None:
    """Import attnquant-max, or refuse ``command`` in one line naming the extra to install.

    Raises
    ------
    ServeExtraError
        attnquant-max (or MAX, which it depends on) is not installed.
    """
    try:
        import attnquant_max  # noqa: F401
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] not in _EXTRA_MODULES:
            raise
        raise ServeExtraError(f"attnquant {command} needs attnquant-max: {SERVE_EXTRA}") from None
