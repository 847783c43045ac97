"""`attnquant serve`, `verify` and `generate` end to end on the demo model, through MAX for real."""

from __future__ import annotations

import re

import pytest

from attnquant_cli import cli

openai = pytest.importorskip("openai")

PROMPT = "def "
CHAT = [{"role": "user", "content": "Write a function that reads a file."}]


def _ask(server) -> tuple[str, str]:
    client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=600)
    greedy = {"temperature": 0.0, "max_tokens": 24, "extra_body": {"top_k": 1}}
    completion = client.completions.create(model=server.model, prompt=PROMPT, **greedy)
    chat = client.chat.completions.create(model=server.model, messages=CHAT, **greedy)
    return completion.choices[0].text, chat.choices[0].message.content


@pytest.mark.slow
def test_served_theta_gives_the_stock_models_greedy_tokens(demo, theta_dir, serve_model, tmp_path):
    theta = theta_dir("layers", 0)
    with serve_model(theta, tmp_path / "theta.log") as server:
        theta_answers = _ask(server)
        assert server.stop() == 0  # Ctrl-C stops cleanly
    log = (tmp_path / "theta.log").read_text()
    assert "precompute-outside" in log
    assert "G=layers (passthrough), r=0" in log
    assert "server stopped" in log
    with serve_model(demo, tmp_path / "dense.log") as server:
        dense_answers = _ask(server)
    assert all(answers for answers in theta_answers)
    assert theta_answers == dense_answers


def _report(text: str) -> tuple[float, float]:
    delta = float(re.search(r"max \|logprob delta\|\s+([0-9.e+-]+)", text).group(1))
    agreement = float(re.search(r"greedy agreement\s+([0-9.]+)%", text).group(1)) / 100
    return delta, agreement


@pytest.mark.slow
def test_verify_passthrough_is_native_equivalent(demo, theta_dir, capsys):
    code = cli(["verify", str(demo), str(theta_dir("layers", 0))])
    text = capsys.readouterr().out
    delta, agreement = _report(text)
    assert delta < 1e-3
    assert agreement == 1.0
    assert code == 0
    assert "verdict: native-equivalent" in text


@pytest.mark.slow
def test_verify_compressed_reports_and_fails(demo, theta_dir, capsys):
    code = cli(["verify", str(demo), str(theta_dir(1, 8))])
    text = capsys.readouterr().out
    delta, agreement = _report(text)
    assert delta >= 1.0 or agreement < 0.9
    assert code == 1
    assert "verdict: NOT native-equivalent" in text


@pytest.mark.slow
def test_generate_completes_python(demo, capsys):
    assert cli(["generate", str(demo), "--prompt", "import os\n", "--max-new-tokens", "16"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("import os\n")
    assert len(text) > len("import os\n")
