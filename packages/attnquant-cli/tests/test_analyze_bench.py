"""``attnquant analyze`` outputs (schema, files); ``attnquant bench`` on fake runners (no MAX compile)."""

from __future__ import annotations

import csv
import json
import sys
import types

import pytest

from attnquant_cli import cli
from attnquant_cli._analyze import CSV_FIELDS
from attnquant_cli._bench import (
    Sample,
    bench_pair,
    bench_table,
    exit_code,
    prompt_ids,
    summarize,
    verdict_line,
)
from attnquant_cli._console import Output
from attnquant_core import LoadReading, PairedRuns, machine_load
from attnquant_core.testing import make_weights, write_checkpoint


@pytest.fixture
def src(tmp_path):
    return write_checkpoint(tmp_path / "src", make_weights(4))


def test_analyze_writes_table_csv_json_png(src, tmp_path, capsys):
    out = tmp_path / "an"
    assert (
        cli(["analyze", str(src), "--blocks", "1,2,layers", "--rank", "0,4", "-o", str(out)]) == 0
    )
    table = capsys.readouterr().out
    assert "per-layer SVD error" in table
    rows = list(csv.DictReader((out / "analyze.csv").read_text().splitlines()))
    assert tuple(rows[0]) == CSV_FIELDS
    families = {r["family"] for r in rows}
    assert "total" in families
    assert len(families) == 8  # seven projections and the total
    assert len(rows) == 8 * 3 * 2
    data = json.loads((out / "analyze.json").read_text())
    assert data["blocks"] == [1, 2, 4]
    assert data["ranks"] == [0, 4]
    assert {"points", "svd_curve", "checkpoint"} <= set(data)
    assert set(data["points"][0]) == set(CSV_FIELDS) - {"budget", "forms"}
    assert data["budget_frontier"] == []
    assert {"rank", "stored_parameters", "compression", "error"} <= set(data["svd_curve"][0])
    assert (out / "analyze.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob(".tmp-*"))


def test_analyze_refuses_bad_lists(src, tmp_path, capsys):
    assert cli(["analyze", str(src), "--rank", "0,x", "-o", str(tmp_path / "a")]) == 2
    assert "'x' is not an integer" in capsys.readouterr().err


def _fake_model(name: str, calls: list[str]):
    """A runner as :func:`generate_runner` makes them: records ``name:n`` for each generation."""
    return lambda ids, n: calls.append(f"{name}:{n}")


def test_bench_pair_runs_abba_pairs_after_counted_warmup():
    calls: list[str] = []
    runs = bench_pair(
        _fake_model("base", calls),
        _fake_model("theta", calls),
        [1, 2, 3],
        pairs=4,
        new_tokens=5,
        warmup=2,
    )
    assert runs.pairs == 4 and runs.warmup == 2
    assert len(runs.a) == len(runs.b) == 4
    firsts = [c.split(":")[0] for c in calls if c.endswith(":1")]  # one per run: its TTFT
    assert firsts[:4] == ["theta", "base", "theta", "base"]  # warm-up, discarded
    assert firsts[4:] == ["theta", "base", "base", "theta", "theta", "base", "base", "theta"]
    assert runs.order_string() == "ABBAABBA"


def test_bench_pair_reports_each_timed_run():
    seen: list[tuple[str, int]] = []
    bench_pair(
        lambda ids, n: None,
        lambda ids, n: None,
        [1],
        pairs=3,
        new_tokens=2,
        warmup=1,
        on_sample=lambda name, pair, sample: seen.append((name, pair)),
    )
    assert seen == [("theta", 0), ("base", 0), ("base", 1), ("theta", 1), ("theta", 2), ("base", 2)]


def _runs(theta_speed: float, *, pairs: int = 8, noise: float = 0.0):
    """Paired samples of a base at 50 tok/s and a THETA ``theta_speed`` times as fast."""
    wobble = [1.0 + noise * (-1) ** i * (i % 3) for i in range(pairs)]

    def sample(speed: float) -> Sample:
        return Sample(ttft_s=1.0 / speed, prefill_tok_s=100.0 * speed, decode_tok_s=50.0 * speed)

    return PairedRuns(
        a=tuple(sample(theta_speed * w) for w in wobble),
        b=tuple(sample(1.0) for _ in wobble),
        a_first=tuple(i % 2 == 0 for i in range(pairs)),
        warmup=1,
    )


def test_summarize_schema_and_load():
    before = LoadReading(
        time=0.0, loadavg=(1.5, 1.0, 0.5), steal_ticks=0, busy_ticks=10, total_ticks=100
    )
    after = LoadReading(
        time=5.0, loadavg=(2.0, 1.2, 0.6), steal_ticks=3, busy_ticks=90, total_ticks=200
    )
    load = machine_load(before, after)
    result = summarize(_runs(0.96, noise=0.01), gate=0.8, load=load)
    assert result["mode"] == "gate" and result["verdict"] == "pass" and result["exit_code"] == 0
    assert result["ratios"]["decode_tok_s"]["ratio"] == pytest.approx(0.96, rel=0.01)
    assert {"ci_low", "ci_high", "half_width", "n", "method"} <= set(result["ratios"]["ttft_s"])
    assert result["pairs"] == 8 and result["warmup_runs"] == {"base": 1, "theta": 1}
    assert result["order"] == "TBBT" * 4
    assert set(result["medians"]) == {"base", "theta"}
    assert len(result["samples"]["theta"]) == 8
    assert result["load"]["steal_fraction"] == pytest.approx(0.03)
    assert result["load"]["loadavg_before"] == [1.5, 1.0, 0.5]
    json.dumps(result)  # JSON-ready


@pytest.mark.parametrize(
    ("speed", "noise", "gate", "verdict", "code"),
    [
        (1.0, 0.02, 0.8, "pass", 0),
        (0.5, 0.02, 0.8, "fail", 1),
        (0.8, 0.05, 0.8, "inconclusive", 3),
    ],
)
def test_gate_verdict_and_exit_code(speed, noise, gate, verdict, code):
    result = summarize(_runs(speed, noise=noise), gate=gate)
    assert result["verdict"] == verdict
    assert exit_code(result) == code
    assert verdict_line(result).startswith(f"gate {gate}: {verdict} (decode THETA/BASE ")


@pytest.mark.parametrize(
    ("speed", "verdict", "code"), [(1.0, "contains 1.0", 0), (1.3, "excludes 1.0", 1)]
)
def test_aa_mode_reports_the_resolution(speed, verdict, code):
    result = summarize(_runs(speed, noise=0.03), gate=None)
    assert result["mode"] == "a/a" and result["gate"] is None
    assert result["verdict"] == verdict and exit_code(result) == code
    line = verdict_line(result)
    assert line.startswith("A/A: decode THETA/BASE ") and "a real difference must exceed ±" in line
    assert result["resolution"]["decode_tok_s"] == result["ratios"]["decode_tok_s"]["half_width"]


def test_bench_table_shows_intervals_and_load(capsys):
    load = machine_load(
        LoadReading(time=0.0, loadavg=(3.0, 2.0, 1.0), steal_ticks=0, busy_ticks=0, total_ticks=0),
        LoadReading(
            time=1.0, loadavg=(3.5, 2.0, 1.0), steal_ticks=5, busy_ticks=90, total_ticks=100
        ),
    )
    result = summarize(_runs(1.0, noise=0.02), gate=0.8, load=load)
    Output().print_table(bench_table(result, title="bench T against B", load=load))
    text = capsys.readouterr().out
    assert "bench T against B" in text and "theta/base" in text and "half-width" in text
    assert "load 3.00 -> 3.50" in text and "5.0% stolen" in text


class _FakeLoaded:
    """What ``load_pipeline`` returns, as far as ``bench`` uses it: speed set by the path."""

    def __init__(self, path, speed: float) -> None:
        self.path, self.speed, self.closed = path, speed, False
        self.model = self
        self.encode = lambda text: list(text.encode())

    def generate(self, batch, *, max_new_tokens, top_k, ignore_eos):
        return self.speed

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def fake_max(monkeypatch):
    """``attnquant bench`` without MAX: fake pipelines whose speed is read back as the sample.

    A stand-in ``attnquant_max`` module holds what bench imports, so these tests run where
    attnquant-max (the ``serve`` extra) is not installed, as in the tests-cli session.
    """
    from attnquant_cli import _bench
    from attnquant_core.serving import ServingOptions

    attnquant_max = types.ModuleType("attnquant_max")
    attnquant_max.STOCK = ServingOptions(path="precompute-outside")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "attnquant_max", attnquant_max)

    speeds: dict[str, float] = {}
    loaded: list[_FakeLoaded] = []
    count = iter(range(10_000))

    def load_pipeline(path, *, options, **kwargs):
        model = _FakeLoaded(path, speeds.get(path.name, 1.0))
        loaded.append(model)
        return model

    def measure(generate, prompt, new_tokens):
        wobble = 1.0 + 0.02 * ((next(count) * 7) % 5 - 2)  # deterministic noise, +-4%
        speed = generate(prompt, new_tokens) * wobble
        return Sample(ttft_s=1.0 / speed, prefill_tok_s=100.0 * speed, decode_tok_s=50.0 * speed)

    class Plan:
        def describe(self) -> str:
            return "path: fake"

    attnquant_max.load_pipeline = load_pipeline  # type: ignore[attr-defined]
    attnquant_max.plan_serving = lambda path, options: Plan()  # type: ignore[attr-defined]
    # The fake checkpoints hold no tensors; bench's digest check is tested in the reliability suite.
    monkeypatch.setenv("ATTNQUANT_VERIFY_DIGESTS", "0")
    monkeypatch.setattr(_bench, "measure", measure)
    return speeds, loaded


@pytest.mark.parametrize(
    ("speed", "gate", "code", "verdict"),
    [(1.0, 0.8, 0, "pass"), (0.5, 0.8, 1, "fail"), (1.0, 1.0, 3, "inconclusive")],
)
def test_bench_command_exit_codes(fake_max, tmp_path, capsys, speed, gate, code, verdict):
    speeds, loaded = fake_max
    theta = tmp_path / "theta"
    theta.mkdir()
    speeds["theta"] = speed
    out = tmp_path / "bench.json"
    argv = ["bench", "demo", str(theta), "--gate", str(gate), "--repetitions", "8", "-o", str(out)]
    assert cli(argv) == code
    result = json.loads(out.read_text())
    assert result["verdict"] == verdict and result["exit_code"] == code
    assert result["load"]["cpus"] >= 1 and result["warmup_runs"] == {"base": 1, "theta": 1}
    assert f"gate {gate}: {verdict}" in capsys.readouterr().out
    assert all(m.closed for m in loaded)


def test_bench_command_aa_mode(fake_max, tmp_path, capsys):
    out = tmp_path / "aa.json"
    assert (
        cli(["bench", "demo", "demo", "--repetitions", "6", "--warmup", "2", "-o", str(out)]) == 0
    )
    result = json.loads(out.read_text())
    assert result["mode"] == "a/a" and result["verdict"] == "contains 1.0"
    assert result["warmup_runs"] == {"base": 2, "theta": 2} and result["pairs"] == 6
    captured = capsys.readouterr()
    assert "A/A check: BASE against itself" in captured.err
    assert "a real difference must exceed ±" in captured.out


def test_bench_help_documents_aa_and_exit_codes(capsys):
    assert cli(["bench", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "attnquant bench BASE BASE" in text
    assert "3 inconclusive" in text and "0 pass" in text and "1 fail" in text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--repetitions", "5"], "--repetitions"),
        (["--order", "aabb"], "--order 'aabb': use 'abba' or 'random'"),
        (["--warmup", "-1"], "--warmup"),
    ],
)
def test_bench_refuses_bad_options(argv, message, capsys):
    assert cli(["bench", "demo", "demo", *argv]) == 2
    assert message in capsys.readouterr().err


def test_prompt_ids_has_the_requested_length():
    ids = prompt_ids(lambda text: list(text.encode()), 1000)
    assert len(ids) == 1000
