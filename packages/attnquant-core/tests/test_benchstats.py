"""Benchmark statistics: the paired ratio on simulated noisy machines, the schedule, the gate."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnquant_core import (
    EXIT_CODES,
    LoadReading,
    RatioInterval,
    gate_verdict,
    machine_load,
    paired_order,
    paired_ratio,
    read_load,
    run_paired,
    unpaired_ratio,
)

EXPERIMENTS = 400
PAIRS = 10  # ``attnquant bench``'s default --repetitions


def noisy_machine(
    rng: np.random.Generator, experiments: int, pairs: int, *, true_ratio: float = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """Throughputs ``(a, b)``, shape (experiments, pairs), of two runners timed in ABBA order on a
    machine whose speed drifts: every run's speed is multiplied by ``exp(noise)``, with

    * an AR(1) term, ``rho = 0.8``, stationary standard deviation 0.05 (load that lasts a few runs),
    * a slow drift, a sine of amplitude 0.15 with a random period of 0.7 to 3 experiment lengths
      and a random phase (a neighbour's job ramping up or down),
    * busy bursts: a two-state Markov chain (enter with probability 0.1 per run, leave with 0.3)
      that slows every run it covers by ``exp(-0.25)``.

    ``a`` is ``true_ratio`` times faster than ``b``; runs alternate AB, BA, AB, ... as
    :func:`run_paired` schedules them.
    """
    runs = 2 * pairs
    rho, sigma = 0.8, 0.05
    innovations = rng.standard_normal((experiments, runs)) * sigma * np.sqrt(1 - rho**2)
    ar = np.empty((experiments, runs))
    ar[:, 0] = rng.standard_normal(experiments) * sigma
    for k in range(1, runs):
        ar[:, k] = rho * ar[:, k - 1] + innovations[:, k]
    t = np.arange(runs) / runs
    period = rng.uniform(0.3, 1.5, (experiments, 1))
    phase = rng.uniform(0, 2 * np.pi, (experiments, 1))
    drift = 0.15 * np.sin(2 * np.pi * t * period + phase)
    busy = np.empty((experiments, runs), dtype=bool)
    busy[:, 0] = rng.random(experiments) < 0.25
    u = rng.random((experiments, runs))
    for k in range(1, runs):
        busy[:, k] = np.where(busy[:, k - 1], u[:, k] > 0.3, u[:, k] < 0.1)
    speed = np.exp(ar + drift - 0.25 * busy)

    a_first = np.array(paired_order(pairs))
    slot = 2 * np.arange(pairs)
    a = speed[:, slot + np.where(a_first, 0, 1)] * true_ratio * 100.0
    b = speed[:, slot + np.where(a_first, 1, 0)] * 100.0
    return a, b


def test_paired_interval_covers_the_true_ratio_on_a_drifting_machine():
    """400 simulated A/A experiments of 10 ABBA pairs on the machine of :func:`noisy_machine`.

    Measured (seed 0): the paired interval covers 1.0 in 382/400 = 95.5% of the experiments,
    median width 0.139. The unpaired method of 0.2 (:func:`unpaired_ratio`, 9999 resamples) on the
    same samples covers 1.0 in 399/400 = 99.75%, median width 0.235: on drift it is not too narrow
    but 1.7 times too wide, because it counts the load the two sides share as noise of each side.
    (Where it is too narrow is few runs of independent noise: with the drift, AR(1) and bursts
    replaced by independent log-normal noise of sd 0.05, 6 pairs, it covers 363/400 = 90.8%, the
    paired interval 372/400 = 93.0%; with 10% of runs hit by a 26% slowdown, 355/400 = 88.8%
    against 377/400 = 94.3%.)
    """
    rng = np.random.default_rng(0)
    a, b = noisy_machine(rng, EXPERIMENTS, PAIRS)
    estimates = [paired_ratio(a[i], b[i], seed=i) for i in range(EXPERIMENTS)]
    covered = sum(e.contains(1.0) for e in estimates)
    assert covered >= 0.93 * EXPERIMENTS, covered
    widths = [e.high - e.low for e in estimates]

    unpaired = [unpaired_ratio(a[i], b[i], n_resamples=999, seed=i) for i in range(EXPERIMENTS)]
    assert np.median(widths) < 0.75 * np.median([e.high - e.low for e in unpaired])


def test_a_true_ratio_of_1_2_is_detected():
    rng = np.random.default_rng(1)
    a, b = noisy_machine(rng, 50, PAIRS, true_ratio=1.2)
    estimates = [paired_ratio(a[i], b[i], seed=i) for i in range(50)]
    assert sum(e.low > 1.0 for e in estimates) >= 48
    assert np.median([e.ratio for e in estimates]) == pytest.approx(1.2, rel=0.03)
    assert all(gate_verdict(e, 0.8) == "pass" for e in estimates)


def test_shared_load_cancels_within_pairs():
    # Both runs of a pair see the same 3x swing in speed: the paired ratio is exact, the unpaired
    # one is not.
    load = np.array([1.0, 3.0, 0.5, 2.0, 1.5, 0.7])
    est = paired_ratio(1.1 * load, load)
    assert est.ratio == pytest.approx(1.1)
    assert est.low == pytest.approx(1.1) and est.high == pytest.approx(1.1)
    assert unpaired_ratio(1.1 * load, load).half_width > 0.3


@settings(max_examples=50, deadline=None)  # no timing: a loaded machine must not fail it
@given(
    st.lists(st.tuples(st.floats(0.1, 1e4), st.floats(0.1, 1e4)), min_size=2, max_size=30).map(
        lambda pairs: tuple(np.array(pairs).T)
    ),
    st.floats(0.01, 100.0),
)
def test_paired_ratio_is_scale_equivariant_and_inverts(ab, scale):
    a, b = ab
    est = paired_ratio(a, b, n_resamples=499)
    assert est.low <= est.ratio * (1 + 1e-12) and est.ratio <= est.high * (1 + 1e-12)
    scaled = paired_ratio(scale * a, b, n_resamples=499)
    assert scaled.ratio == pytest.approx(scale * est.ratio, rel=1e-9)
    assert scaled.low == pytest.approx(scale * est.low, rel=1e-9)
    assert scaled.high == pytest.approx(scale * est.high, rel=1e-9)
    swapped = paired_ratio(b, a, n_resamples=499)
    assert swapped.ratio == pytest.approx(1 / est.ratio, rel=1e-9)
    assert swapped.low == pytest.approx(1 / est.high, rel=1e-9)
    assert swapped.high == pytest.approx(1 / est.low, rel=1e-9)


def test_paired_ratio_is_seeded():
    a = [1.0, 1.2, 0.9, 1.1, 1.05, 0.97, 1.02, 1.15]
    b = [1.0, 1.0, 1.05, 0.95, 1.0, 1.01, 0.99, 1.0]
    assert paired_ratio(a, b) == paired_ratio(a, b)
    assert paired_ratio(a, b, seed=1) != paired_ratio(a, b, seed=2)


@pytest.mark.parametrize(
    ("a", "b", "message"),
    [
        ([1.0], [1.0], "at least 2 pairs"),
        ([1.0, 2.0], [1.0], "one value per pair"),
        ([1.0, -2.0], [1.0, 1.0], "a must be a 1-D sequence of positive finite numbers"),
        ([1.0, 2.0], [1.0, float("nan")], "b must be"),
    ],
)
def test_paired_ratio_refuses_bad_input(a, b, message):
    with pytest.raises(ValueError, match=message):
        paired_ratio(a, b)


def test_confidence_must_be_a_probability():
    with pytest.raises(ValueError, match="confidence must lie strictly between 0 and 1, got 95"):
        paired_ratio([1.0, 2.0], [1.0, 2.0], confidence=95)


@pytest.mark.parametrize(
    ("low", "high", "verdict"),
    [
        (0.85, 0.95, "pass"),
        (0.80, 0.95, "pass"),  # the gate itself passes
        (0.70, 0.90, "inconclusive"),
        (0.79, 0.80, "inconclusive"),
        (0.60, 0.79, "fail"),
    ],
)
def test_gate_verdict(low, high, verdict):
    est = RatioInterval(
        ratio=(low + high) / 2, low=low, high=high, confidence=0.95, n=10, method="by hand"
    )
    assert gate_verdict(est, 0.8) == verdict


def test_exit_codes_are_distinct_and_leave_2_to_usage_errors():
    assert EXIT_CODES == {"pass": 0, "fail": 1, "inconclusive": 3}


def test_abba_order():
    assert paired_order(5) == [True, False, True, False, True]
    runs = run_paired(lambda: "A", lambda: "B", pairs=4, warmup=0)
    assert runs.order_string() == "ABBAABBA"


def test_random_order_is_seeded():
    first = paired_order(64, order="random", seed=3)
    assert first == paired_order(64, order="random", seed=3)
    assert 16 < sum(first) < 48


def test_order_must_be_known():
    with pytest.raises(ValueError, match="order must be one of abba, random, got 'aabb'"):
        paired_order(4, order="aabb")  # type: ignore[arg-type]


@settings(deadline=None)  # no timing: a loaded machine must not fail it
@given(
    st.integers(1, 20),
    st.integers(0, 4),
    st.sampled_from(["abba", "random"]),
    st.integers(0, 2**32 - 1),
)
def test_run_paired_runs_each_side_once_per_pair_after_the_warmup(pairs, warmup, order, seed):
    calls: list[str] = []
    counter = iter(range(10_000))

    def runner(side: str):
        def run() -> tuple[str, int]:
            calls.append(side)
            return side, next(counter)

        return run

    seen: list[tuple[str, int]] = []
    runs = run_paired(
        runner("a"),
        runner("b"),
        pairs=pairs,
        warmup=warmup,
        order=order,
        seed=seed,
        on_run=lambda side, i, value: seen.append((side, i)),
    )
    assert runs.warmup == warmup and runs.pairs == pairs
    assert calls[: 2 * warmup] == ["a", "b"] * warmup  # discarded, counted
    timed = calls[2 * warmup :]
    assert "".join(timed).upper() == runs.order_string()
    assert [s for s, _ in seen] == timed and [i for _, i in seen] == sorted(i for _, i in seen)
    for i in range(pairs):  # the two runs of a pair are adjacent
        a_at, b_at = runs.a[i][1], runs.b[i][1]
        assert abs(a_at - b_at) == 1 and min(a_at, b_at) == 2 * warmup + 2 * i
        assert (a_at < b_at) == runs.a_first[i]


def test_settle_sleeps_before_every_timed_run_and_not_before_the_warmup():
    events: list[object] = []
    runs = run_paired(
        lambda: events.append("a"),
        lambda: events.append("b"),
        pairs=2,
        warmup=1,
        settle=0.25,
        sleep=events.append,
    )
    assert runs.order_string() == "ABBA"
    assert events == ["a", "b", 0.25, "a", 0.25, "b", 0.25, "b", 0.25, "a"]


def test_settle_must_not_be_negative():
    with pytest.raises(ValueError, match="settle must be 0 or more seconds, got -0.5"):
        run_paired(lambda: 1.0, lambda: 1.0, pairs=2, settle=-0.5)


def test_warmup_must_not_be_negative():
    with pytest.raises(ValueError, match="warmup must be 0 or more, got -1"):
        run_paired(lambda: 1.0, lambda: 1.0, pairs=2, warmup=-1)


def _proc_stat(path: Path, user: int, idle: int, steal: int) -> Path:
    path.write_text(f"cpu  {user} 0 0 {idle} 0 0 0 {steal} 0 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n")
    return path


def test_machine_load_reads_steal_and_busy_time(tmp_path):
    before = read_load(_proc_stat(tmp_path / "stat0", user=100, idle=100, steal=0))
    after = read_load(_proc_stat(tmp_path / "stat1", user=250, idle=130, steal=20))
    assert before.steal_ticks == 0 and after.total_ticks == 400
    load = machine_load(before, after)
    assert load.steal_fraction == pytest.approx(20 / 200)
    assert load.busy_fraction == pytest.approx(170 / 200)
    assert "10.0% stolen" in load.describe() and "85% busy" in load.describe()
    assert load.to_json()["steal_fraction"] == pytest.approx(0.1)


def test_machine_load_without_proc_stat(tmp_path):
    reading = read_load(tmp_path / "missing")
    assert reading.steal_ticks is None and reading.total_ticks is None
    load = machine_load(reading, reading)
    assert load.steal_fraction is None and "stolen" not in load.describe()


def test_machine_load_now():
    load = machine_load(read_load())
    assert load.cpus >= 1 and load.seconds >= 0
    assert isinstance(load.describe(), str)


def test_load_reading_is_plain_data():
    reading = LoadReading(
        time=0.0, loadavg=(1.0, 1.0, 1.0), steal_ticks=None, busy_ticks=None, total_ticks=None
    )
    assert machine_load(reading, reading).describe().startswith("load 1.00 -> 1.00")
