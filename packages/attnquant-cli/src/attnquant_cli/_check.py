"""``attnquant check``: every tensor of a checkpoint against the digest recorded when written."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnquant_core import DIGESTS_FILE, check_checkpoint

from ._console import Output
from ._demo import demo_model_path

__all__ = ["check"]

console = Output(stderr=True)
out = Output()


def check(
    ckpt: Annotated[str, typer.Argument(help="Checkpoint directory (theta, dense or exported).")],
) -> int:
    """Verify every tensor of CKPT against its recorded digest; name each one that differs.

    Exit 0 when all match, 1 when any differs or is missing; a checkpoint that records no
    digests (written before attnquant 0.3 or by another tool) is reported and exits 0.
    """
    path = demo_model_path() if ckpt == "demo" else Path(ckpt)
    report = check_checkpoint(path)
    if not report.recorded:
        out.print(
            f"{path}: no {DIGESTS_FILE} (written before attnquant 0.3 or by another tool): "
            f"headers valid, tensor bytes not verifiable",
            highlight=False,
            soft_wrap=True,
        )
        return 0
    for reason in report.bad.values():
        out.print(f"BAD {reason}", highlight=False, markup=False, soft_wrap=True)
    for key in report.unstored:
        out.print(
            f"BAD {path}: {key!r} has a recorded digest but is not stored",
            highlight=False,
            markup=False,
            soft_wrap=True,
        )
    problems = len(report.bad) + len(report.unstored)
    verdict = "ok" if report.ok else f"{problems} tensor(s) differ from their digests"
    out.print(
        f"{path}: {report.checked} tensors, {report.nbytes / 2**20:.1f} MiB checked: {verdict}",
        highlight=False,
        soft_wrap=True,
    )
    return 0 if report.ok else 1
