"""``attnquant generate``: one greedy completion of a prompt, through MAX."""

from __future__ import annotations

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
    options: ServingOptions = ServingOptions(),
) -> int:
    """Complete PROMPT greedily with MODEL (raw completion, no chat template)."""
    require_max("generate")
    from attnquant_core import require_intact
    from attnquant_max import greedy_generate, load_pipeline, plan_serving

    path = model_path(model)
    require_intact(path)  # every tensor against its digest (ATTNQUANT_VERIFY_DIGESTS=0: skip)
    console.print(plan_serving(path, options).describe(), highlight=False, soft_wrap=True)
    with load_pipeline(
        path,
        max_length=max_length,
        max_batch_size=max_batch_size,
        devices=devices,
        options=options,
    ) as loaded:
        ids = loaded.encode(prompt)
        new = greedy_generate(loaded, ids, max_new_tokens)
        out.print(prompt + loaded.decode(new), highlight=False, markup=False)
    return 0
