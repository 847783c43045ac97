"""The serving flags a command gets: a flag over its ATTNQUANT_* variable over the default."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from attnquant_cli.commands._serving import serving_flags
from attnquant_core.serving import DEFAULT_WORKER_NICE, ServingOptions


def _app(seen: list[ServingOptions]) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @serving_flags
    def run(options: ServingOptions) -> None:
        seen.append(options)

    return app


def test_worker_nice_flag_variable_and_default(monkeypatch) -> None:
    seen: list[ServingOptions] = []
    runner = CliRunner()
    monkeypatch.delenv("ATTNQUANT_WORKER_NICE", raising=False)
    assert runner.invoke(_app(seen), []).exit_code == 0
    monkeypatch.setenv("ATTNQUANT_WORKER_NICE", "3")
    assert runner.invoke(_app(seen), []).exit_code == 0
    assert runner.invoke(_app(seen), ["--worker-nice", "0"]).exit_code == 0
    assert [o.worker_nice for o in seen] == [DEFAULT_WORKER_NICE, 3, 0]


def test_worker_nice_out_of_range_is_a_usage_error() -> None:
    seen: list[ServingOptions] = []
    result = CliRunner().invoke(_app(seen), ["--worker-nice", "20"])
    assert result.exit_code == 2
    assert "--worker-nice" in result.output
    assert seen == []
