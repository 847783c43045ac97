"""`attnquant serve`, `verify` and `generate` end to end on the demo model, through MAX for real.

Every test here serves the demo on the stock path (a dense checkpoint, or a theta checkpoint
rebuilt at load), so the suite compiles the demo's graph once; the other execution paths are
checked through the CLI on the tiny Llama (``test_paths_cli.py``).
"""

from __future__ import annotations

import json

import pytest

from attnquant_cli import cli

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.usefixtures("demo_graph")  # compiled once, by one worker (conftest.py)

PROMPT = "def "
CHAT = [{"role": "user", "content": "Write a function that reads a file."}]


def _ask(server) -> tuple[str, str]:
    client = openai.OpenAI(base_url=server.url, api_key="unused", timeout=600)
    greedy = {"temperature": 0.0, "max_tokens": 24, "extra_body": {"top_k": 1}}
    completion = client.completions.create(model=server.model, prompt=PROMPT, **greedy)
    chat = client.chat.completions.create(model=server.model, messages=CHAT, **greedy)
    return completion.choices[0].text, chat.choices[0].message.content


@pytest.mark.slow
@pytest.mark.xdist_group("serve-e2e")
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


def _verify(base, theta, tmp_path, capsys) -> tuple[int, dict, str]:
    """``attnquant verify`` on the stock graph (the cached demo graph), whatever the checkpoint:
    a compressed one would be served in the graph by default (tests/test_budget_default.py)."""
    report = tmp_path / "verify.json"
    argv = ["verify", str(base), str(theta), "-o", str(report), "--path", "precompute-outside"]
    code = cli(argv)
    return code, json.loads(report.read_text()), capsys.readouterr().out


@pytest.mark.slow
@pytest.mark.xdist_group("demo-verify")
def test_verify_passthrough_is_native_equivalent(demo, theta_dir, tmp_path, capsys):
    code, report, text = _verify(demo, theta_dir("layers", 0), tmp_path, capsys)
    assert report["max_abs_logprob_delta"] < 1e-3
    assert report["agreement"] == 1.0
    assert report["num_prompts"] == 8
    assert code == 0
    assert "verdict: native-equivalent" in text


@pytest.mark.slow
@pytest.mark.xdist_group("demo-verify")
def test_verify_compressed_reports_and_fails(demo, theta_dir, tmp_path, capsys):
    code, report, text = _verify(demo, theta_dir(1, 8), tmp_path, capsys)
    assert report["max_abs_logprob_delta"] >= 1.0 or report["agreement"] < 0.9
    assert not report["native_equivalent"]
    # One base margin per greedy miss, ascending; near-ties counted over every position.
    margins = report["miss_margins"]
    assert len(margins) == round((1 - report["agreement"]) * report["num_tokens"]) > 0
    assert margins == sorted(margins) and margins[0] >= 0.0
    assert 0 <= report["near_ties"] <= report["num_tokens"]
    assert "base top-2 margin at the misses" in text
    assert code == 1
    assert "verdict: NOT native-equivalent" in text


@pytest.mark.slow
@pytest.mark.xdist_group("demo-verify")
def test_generate_completes_python(demo, capsys):
    assert cli(["generate", str(demo), "--prompt", "import os\n", "--max-new-tokens", "16"]) == 0
    captured = capsys.readouterr()
    text = captured.out
    assert text.startswith("import os\n")
    assert len(text) > len("import os\n")
    # attnquant's lines, not MAX's: what it compiles, how long, and the ready line
    err = captured.err.splitlines()
    assert any("building and compiling the model graph" in line for line in err)
    assert any(line.startswith("attnquant: model loaded in ") for line in err)
    assert not any("Building, compiling, and initializing" in line for line in err)
