"""``attnquant generate``: one greedy completion of a prompt, through MAX."""

from __future__ import annotations

import contextlib
import time
from typing import Annotated

import typer

from attnquant_core.serving import ServingOptions

from .._extra import require_max
from ._serving import serving_flags
from ._shared import Devices, MaxBatch, MaxLength, ModelArg, console, model_path, out

__all__ = ["generate"]


@serving_flags
def generate(
    model: ModelArg = None,
    prompt: Annotated[str, typer.Option("--prompt", "-p", help="Text to complete.")] = "def ",
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Tokens to generate.")] = 64,
    devices: Devices = "cpu",
    max_length: MaxLength = 512,
    max_batch_size: MaxBatch = 8,
    verbose: Annotated[
        bool, typer.Option("--verbose", "-v", help="Print all of MAX's log lines.")
    ] = False,
    options: ServingOptions = ServingOptions(),
) -> int:
    """Complete PROMPT greedily with MODEL (raw completion, no chat template)."""
    started = time.monotonic()
    require_max("generate")
    from attnquant_core import require_intact
    from attnquant_max import greedy_generate, load_pipeline, plan_serving
    from attnquant_max._startup import StartupReport, progress_ticks, quiet_max_logging

    path = model_path(model)
    require_intact(path)  # every tensor against its digest (ATTNQUANT_VERIFY_DIGESTS=0: skip)
    plan = plan_serving(path, options).describe()
    console.print(plan, highlight=False, markup=False, soft_wrap=True)
    report = StartupReport(
        lambda line: console.print(line, highlight=False, markup=False, soft_wrap=True),
        shown=[plan],
        started=started,
    )
    with contextlib.ExitStack() as quiet:
        if not verbose:  # MAX's INFO lines become the report's; warnings and errors pass
            quiet.enter_context(quiet_max_logging(report))
        with progress_ticks(report) if not verbose else contextlib.nullcontext():
            loaded = quiet.enter_context(
                load_pipeline(
                    path,
                    max_length=max_length,
                    max_batch_size=max_batch_size,
                    devices=devices,
                    options=options,
                )
            )
        if not verbose:
            report.ready("model loaded")
        ids = loaded.encode(prompt)
        new = greedy_generate(loaded, ids, max_new_tokens)
        out.print(prompt + loaded.decode(new), highlight=False, markup=False)
    return 0
