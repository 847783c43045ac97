"""Benchmark statistics for a shared, noisy machine: paired runs, a ratio with its interval, a gate.

Two things (models, kernels, paths) ``A`` and ``B`` are timed in pairs of adjacent runs, in ABBA
order (``AB``, ``BA``, ``AB``, ...) or in an order drawn per pair. The ratio is taken inside each
pair, where both runs saw nearly the same machine, and the interval comes from a bootstrap over
pairs: load that drifts during the run moves both runs of a pair together and cancels in the
ratio, and ABBA cancels a linear drift in the estimate as well. Warm-up runs are made first,
discarded and counted. Beside every result goes the machine's load (1-minute load average
before and after, CPU time stolen by the hypervisor), and a gate verdict has three outcomes:
``pass``, ``fail`` and ``inconclusive`` when the interval straddles the gate.

The unpaired method ``attnquant bench`` used up to 0.2 (:func:`unpaired_ratio`) is kept so that
benchmarks can show both on the same samples; nothing decides on it.

Used by ``attnquant bench`` and every script in ``benchmarks/``. Numpy and scipy only.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar

import numpy as np
import scipy.stats

__all__ = [
    "EXIT_CODES",
    "LoadReading",
    "MachineLoad",
    "Order",
    "PairedRuns",
    "RatioInterval",
    "Verdict",
    "gate_verdict",
    "machine_load",
    "paired_order",
    "paired_ratio",
    "read_load",
    "run_paired",
    "unpaired_ratio",
]

T = TypeVar("T")
Order = Literal["abba", "random"]
Verdict = Literal["pass", "fail", "inconclusive"]

#: Exit status of a gated benchmark: 0 pass, 1 fail, 3 inconclusive (2 is left to usage errors).
EXIT_CODES: dict[str, int] = {"pass": 0, "fail": 1, "inconclusive": 3}

ORDERS = ("abba", "random")


# --- the schedule ----------------------------------------------------------------------------


def paired_order(pairs: int, *, order: Order = "abba", seed: int = 0) -> list[bool]:
    """For each pair, whether ``A`` runs first: ABBA alternates (True, False, ...), 'random' draws."""
    if pairs < 1:
        raise ValueError(f"pairs must be at least 1, got {pairs}")
    if order == "abba":
        return [i % 2 == 0 for i in range(pairs)]
    if order == "random":
        return [bool(x) for x in np.random.default_rng(seed).integers(0, 2, pairs)]
    raise ValueError(f"order must be one of {', '.join(ORDERS)}, got {order!r}")


@dataclass(frozen=True, kw_only=True)
class PairedRuns(Generic[T]):
    """The measurements of :func:`run_paired`: ``a[i]`` and ``b[i]`` ran next to each other."""

    a: tuple[T, ...]
    b: tuple[T, ...]
    a_first: tuple[bool, ...]
    warmup: int  # runs of each side made before the first pair and discarded

    def __post_init__(self) -> None:
        if not len(self.a) == len(self.b) == len(self.a_first):
            raise ValueError(
                f"a, b and a_first must have one entry per pair, got "
                f"{len(self.a)}, {len(self.b)} and {len(self.a_first)}"
            )

    @property
    def pairs(self) -> int:
        """Number of timed pairs."""
        return len(self.a)

    def order_string(self) -> str:
        """The timed runs in order, e.g. ``ABBAAB``."""
        return "".join("AB" if first else "BA" for first in self.a_first)


def run_paired(
    run_a: Callable[[], T],
    run_b: Callable[[], T],
    *,
    pairs: int,
    warmup: int = 1,
    order: Order = "abba",
    seed: int = 0,
    on_run: Callable[[str, int, T], None] | None = None,
    settle: float = 0.0,
    sleep: Callable[[float], None] = time.sleep,
) -> PairedRuns[T]:
    """Run ``warmup`` discarded runs of each side (A then B), then ``pairs`` adjacent pairs.

    Each callable makes one run and returns its measurement (a number, or a record of several).
    ``on_run(side, pair, value)`` is called after each timed run, with side ``"a"`` or ``"b"``.
    ``settle`` seconds pass (``sleep``) before every timed run: where the two sides share the
    cores, one side's idle threads still spinning after its run (MAX's CPU workers spin for
    about 0.1-0.2 s) must not slow the run that follows it.
    """
    if warmup < 0:
        raise ValueError(f"warmup must be 0 or more, got {warmup}")
    if settle < 0:
        raise ValueError(f"settle must be 0 or more seconds, got {settle}")
    a_first = paired_order(pairs, order=order, seed=seed)
    for _ in range(warmup):
        run_a()
        run_b()
    a: list[T] = []
    b: list[T] = []
    for i, first in enumerate(a_first):
        for side in ("a", "b") if first else ("b", "a"):
            if settle:
                sleep(settle)
            value = run_a() if side == "a" else run_b()
            (a if side == "a" else b).append(value)
            if on_run is not None:
                on_run(side, i, value)
    return PairedRuns(a=tuple(a), b=tuple(b), a_first=tuple(a_first), warmup=warmup)


# --- the ratio and its interval --------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class RatioInterval:
    """A ratio ``A/B`` with a confidence interval ``[low, high]``."""

    ratio: float
    low: float
    high: float
    confidence: float
    n: int  # pairs (paired) or runs of each side (unpaired)
    method: str

    @property
    def half_width(self) -> float:
        """Half the interval's width: the smallest difference from 1 this measurement resolves."""
        return (self.high - self.low) / 2

    def contains(self, value: float = 1.0) -> bool:
        """Whether ``value`` lies in the interval (ends included)."""
        return self.low <= value <= self.high

    def to_json(self) -> dict[str, Any]:
        """The figures as a JSON-ready dict (``ci_low``/``ci_high`` as before 0.3)."""
        return {
            "ratio": self.ratio,
            "ci_low": self.low,
            "ci_high": self.high,
            "half_width": self.half_width,
            "confidence": self.confidence,
            "n": self.n,
            "method": self.method,
        }


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie strictly between 0 and 1, got {confidence}")


def _positive(values: Sequence[float], name: str) -> np.ndarray:
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or not np.all(np.isfinite(x)) or not np.all(x > 0):
        raise ValueError(f"{name} must be a 1-D sequence of positive finite numbers")
    return x


def paired_ratio(
    a: Sequence[float],
    b: Sequence[float],
    *,
    confidence: float = 0.95,
    n_resamples: int = 9999,
    seed: int = 0,
) -> RatioInterval:
    """Geometric mean of the within-pair ratios ``a[i] / b[i]``, bootstrapped over pairs.

    Parameters
    ----------
    a, b : sequences of positive floats, shape (n_pairs,)
        ``a[i]`` and ``b[i]`` were measured next to each other (see :func:`run_paired`).
    confidence : float
        Coverage of the interval.
    n_resamples : int
        Bootstrap resamples of the pairs.
    seed : int
        Seed of the resampling: the same measurements give the same interval.

    Returns
    -------
    RatioInterval
        ``ratio = exp(mean(log(a / b)))`` and its interval.

    Notes
    -----
    1. Within-pair log ratios ``d_i = log(a_i / b_i)``: load shared by the two runs of a pair
       cancels, and a ratio of a ratio is symmetric on the log scale.
    2. Percentile bootstrap of ``mean(d)`` over pairs (the pairs are resampled, never the runs).
    3. The percentile interval is too narrow for few pairs (its spread is ``s/sqrt(n)`` with
       ``s`` the biased standard deviation, and it uses normal rather than Student quantiles);
       the *expanded* percentile interval takes the bootstrap quantiles at ``alpha'`` with
       ``z(alpha'/2) = sqrt(n / (n - 1)) * t(alpha/2, n - 1)``, which corrects both
       (Hesterberg 2015).

    A bootstrap interval never reaches past the most extreme pair, so below 6 pairs it covers
    less than asked (the range of 5 pairs holds the true median 94% of the time, of 4, 88%):
    time at least 6 pairs.

    References
    ----------
    T. C. Hesterberg, "What teachers should know about the bootstrap: resampling in the
    undergraduate statistics curriculum", The American Statistician 69(4), 2015, section 4.
    """
    _check_confidence(confidence)
    x = _positive(a, "a")
    y = _positive(b, "b")
    if x.size != y.size:
        raise ValueError(f"a and b must have one value per pair, got {x.size} and {y.size}")
    n = x.size
    if n < 2:
        raise ValueError(f"a paired interval needs at least 2 pairs, got {n}")
    if n_resamples < 1:
        raise ValueError(f"n_resamples must be at least 1, got {n_resamples}")
    d = np.log(x) - np.log(y)
    rng = np.random.default_rng(seed)
    means = d[rng.integers(0, n, size=(n_resamples, n))].mean(axis=1)
    alpha = 1.0 - confidence
    z = math.sqrt(n / (n - 1)) * scipy.stats.t.ppf(1.0 - alpha / 2, n - 1)
    tail = float(scipy.stats.norm.sf(z))
    low, high = np.quantile(means, [tail, 1.0 - tail])
    return RatioInterval(
        ratio=float(np.exp(d.mean())),
        low=float(np.exp(low)),
        high=float(np.exp(high)),
        confidence=confidence,
        n=n,
        method="paired: geometric mean of within-pair ratios, expanded percentile bootstrap over pairs",
    )


def unpaired_ratio(
    a: Sequence[float],
    b: Sequence[float],
    *,
    confidence: float = 0.95,
    n_resamples: int = 9999,
    seed: int = 0,
) -> RatioInterval:
    """``mean(a) / mean(b)`` with an unpaired percentile bootstrap (bench's method up to 0.2).

    Each side is resampled on its own, as if the runs were independent; kept for comparison
    with :func:`paired_ratio` on the same samples.
    """
    _check_confidence(confidence)
    x = _positive(a, "a")
    y = _positive(b, "b")
    if x.size < 2 or y.size < 2:
        raise ValueError("a bootstrap interval needs at least 2 measurements on each side")

    def stat(p: np.ndarray, q: np.ndarray, axis: int = -1) -> np.ndarray:
        return np.mean(p, axis=axis) / np.mean(q, axis=axis)

    res = scipy.stats.bootstrap(
        (x, y),
        stat,
        confidence_level=confidence,
        n_resamples=n_resamples,
        method="percentile",
        vectorized=True,
        rng=np.random.default_rng(seed),
    )
    return RatioInterval(
        ratio=float(stat(x, y)),
        low=float(res.confidence_interval.low),
        high=float(res.confidence_interval.high),
        confidence=confidence,
        n=min(x.size, y.size),
        method="unpaired: ratio of means, percentile bootstrap of each side",
    )


def gate_verdict(estimate: RatioInterval, gate: float) -> Verdict:
    """``pass`` when the whole interval is at or above ``gate``, ``fail`` when it is all below,
    ``inconclusive`` when it straddles the gate (more runs, or a quieter machine, would tell)."""
    if estimate.low >= gate:
        return "pass"
    if estimate.high < gate:
        return "fail"
    return "inconclusive"


# --- the machine's load ----------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class LoadReading:
    """Load averages and cumulative CPU ticks (all CPUs) at one moment."""

    time: float
    loadavg: tuple[float, float, float] | None
    steal_ticks: int | None  # None where /proc/stat has no steal column
    busy_ticks: int | None
    total_ticks: int | None


def read_load(proc_stat: Path = Path("/proc/stat")) -> LoadReading:
    """Read ``os.getloadavg()`` and the aggregate ``cpu`` line of ``/proc/stat`` (where present)."""
    try:
        loadavg: tuple[float, float, float] | None = tuple(os.getloadavg())  # type: ignore[assignment]
    except (AttributeError, OSError):  # not on every platform
        loadavg = None
    steal = busy = total = None
    try:
        with open(proc_stat) as f:
            fields = f.readline().split()
    except OSError:
        fields = []
    if fields[:1] == ["cpu"]:
        # user nice system idle iowait irq softirq steal guest guest_nice; guest time is
        # already counted in user and nice, so the total stops at steal.
        ticks = [int(v) for v in fields[1:9]]
        total = sum(ticks)
        idle = sum(ticks[3:5])
        busy = total - idle
        steal = ticks[7] if len(ticks) >= 8 else None
    return LoadReading(
        time=time.time(), loadavg=loadavg, steal_ticks=steal, busy_ticks=busy, total_ticks=total
    )


@dataclass(frozen=True, kw_only=True)
class MachineLoad:
    """The machine's load around a measurement, to print and store beside its result."""

    cpus: int
    loadavg_before: tuple[float, float, float] | None
    loadavg_after: tuple[float, float, float] | None
    steal_fraction: float | None  # of all CPU time between the readings
    busy_fraction: float | None  # non-idle share of all CPU time, this process included
    seconds: float

    def describe(self) -> str:
        """One line: ``load 1.45 -> 1.98 (1-min, 2 CPUs), CPUs 97% busy, 0.0% stolen``."""
        parts = []
        if self.loadavg_before is not None and self.loadavg_after is not None:
            parts.append(
                f"load {self.loadavg_before[0]:.2f} -> {self.loadavg_after[0]:.2f} "
                f"(1-min average, {self.cpus} CPUs)"
            )
        if self.busy_fraction is not None:
            parts.append(f"CPUs {100 * self.busy_fraction:.0f}% busy")
        if self.steal_fraction is not None:
            parts.append(f"{100 * self.steal_fraction:.1f}% stolen")
        return ", ".join(parts) if parts else "load not available on this platform"

    def to_json(self) -> dict[str, Any]:
        """The figures as a JSON-ready dict."""
        return {
            "cpus": self.cpus,
            "loadavg_before": list(self.loadavg_before) if self.loadavg_before else None,
            "loadavg_after": list(self.loadavg_after) if self.loadavg_after else None,
            "steal_fraction": self.steal_fraction,
            "busy_fraction": self.busy_fraction,
            "seconds": self.seconds,
        }


def machine_load(before: LoadReading, after: LoadReading | None = None) -> MachineLoad:
    """The load between two readings (``after`` defaults to now)."""
    after = read_load() if after is None else after

    def share(first: int | None, last: int | None) -> float | None:
        if None in (first, last, before.total_ticks, after.total_ticks):
            return None
        elapsed = after.total_ticks - before.total_ticks  # type: ignore[operator]
        return (last - first) / elapsed if elapsed > 0 else 0.0  # type: ignore[operator]

    return MachineLoad(
        cpus=os.cpu_count() or 1,
        loadavg_before=before.loadavg,
        loadavg_after=after.loadavg,
        steal_fraction=share(before.steal_ticks, after.steal_ticks),
        busy_fraction=share(before.busy_ticks, after.busy_ticks),
        seconds=after.time - before.time,
    )
