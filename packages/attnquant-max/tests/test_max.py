"""Real MAX loads of the tiny Llama (one graph shape for the whole suite), on CPU."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from attnquant_core import BandMismatchError
from attnquant_core.serving import DEFAULT_WORKER_NICE
from attnquant_max import (
    NEAR_TIE,
    LoadedModel,
    ParityReport,
    ServingOptions,
    ThetaWeightAdapter,
    TokenScores,
    WeightKeyError,
    decode_logprobs,
    decode_step_logits,
    greedy_generate,
    greedy_logprobs,
    logit_parity,
    plan_serving,
    serve_command,
    serve_env,
)
from attnquant_max._workers import runtime_workers
from attnquant_max.testing import VOCAB

from .conftest import LAYERS, MAX_BATCH_SIZE, MAX_LENGTH, PROJECTIONS, load_tiny

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("stock")]

PROMPTS = ["hello world", "The quick brown fox", "attnquant"]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MAX_SERVE_DISABLE_TELEMETRY", "1")


def _load(path: Path, config: ServingOptions | None = None) -> LoadedModel:
    return load_tiny(path, config)


def test_architectures_wrap_the_stock_ones() -> None:
    from max.graph.weights import WeightsFormat

    from attnquant_max.attnquant_architectures import ARCHITECTURES

    by_name = {arch.name: arch for arch in ARCHITECTURES}
    assert "LlamaForCausalLM" in by_name
    assert {"Gemma3ForCausalLM", "Gemma4ForConditionalGeneration"} <= by_name.keys()
    adapter = by_name["LlamaForCausalLM"].weight_adapters[WeightsFormat.safetensors]
    assert isinstance(adapter, ThetaWeightAdapter)
    assert pickle.loads(pickle.dumps(adapter)) == adapter  # max serve pickles it
    assert by_name["Gemma4ForConditionalGeneration"].pipeline_model.__name__ == "Gemma4ThetaModel"


def test_gguf_checkpoints_keep_the_stock_adapter() -> None:
    """A GGUF Llama (MAX's CPU q4_0/q4_k) is loaded as MAX loads it, not by the theta adapter."""
    from max.graph.weights import WeightsFormat
    from max.pipelines.architectures.llama3 import arch as stock
    from max.pipelines.architectures.llama3 import weight_adapters

    from attnquant_max.attnquant_architectures import ARCHITECTURES

    llama = next(a for a in ARCHITECTURES if a.name == "LlamaForCausalLM")
    assert stock.llama_arch.weight_adapters[WeightsFormat.gguf] is (
        weight_adapters.convert_gguf_state_dict
    )
    assert llama.weight_adapters[WeightsFormat.gguf] is weight_adapters.convert_gguf_state_dict
    assert isinstance(llama.weight_adapters[WeightsFormat.safetensors], ThetaWeightAdapter)


def test_theta_serves_the_same_greedy_tokens_as_dense(
    dense_model: LoadedModel, theta_model: LoadedModel
) -> None:
    for prompt in PROMPTS:
        ids = dense_model.encode(prompt)
        assert ids == theta_model.encode(prompt)
        expected = greedy_generate(dense_model, ids, 12)
        assert len(expected) == 12
        assert greedy_generate(theta_model, ids, 12) == expected


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux's per-thread nice")
def test_a_cpu_load_lowers_the_runtime_workers(dense_model: LoadedModel) -> None:
    """--worker-nice (default 19) reached MAX's CPU runtime workers, found by their names: if a
    MAX release renames them, this fails rather than the option silently doing nothing."""
    workers = runtime_workers()
    assert workers, "no MAX CPU runtime worker found by name in this process"
    assert all(os.getpriority(os.PRIO_PROCESS, tid) >= DEFAULT_WORKER_NICE for tid in workers)


def test_teacher_forced_scores_match_greedy(dense_model: LoadedModel) -> None:
    ids = dense_model.encode(PROMPTS[0])
    continuation = greedy_generate(dense_model, ids, 6)
    scores = greedy_logprobs(dense_model, ids, continuation)
    assert scores.logprobs.shape == (6,)
    assert np.all(scores.logprobs <= 0.0)
    assert scores.greedy.tolist() == continuation  # greedy tokens are the argmax
    assert scores.margin is not None and np.all(scores.margin >= 0.0)


def test_decode_steps_score_a_forced_continuation_as_whole_prefixes_do(
    dense_model: LoadedModel,
) -> None:
    """Teacher forcing through decode steps (KV cache, one row a step) gives what each prefix's
    whole forward gives, on a continuation that is not the model's own greedy one."""
    ids = dense_model.encode(PROMPTS[0])
    greedy = greedy_generate(dense_model, ids, 6)
    forced = [(t * 7 + 3) % VOCAB for t in greedy]  # anything but its greedy choices
    assert forced != greedy
    steps = decode_logprobs(dense_model, ids, forced)
    whole = greedy_logprobs(dense_model, ids, forced)
    np.testing.assert_allclose(steps.logprobs, whole.logprobs, rtol=0, atol=1e-4)
    assert steps.greedy.tolist() == whole.greedy.tolist()
    logits = decode_step_logits(dense_model, ids, forced)
    assert logits.shape == (len(forced), VOCAB) and logits.dtype == np.float32
    with pytest.raises(ValueError, match="non-empty"):
        decode_step_logits(dense_model, ids, [])


def test_parity_report_gives_the_base_margin_at_each_miss() -> None:
    """Misses listed by how close the base's own choice was; near-ties counted over all."""
    base = [
        TokenScores(np.log([0.5, 0.4, 0.3]), np.array([1, 2, 3]), np.array([0.05, 2.0, 0.3])),
        TokenScores(np.log([0.6, 0.2]), np.array([4, 5]), np.array([0.01, 1.0])),
    ]
    theta = [
        TokenScores(np.log([0.5, 0.4, 0.3]), np.array([9, 2, 9]), np.array([0.1, 2.0, 0.2])),
        TokenScores(np.log([0.5, 0.2]), np.array([4, 9]), np.array([0.0, 1.0])),
    ]
    report = ParityReport.from_scores(base, theta, [[1, 2, 3], [4, 5]])
    assert report.agreement == pytest.approx(2 / 5)
    assert report.miss_margins == (0.05, 0.3, 1.0)
    assert report.near_ties == sum(m < NEAR_TIE for m in (0.05, 2.0, 0.3, 0.01, 1.0)) == 2
    unknown = [TokenScores(b.logprobs, b.greedy) for b in base]
    report = ParityReport.from_scores(unknown, theta, [[1, 2, 3], [4, 5]])
    assert (report.miss_margins, report.near_ties) == ((), None)


def test_logit_parity_of_passthrough_is_native_equivalent(
    dense_model: LoadedModel, theta_model: LoadedModel
) -> None:
    report = logit_parity(dense_model, theta_model, PROMPTS, 8)
    assert report.native_equivalent
    assert report.agreement == 1.0
    assert report.max_abs_logprob_delta < 1e-4
    assert report.decode_agreement == 1.0  # the same, scored through decode steps
    assert report.decode_max_abs_logprob_delta is not None
    assert report.decode_max_abs_logprob_delta < 1e-4
    assert (report.num_prompts, report.num_tokens) == (3, 24)
    assert report.miss_margins == () and 0 <= report.near_ties <= 24


def test_adapter_decomposes_a_dense_checkpoint_at_load(
    dense_model: LoadedModel, tiny_dense: Path, tiny_theta_g1: Path
) -> None:
    """The wrapped Llama adapter, driven by MAX's own pipeline config, with G=1, r=8."""
    from max.graph.weights import WeightsFormat, load_weights

    from attnquant_max.architectures import build_architectures

    options = ServingOptions(path="precompute-outside", blocks=1, rank=8)
    arch = next(a for a in build_architectures(options) if a.name == "LlamaForCausalLM")
    adapter = arch.weight_adapters[WeightsFormat.safetensors]
    pipeline_config = dense_model.model.pipeline_config
    weights = load_weights([tiny_dense / "model.safetensors"])
    out = adapter(
        dict(weights.items()),
        huggingface_config=pipeline_config.model.huggingface_config,
        pipeline_config=pipeline_config,
    )
    expected = dict(plan_serving(tiny_theta_g1, ServingOptions(path="precompute-outside")).state())
    assert len(out) == len(expected)
    for key, array in expected.items():
        got = np.from_dlpack(out[key.removeprefix("model.")].data)
        np.testing.assert_allclose(got, array, atol=1e-4, err_msg=key)


def test_theta_missing_theta_v_fails_at_load(theta_missing_v: Path) -> None:
    with pytest.raises(BandMismatchError, match="mlp.up_proj layer 1"):
        _load(theta_missing_v).close()


def test_theta_with_other_blocks_fails_at_load(theta_other_blocks: Path) -> None:
    with pytest.raises(BandMismatchError, match=r"layers \[1\]"):
        _load(theta_other_blocks).close()


def test_missing_dense_weight_fails_at_load(dense_missing_weight: Path) -> None:
    with pytest.raises(WeightKeyError, match=r"layers\.1\.post_attention_layernorm\.weight"):
        _load(dense_missing_weight).close()


def test_theta_without_manifest_is_refused(theta_without_manifest: Path) -> None:
    with pytest.raises(WeightKeyError) as info:
        _load(theta_without_manifest).close()
    assert "no attnquant.json" in str(info.value)
    # At passthrough: theta_s, theta_U, theta_V per layer and one W0 per layer (band).
    assert f"{4 * len(PROJECTIONS) * LAYERS} theta key(s)" in str(info.value)
    assert "attnquant.shared.mlp.down_proj.0.W0" in str(info.value)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def test_max_serve_answers_from_a_theta_checkpoint(
    tiny_theta: Path, dense_model: LoadedModel, tmp_path: Path
) -> None:
    port = _free_port()
    argv = serve_command(
        tiny_theta, port=port, max_length=MAX_LENGTH, max_batch_size=MAX_BATCH_SIZE
    )
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(argv, env=serve_env(), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 480
        while True:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "max serve did not start in time"
                time.sleep(2)
        answer = _post(
            f"http://127.0.0.1:{port}/v1/completions",
            {"model": str(tiny_theta), "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0},
        )
        text = answer["choices"][0]["text"]
        ids = dense_model.encode(PROMPTS[0])
        expected = dense_model.decode(greedy_generate(dense_model, ids, 8))
        # The server's incremental detokenizer may hold back a trailing partial UTF-8 byte.
        assert text == expected[: len(text)]
        assert len(text) >= len(expected) - 1
        assert answer["usage"]["completion_tokens"] == 8
        assert "precompute-outside" in (tmp_path / "serve.log").read_text()
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
