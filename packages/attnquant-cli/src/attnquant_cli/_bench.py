"""``attnquant bench``: two models in one process, interleaved, tokens per second with a CI."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from ._stats import RatioEstimate, ratio_of_means

__all__ = [
    "BENCH_TEXT",
    "Sample",
    "bench_pair",
    "generate_runner",
    "measure",
    "prompt_ids",
    "summarize",
]

# Prompt material in the demo model's domain; repeated and cut to the requested length.
BENCH_TEXT = (
    "import os\nimport sys\n\n\nclass Reader:\n    def __init__(self, path):\n"
    "        self.path = path\n\n    def read(self):\n        with open(self.path) as f:\n"
    "            return f.read()\n\n\ndef main(argv=None):\n    args = argv or sys.argv[1:]\n"
    "    for name in args:\n        print(Reader(name).read())\n"
)


@dataclass(frozen=True)
class Sample:
    """One timed run: time to first token, prefill and decode throughput."""

    ttft_s: float
    prefill_tok_s: float
    decode_tok_s: float


def measure(
    generate: Callable[[list[int], int], Any], prompt: list[int], new_tokens: int
) -> Sample:
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
    runners: dict[str, Callable[[list[int], int], Any]],
    prompt: list[int],
    *,
    repetitions: int,
    new_tokens: int,
    warmup: int = 1,
    on_sample: Callable[[str, int, Sample], None] | None = None,
) -> dict[str, list[Sample]]:
    """Interleave the runners (order alternating each repetition) and collect their samples."""
    names = list(runners)
    for name in names:
        for _ in range(warmup):
            measure(runners[name], prompt, new_tokens)
    samples: dict[str, list[Sample]] = {n: [] for n in names}
    for rep in range(repetitions):
        for name in names if rep % 2 == 0 else names[::-1]:
            sample = measure(runners[name], prompt, new_tokens)
            samples[name].append(sample)
            if on_sample is not None:
                on_sample(name, rep, sample)
    return samples


def summarize(
    samples: dict[str, list[Sample]], *, base: str, theta: str, gate: float
) -> dict[str, Any]:
    """Medians per model and THETA/BASE ratios (decode, prefill, inverse TTFT) with CIs."""

    def col(name: str, field: str) -> list[float]:
        return [getattr(s, field) for s in samples[name]]

    ratios: dict[str, RatioEstimate] = {
        "decode_tok_s": ratio_of_means(col(theta, "decode_tok_s"), col(base, "decode_tok_s")),
        "prefill_tok_s": ratio_of_means(col(theta, "prefill_tok_s"), col(base, "prefill_tok_s")),
        "ttft_s": ratio_of_means(col(theta, "ttft_s"), col(base, "ttft_s")),
    }
    decode = ratios["decode_tok_s"]
    return {
        "gate": gate,
        "gated_on": "decode_tok_s",
        "verdict": decode.verdict(gate),
        "passed": decode.ratio >= gate,
        "medians": {
            n: {f: float(np.median(col(n, f))) for f in ("ttft_s", "prefill_tok_s", "decode_tok_s")}
            for n in samples
        },
        "ratios": {k: v.to_json() for k, v in ratios.items()},
        "samples": {n: [asdict(s) for s in v] for n, v in samples.items()},
    }


def generate_runner(loaded: Any) -> Callable[[list[int], int], Any]:
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
