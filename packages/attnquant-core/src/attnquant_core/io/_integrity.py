"""Integrity of a checkpoint on disk: every tensor's bytes against the digest recorded at write."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .._errors import CheckpointError, IntegrityError
from ._checkpoint import read_tensor_directory
from ._safetensors import DIGESTS_FILE, verify_by_default

__all__ = ["DIGESTS_FILE", "IntegrityReport", "check_checkpoint", "require_intact"]


@dataclass(frozen=True, kw_only=True)
class IntegrityReport:
    """What :func:`check_checkpoint` found: ``bad`` maps each failing key to a one-line reason."""

    path: Path
    recorded: bool
    checked: int
    nbytes: int
    bad: dict[str, str] = field(default_factory=dict)
    unstored: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """True when digests are recorded and every tensor matches (nothing missing)."""
        return self.recorded and not self.bad and not self.unstored


def check_checkpoint(path: str | Path) -> IntegrityReport:
    """Verify every tensor of a checkpoint directory against :data:`DIGESTS_FILE`.

    Reads each tensor once, streamed (a few MiB resident). A checkpoint without the file
    (written before attnquant 0.3, or by another tool) gives ``recorded=False`` and checks
    nothing; headers are still validated, since opening the directory does that.
    """
    path = Path(path)
    files, _ = read_tensor_directory(path)
    if files.digests is None:
        return IntegrityReport(path=path, recorded=False, checked=0, nbytes=0)
    bad: dict[str, str] = {}
    nbytes = 0
    for key in files.keys():
        try:
            files.check(key)
        except (IntegrityError, CheckpointError) as exc:
            bad[key] = str(exc)
        nbytes += files.spec(key).nbytes
    unstored = tuple(sorted(set(files.digests) - set(files.keys())))
    return IntegrityReport(
        path=path,
        recorded=True,
        checked=len(files.keys()),
        nbytes=nbytes,
        bad=bad,
        unstored=unstored,
    )


def require_intact(path: str | Path) -> IntegrityReport | None:
    """:func:`check_checkpoint`, raising :class:`IntegrityError` with the first failing tensor.

    Returns ``None`` without reading anything when ``ATTNQUANT_VERIFY_DIGESTS=0``.
    """
    if not verify_by_default():
        return None
    report = check_checkpoint(path)
    if report.bad:
        reason = next(iter(report.bad.values()))
        more = len(report.bad) - 1
        raise IntegrityError(reason + (f" (and {more} more tensors)" if more else ""))
    if report.unstored:
        raise IntegrityError(
            f"{path}: {report.unstored[0]!r} has a recorded digest in {DIGESTS_FILE} but is "
            f"not stored ({len(report.unstored)} such tensors)"
        )
    return report
