"""``attnquant bench``: two models in one process, timed in adjacent pairs, tok/s with a CI.

The statistics (ABBA pairs, the paired ratio and its interval, the gate's three outcomes, the
machine's load) are attnquant-core's (``attnquant_core._benchstats``), shared with the scripts in
``benchmarks/``; this module times a MAX model and lays out the result.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from rich.table import Table

from attnquant_core import (
    EXIT_CODES,
    MachineLoad,
    Order,
    PairedRuns,
    RatioInterval,
    gate_verdict,
    paired_ratio,
    run_paired,
)

__all__ = [
    "BENCH_TEXT",
    "METRICS",
    "Runner",
    "Sample",
    "bench_pair",
    "bench_table",
    "exit_code",
    "generate_runner",
    "measure",
    "prompt_ids",
    "summarize",
    "verdict_line",
]

# Prompt material in the demo model's domain; repeated and cut to the requested length.
BENCH_TEXT = (
    "import os\nimport sys\n\n\nclass Reader:\n    def __init__(self, path):\n"
    "        self.path = path\n\n    def read(self):\n        with open(self.path) as f:\n"
    "            return f.read()\n\n\ndef main(argv=None):\n    args = argv or sys.argv[1:]\n"
    "    for name in args:\n        print(Reader(name).read())\n"
)
# What one run measures; THETA/BASE of each (for TTFT, lower is better).
METRICS = ("decode_tok_s", "prefill_tok_s", "ttft_s")
GATED_ON = "decode_tok_s"
# A/A: the command's exit status says whether the interval holds 1.0 (0) or not (1).
AA_EXIT_CODES = {"contains 1.0": 0, "excludes 1.0": 1}

Runner = Callable[[list[int], int], Any]


@dataclass(frozen=True)
class Sample:
    """One timed run: time to first token, prefill and decode throughput."""

    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float


def measure(generate: Runner, prompt: list[int], new_tokens: int) -> Sample:
    """Time a one-token generation (prefill: the time to first token) and a full one (decode)."""
    t0 = time.perf_counter()
    generate(prompt, 1)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    generate(prompt, new_tokens)
    total = time.perf_counter() - t0
    decode = max(total - ttft, 1e-9)
    return Sample(
        ttft_s=ttft, prefill_tok_s=len(prompt) / ttft, decode_tok_s=(new_tokens - 1) / decode
    )


def bench_pair(
    base: Runner,
    theta: Runner,
    prompt: list[int],
    *,
    pairs: int,
    new_tokens: int,
    warmup: int = 1,
    order: Order = "abba",
    seed: int = 0,
    on_sample: Callable[[str, int, Sample], None] | None = None,
) -> PairedRuns[Sample]:
    """Time THETA (``a``) and BASE (``b``) in ``pairs`` adjacent pairs after ``warmup`` runs each.

    ``on_sample(name, pair, sample)`` is called after each timed run, name ``theta`` or ``base``.
    """
    report = None
    if on_sample is not None:
        names = {"a": "theta", "b": "base"}

        def report(side: str, pair: int, sample: Sample) -> None:
            on_sample(names[side], pair, sample)

    return run_paired(
        lambda: measure(theta, prompt, new_tokens),
        lambda: measure(base, prompt, new_tokens),
        pairs=pairs,
        warmup=warmup,
        order=order,
        seed=seed,
        on_run=report,
    )


def summarize(
    runs: PairedRuns[Sample],
    *,
    gate: float | None,
    load: MachineLoad | None = None,
    seed: int = 0,
) -> dict[str, Any]:
    """Medians per model, THETA/BASE paired ratios with 95% CIs, the verdict and the load.

    ``gate=None`` is the A/A check (BASE against itself): the verdict says whether the decode
    interval holds 1.0, and its half-width is the smallest difference this machine resolves now.
    """

    def col(samples: Sequence[Sample], field: str) -> list[float]:
        return [getattr(s, field) for s in samples]

    sides = {"base": runs.b, "theta": runs.a}
    ratios: dict[str, RatioInterval] = {
        m: paired_ratio(col(runs.a, m), col(runs.b, m), seed=seed) for m in METRICS
    }
    gated = ratios[GATED_ON]
    if gate is None:
        verdict = "contains 1.0" if gated.contains(1.0) else "excludes 1.0"
        code = AA_EXIT_CODES[verdict]
    else:
        verdict = gate_verdict(gated, gate)
        code = EXIT_CODES[verdict]
    return {
        "mode": "a/a" if gate is None else "gate",
        "gate": gate,
        "gated_on": GATED_ON,
        "verdict": verdict,
        "passed": verdict in ("pass", "contains 1.0"),
        "exit_code": code,
        "resolution": {m: r.half_width for m, r in ratios.items()},
        "pairs": runs.pairs,
        "warmup_runs": {"base": runs.warmup, "theta": runs.warmup},
        "order": runs.order_string().replace("A", "T"),  # T theta, B base
        "method": gated.method,
        "medians": {n: {m: float(np.median(col(s, m))) for m in METRICS} for n, s in sides.items()},
        "ratios": {m: r.to_json() for m, r in ratios.items()},
        "load": load.to_json() if load is not None else None,
        "samples": {n: [asdict(s) for s in v] for n, v in sides.items()},
    }


def exit_code(result: dict[str, Any]) -> int:
    """The command's exit status: 0 pass, 1 fail, 3 inconclusive (A/A: 0 holds 1.0, 1 not)."""
    return int(result["exit_code"])


def bench_table(result: dict[str, Any], *, title: str, load: MachineLoad | None) -> Table:
    """Medians per model, THETA/BASE with its interval, and the machine's load as a caption."""
    table = Table(title=title, caption=load.describe() if load is not None else None)
    for col in ("", "decode tok/s", "prefill tok/s", "TTFT ms"):
        table.add_column(col, justify="right")
    for name in ("base", "theta"):
        m = result["medians"][name]
        table.add_row(
            name,
            f"{m['decode_tok_s']:.1f}",
            f"{m['prefill_tok_s']:.1f}",
            f"{m['ttft_s'] * 1e3:.1f}",
        )
    r = result["ratios"]
    table.add_row(
        "theta/base",
        *(f"{r[k]['ratio']:.3f} [{r[k]['ci_low']:.3f}, {r[k]['ci_high']:.3f}]" for k in METRICS),
    )
    table.add_row("± (half-width)", *(f"{r[k]['half_width']:.3f}" for k in METRICS))
    return table


def verdict_line(result: dict[str, Any]) -> str:
    """One line: the verdict and what it rests on."""
    r = result["ratios"][GATED_ON]
    interval = f"decode THETA/BASE {r['ratio']:.3f} [{r['ci_low']:.3f}, {r['ci_high']:.3f}]"
    if result["mode"] == "a/a":
        return (
            f"A/A: {interval} {result['verdict']}; a real difference must exceed "
            f"±{r['half_width']:.3f} ({100 * r['half_width']:.1f}%) to show on this machine now"
        )
    verdict = result["verdict"]
    if verdict == "inconclusive":
        why = "the interval straddles the gate: more --repetitions or a quieter machine"
    elif verdict == "pass":
        why = "the whole interval is at or above the gate"
    else:
        why = "the whole interval is below the gate"
    return f"gate {result['gate']}: {verdict} ({interval}; {why})"


def generate_runner(loaded: Any) -> Runner:
    """A runner for :func:`bench_pair` around a loaded MAX model: greedy, EOS ignored."""

    def run(ids: list[int], n: int) -> Any:
        return loaded.model.generate([ids], max_new_tokens=n, top_k=1, ignore_eos=True)

    return run


def prompt_ids(encode: Callable[[str], Sequence[int]], length: int) -> list[int]:
    """``length`` token ids of :data:`BENCH_TEXT`, repeated as needed."""
    text = BENCH_TEXT
    ids = list(encode(text))
    while len(ids) < length:
        text += BENCH_TEXT
        ids = list(encode(text))
    return ids[:length]
