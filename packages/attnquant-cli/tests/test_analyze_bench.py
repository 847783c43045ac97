"""``attnquant analyze`` outputs (schema, files) and the bench loop's bookkeeping."""

from __future__ import annotations

import csv
import json

import pytest

from attnquant_cli import cli
from attnquant_cli._analyze import CSV_FIELDS
from attnquant_cli._bench import Sample, bench_pair, prompt_ids, summarize
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


def test_bench_pair_interleaves_and_alternates_order():
    calls: list[str] = []

    def runner(name):
        return lambda ids, n: calls.append(f"{name}:{n}")

    samples = bench_pair(
        {"base": runner("base"), "theta": runner("theta")}, [1, 2, 3], repetitions=4, new_tokens=5
    )
    assert [len(v) for v in samples.values()] == [4, 4]
    firsts = [c.split(":")[0] for c in calls[4:] if c.endswith(":1")]  # after the warm-up
    assert firsts == ["base", "theta", "theta", "base", "base", "theta", "theta", "base"]


def test_summarize_schema():
    base = [Sample(ttft_s=0.1, prefill_tok_s=100.0 + i, decode_tok_s=50.0 + i) for i in range(5)]
    theta = [Sample(ttft_s=0.1, prefill_tok_s=100.0 - i, decode_tok_s=50.0 - i) for i in range(5)]
    result = summarize({"base": base, "theta": theta}, base="base", theta="theta", gate=0.8)
    assert result["ratios"]["decode_tok_s"]["ratio"] == pytest.approx(48 / 52)
    assert result["passed"] is True
    assert set(result["medians"]) == {"base", "theta"}
    assert len(result["samples"]["theta"]) == 5


def test_prompt_ids_has_the_requested_length():
    ids = prompt_ids(lambda text: list(text.encode()), 1000)
    assert len(ids) == 1000
