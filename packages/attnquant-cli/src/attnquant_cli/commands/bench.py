"""``attnquant bench``: tokens per second of two checkpoints in adjacent pairs, with a 95% CI."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from attnquant_core.serving import ServingOptions

from .._extra import require_max
from ._serving import serving_flags
from ._shared import Devices, MaxBatch, MaxLength, console, model_path, out

__all__ = ["bench"]


@serving_flags
def bench(
    base: Annotated[Path, typer.Argument(help="The stock (dense) checkpoint, or 'demo'.")],
    theta: Annotated[
        Path,
        typer.Argument(help="The checkpoint to compare, theta or dense; BASE again for A/A."),
    ],
    gate: Annotated[
        float,
        typer.Option(min=0.0, help="Pass when decode tok/s THETA/BASE is at least this."),
    ] = 0.8,
    repetitions: Annotated[
        int,
        typer.Option(min=6, help="Timed pairs (one run of each model, side by side); at least 6."),
    ] = 10,
    warmup: Annotated[
        int, typer.Option(min=0, help="Runs of each model made first and discarded.")
    ] = 1,
    order: Annotated[
        str,
        typer.Option(help="Order within pairs: abba (AB, BA, AB, ...) or random (seeded)."),
    ] = "abba",
    seed: Annotated[int, typer.Option(help="Seed of the random order and the bootstrap.")] = 0,
    prompt_tokens: Annotated[int, typer.Option(min=1, help="Prompt length (prefill).")] = 128,
    new_tokens: Annotated[int, typer.Option(min=2, help="Tokens generated (decode).")] = 64,
    output: Annotated[Path, typer.Option("--output", "-o", help="JSON results.")] = Path(
        "attnquant-bench.json"
    ),
    devices: Devices = "cpu",
    max_length: MaxLength = 512,
    max_batch_size: MaxBatch = 8,
    options: ServingOptions = ServingOptions(),
) -> int:
    """Tokens per second of BASE and THETA, timed in adjacent pairs, THETA/BASE with its 95% CI.

    The ratio is taken within each pair (ABBA order) and its interval bootstrapped over the
    pairs, so load that drifts during the run cancels; the machine's load (load average, CPU
    time stolen) is printed and stored beside the result.

    A/A check: give the same model twice (attnquant bench BASE BASE) to time it against itself;
    it reports the half-width a real difference must exceed on this machine now, and exits 0
    when the interval holds 1.0, 1 when it does not.

    Exit status: 0 pass (the whole interval at or above --gate), 1 fail (all of it below),
    3 inconclusive (the interval straddles the gate), 2 usage error or bad input.
    """
    if order not in ("abba", "random"):
        raise typer.BadParameter(f"--order {order!r}: use 'abba' or 'random'")
    require_max("bench")
    import json

    from attnquant_core import machine_load, read_load, require_intact
    from attnquant_max import STOCK, load_pipeline, plan_serving

    from .._analyze import write_atomic
    from .._bench import (
        bench_pair,
        bench_table,
        exit_code,
        generate_runner,
        prompt_ids,
        summarize,
        verdict_line,
    )

    base, theta = model_path(str(base)), model_path(str(theta))
    for checkpoint in {base, theta}:  # every tensor against its digest, before MAX loads
        require_intact(checkpoint)
    aa = base.resolve() == theta.resolve()
    if aa:
        console.print("A/A check: BASE against itself (the gate is not applied)", highlight=False)
    else:
        console.print(
            f"gate: decode tok/s THETA/BASE >= {gate} (set before the run)", highlight=False
        )
    if not aa:
        console.print(plan_serving(theta, options).describe(), highlight=False, soft_wrap=True)
    common = {"max_length": max_length, "max_batch_size": max_batch_size, "devices": devices}
    # The base is the stock model, served on the stock graph whatever the serving options say
    # (as `verify` serves its base); in A/A mode both sides are.
    base_model = load_pipeline(base, options=STOCK, **common)
    theta_model = load_pipeline(theta, options=STOCK if aa else options, **common)
    try:
        prompt = prompt_ids(base_model.encode, prompt_tokens)
        before = read_load()
        runs = bench_pair(
            generate_runner(base_model),
            generate_runner(theta_model),
            prompt,
            pairs=repetitions,
            new_tokens=new_tokens,
            warmup=warmup,
            order=order,  # type: ignore[arg-type]
            seed=seed,
        )
        load = machine_load(before)
    finally:
        base_model.close()
        theta_model.close()
    result = summarize(runs, gate=None if aa else gate, load=load, seed=seed)
    result.update(
        base=str(base),
        theta=str(theta),
        repetitions=repetitions,
        prompt_tokens=len(prompt),
        new_tokens=new_tokens,
        devices=devices,
    )
    title = (
        f"bench {theta} against {base} ({repetitions} pairs in {order.upper()} order, "
        f"{warmup} warm-up run(s) of each discarded)"
    )
    out.print_table(bench_table(result, title=title, load=load))
    out.print(verdict_line(result), highlight=False)
    write_atomic(output, lambda p: p.write_text(json.dumps(result, indent=2) + "\n"))
    console.print(f"wrote {output}", highlight=False)
    return exit_code(result)
