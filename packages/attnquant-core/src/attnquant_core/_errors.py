"""Exception hierarchy: each class subclasses the nearest builtin so callers can catch either."""

from __future__ import annotations

__all__ = [
    "AttnquantError",
    "BandMismatchError",
    "CheckpointError",
    "DecompositionError",
    "IntegrityError",
    "OutputBusyError",
    "OutputError",
    "ThetaFormatError",
]


class AttnquantError(Exception):
    """Base class of every error attnquant raises on purpose."""


class CheckpointError(AttnquantError, ValueError):
    """A checkpoint on disk is missing, truncated, inconsistent or not understood."""


class IntegrityError(CheckpointError):
    """A tensor's bytes do not match the digest recorded when it was written."""


class ThetaFormatError(CheckpointError):
    """A theta checkpoint breaks the format contract (docs/checkpoint-format.md)."""


class BandMismatchError(ThetaFormatError):
    """Theta keys do not match a shape- and band-compatible shared block ``W0``."""


class DecompositionError(AttnquantError, ValueError):
    """The arguments of a decomposition cannot be satisfied (rank, blocks, weights)."""


class OutputError(AttnquantError, OSError):
    """An output could not be written (disk full, read-only, ...); nothing was left behind."""


class OutputBusyError(OutputError):
    """Another run is writing the same output directory right now."""
