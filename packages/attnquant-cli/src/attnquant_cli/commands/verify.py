"""``attnquant verify``: logit parity of a checkpoint against its base; exit 1 if not equivalent."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from attnquant_core.serving import ServingOptions

from .._extra import require_max
from .._prompts import VERIFY_PROMPTS
from ._serving import serving_flags
from ._shared import Devices, MaxBatch, MaxLength, model_path, out

__all__ = ["verify"]


@serving_flags
def verify(
    base: Annotated[Path, typer.Argument(help="The base (dense) checkpoint, or 'demo'.")],
    theta: Annotated[Path, typer.Argument(help="The checkpoint to check: theta or dense.")],
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Greedy tokens per prompt.")] = 32,
    prompts: Annotated[
        Path | None, typer.Option(help="A file with one prompt per line (default: built-in set).")
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Also write the report as JSON here.")
    ] = None,
    devices: Devices = "cpu",
    max_length: MaxLength = 512,
    max_batch_size: MaxBatch = 8,
    options: ServingOptions = ServingOptions(),
) -> int:
    """Logit parity of THETA against BASE; exit 1 when not native-equivalent.

    BASE is served on the stock graph; THETA as the serving options say.
    """
    require_max("verify")
    from attnquant_core import require_intact
    from attnquant_max import AGREEMENT_THRESHOLD, DELTA_THRESHOLD, NEAR_TIE, logit_parity

    base, theta = model_path(str(base)), model_path(str(theta))
    for checkpoint in {base, theta}:  # MAX reads a dense base itself: check it here
        require_intact(checkpoint)
    texts = list(VERIFY_PROMPTS)
    if prompts is not None:
        texts = [line for line in prompts.read_text().splitlines() if line.strip()]
        if not texts:
            raise typer.BadParameter(f"{prompts}: no prompts in the file")
    report = logit_parity(
        base,
        theta,
        texts,
        max_new_tokens,
        max_length=max_length,
        max_batch_size=max_batch_size,
        devices=devices,
        options=options,
    )
    verdict = "native-equivalent" if report.native_equivalent else "NOT native-equivalent"
    table = Table(title=f"verify {theta} against {base}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("bound", justify="right")
    table.add_row(
        "max |logprob delta|", f"{report.max_abs_logprob_delta:.3g}", f"< {DELTA_THRESHOLD}"
    )
    table.add_row("greedy agreement", f"{report.agreement:.1%}", f">= {AGREEMENT_THRESHOLD:.0%}")
    if report.decode_max_abs_logprob_delta is not None and report.decode_agreement is not None:
        # The theta model scored again token by token, as serve decodes (single-row steps).
        table.add_row(
            "max |logprob delta|, decode steps",
            f"{report.decode_max_abs_logprob_delta:.3g}",
            f"< {DELTA_THRESHOLD}",
        )
        table.add_row(
            "greedy agreement, decode steps",
            f"{report.decode_agreement:.1%}",
            f">= {AGREEMENT_THRESHOLD:.0%}",
        )
    if report.miss_margins:
        # How close the base's own choice was where the theta model chose otherwise.
        table.add_row(
            "base top-2 margin at the misses",
            f"{report.miss_margins[0]:.3g} to {report.miss_margins[-1]:.3g} nats",
            f"{sum(m < NEAR_TIE for m in report.miss_margins)} of "
            f"{len(report.miss_margins)} < {NEAR_TIE}",
        )
    if report.near_ties is not None:
        table.add_row(
            f"base near-ties (margin < {NEAR_TIE})",
            f"{report.near_ties} of {report.num_tokens}",
            "",
        )
    table.add_row(
        "prompts x tokens",
        f"{report.num_prompts} x {report.num_tokens // max(report.num_prompts, 1)}",
        "",
    )
    if report.base_weight_bytes and report.theta_weight_bytes:
        table.add_row(
            "weights held (theta / base)",
            f"{report.theta_weight_bytes / 2**20:.2f} / {report.base_weight_bytes / 2**20:.2f} MiB",
            f"{report.theta_weight_bytes / report.base_weight_bytes:.3f}x",
        )
    out.print_table(table)
    out.print(f"verdict: {verdict}")
    if output is not None:
        import dataclasses
        import json

        from .._analyze import write_atomic

        payload = {"base": str(base), "theta": str(theta), **dataclasses.asdict(report)}
        write_atomic(output, lambda p: p.write_text(json.dumps(payload, indent=2) + "\n"))
    return 0 if report.native_equivalent else 1
