"""`attnquant serve` answering what real clients send, through MAX for real (one server start).

Every request kind lm-eval's ``local-completions`` model sends goes through the official openai
client: log-likelihood (token-id prompts, ``echo``, ``logprobs: 1``, ``max_tokens`` 0 and 1,
lists of prompts) checked position by position against the numpy forward of the demo, and
generate-until (``stop``, ``seed``, ``max_tokens``). Then ``n``, streams, chat, the tokenizer
routes, and hostile JSON bodies (hypothesis): every answer is a 200 or a 4xx, and the server
answers after each. Raw answers and stream chunks (httpx, not the lenient client) are checked
against the openai package's own types, log-probabilities null unless asked.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnquant_core.io import open_checkpoint
from attnquant_core.llama_reference import llama_logits

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")  # openai's own HTTP client

pytestmark = [
    pytest.mark.slow,
    pytest.mark.xdist_group("serve-clients"),
    pytest.mark.usefixtures("demo_graph"),
]

CONTEXT = [312, 45, 1200, 7, 88, 19]
CONTINUATIONS = [[401, 402], [5, 6, 7]]


@pytest.fixture(scope="module")
def server(serve_model, demo, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-clients") / "serve.log"
    with serve_model(demo, log, name="demo") as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url, api_key="unused", timeout=600, max_retries=0)


def _raw(server, path: str, body: object, method: str = "POST") -> tuple[int, dict | str]:
    """One request with urllib (no client-side checks): its status and decoded body."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    url = server.url.removesuffix("/v1") + path
    request = urllib.request.Request(url, data=data if method == "POST" else None, method=method)
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=600) as response:
            status, raw = response.status, response.read()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode("utf-8", "replace")


def _reference_logprobs(demo, ids: list[int]) -> np.ndarray:
    """log p(ids[t] | ids[:t]) for t >= 1, from the numpy forward of the demo (float64)."""
    ckpt = open_checkpoint(demo)
    logits = llama_logits(ckpt.config, {k: ckpt.get(k) for k in ckpt.keys()}, ids)
    logits = logits - logits.max(axis=-1, keepdims=True)
    logp = logits - np.log(np.exp(logits).sum(axis=-1, keepdims=True))
    return np.array([logp[t - 1, ids[t]] for t in range(1, len(ids))])


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_loglikelihood_request_matches_the_numpy_forward(server, client, demo, max_tokens):
    """lm-eval's log-likelihood request: one log-probability per prompt token (null first),
    each the demo's own, so ``token_logprobs[ctxlen:-1]`` (or ``[ctxlen:]`` at 0) scores the
    continuation."""
    prompts = [CONTEXT + c for c in CONTINUATIONS]
    answer = client.completions.create(
        model="demo", prompt=prompts, max_tokens=max_tokens, echo=True, logprobs=1,
        temperature=0, seed=1234,
    )  # fmt: skip
    assert [c.index for c in answer.choices] == [0, 1]
    for choice, ids in zip(answer.choices, prompts, strict=True):
        got = choice.logprobs.token_logprobs
        assert len(got) == len(ids) + max_tokens
        assert got[0] is None
        want = _reference_logprobs(demo, ids)
        np.testing.assert_allclose(got[1 : len(ids)], want, atol=2e-3)
        assert len(choice.logprobs.top_logprobs) == len(got)
        assert choice.text.startswith(_raw(server, "/detokenize", {"tokens": ids})[1]["prompt"])
    assert answer.usage.completion_tokens == (0 if max_tokens == 0 else len(prompts))


def test_loglikelihood_of_text_prompts_leaves_nothing_out(client):
    answer = client.completions.create(
        model="demo", prompt="def main():\n    return 1", max_tokens=0, echo=True, logprobs=1
    )
    choice = answer.choices[0]
    assert choice.text == "def main():\n    return 1"
    assert len(choice.logprobs.token_logprobs) == answer.usage.prompt_tokens  # BOS included
    assert all(math.isfinite(v) for v in choice.logprobs.token_logprobs[1:])


def test_generate_until_cuts_before_the_stop_string(client):
    greedy = {"model": "demo", "prompt": "def ", "temperature": 0, "max_tokens": 32, "seed": 1234}
    free = client.completions.create(**greedy).choices[0].text
    assert "\n" in free  # the demo writes code: a newline comes within 32 tokens
    cut = client.completions.create(**greedy, stop=["\n", "\n\n"]).choices[0]
    assert cut.text == free[: free.index("\n")]
    assert cut.finish_reason == "stop"
    streamed = client.completions.create(**greedy, stop="\n", stream=True)
    pieces = [(c.choices[0].text, c.choices[0].finish_reason) for c in streamed if c.choices]
    assert "".join(t for t, _ in pieces) == cut.text
    assert pieces[-1][1] == "stop"


def test_n_choices_are_honoured_in_answers_and_streams(client):
    # The demo's generation config is greedy (do_sample false): top_k makes MAX sample.
    sampled = {"temperature": 1.0, "seed": 7, "extra_body": {"top_k": 50}}
    prompts = ["def ", "import"]
    answer = client.completions.create(model="demo", prompt=prompts, max_tokens=6, n=3, **sampled)
    assert [c.index for c in answer.choices] == list(range(6))
    assert len({c.text for c in answer.choices[:3]}) > 1  # seeds seed, seed+1, seed+2 differ
    again = client.completions.create(model="demo", prompt=prompts, max_tokens=6, n=3, **sampled)
    assert [c.text for c in again.choices] == [c.text for c in answer.choices]
    stream = client.completions.create(
        model="demo", prompt="def ", max_tokens=6, n=2, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    seen, usage = set(), None
    for chunk in stream:
        seen |= {c.index for c in chunk.choices}
        usage = chunk.usage or usage
    assert seen == {0, 1}
    assert usage is not None and usage.completion_tokens == 12


def test_chat_with_stop_and_n(client):
    answer = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "Write a function."}],
        max_tokens=24, n=2, stop=[","], temperature=0,
    )  # fmt: skip
    assert [c.index for c in answer.choices] == [0, 1]
    assert all("," not in c.message.content for c in answer.choices)


def test_tokenizer_routes_are_the_ones_lm_eval_uses(server):
    status, info = _raw(server, "/tokenizer_info", None, method="GET")
    assert status == 200 and info["eos_token"] == "<|eos|>" and info["model_max_length"] == 512
    status, encoded = _raw(server, "/tokenize", {"prompt": "def f():", "add_special_tokens": False})
    assert status == 200 and encoded["count"] == len(encoded["tokens"]) > 0
    status, decoded = _raw(server, "/detokenize", {"tokens": encoded["tokens"]})
    assert status == 200 and decoded["prompt"] == "def f():"


def test_requests_that_would_have_killed_max_are_refused(server):
    """Each of these took MAX 26.7's server down or answered 500 when sent to it directly."""
    for body, needle in [
        ({"prompt": [5, 2048], "max_tokens": 1}, "outside the vocabulary"),
        ({"prompt": [-1, 5], "max_tokens": 1}, "outside the vocabulary"),
        ({"prompt": "x", "max_tokens": 1, "seed": 2**64}, "seed must be in"),
        ({"prompt": "x", "logit_bias": {"5": 100}}, "logit_bias is not supported"),
    ]:
        status, answer = _raw(server, "/v1/completions", {"model": "demo", **body})
        assert status == 400, answer
        assert needle in answer["error"]["message"]
    assert _raw(server, "/health", None, method="GET")[0] == 200


def _json(server, path: str, body: dict) -> dict:
    """A non-streamed answer's raw JSON (a 200 asserted)."""
    response = httpx.post(server.url.removesuffix("/v1") + path, json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def _chunks(server, path: str, body: dict) -> list[dict]:
    """A stream's events as raw JSON, in order; it must end with ``[DONE]``."""
    url = server.url.removesuffix("/v1") + path
    events, done = [], False
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=600) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:"):
                assert not done, "an event after [DONE]"
                data = line[5:].strip()
                done = data == "[DONE]"
                if not done:
                    events.append(json.loads(data))
    assert done
    return events


def _echoed_completion(answer: dict) -> openai.types.Completion:
    """An echo answer validated as ``openai.types.Completion``. OpenAI's own API gives the first
    echoed token a null log-probability (it has no context), in ``token_logprobs`` and in
    ``top_logprobs``, which its generated types (List[float], List[Dict[str, float]]) do not
    declare: those two entries alone are checked to be null and stood in for before validating."""
    answer = json.loads(json.dumps(answer))
    for choice in answer["choices"]:
        logprobs = choice["logprobs"]
        assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
        logprobs["token_logprobs"][0], logprobs["top_logprobs"][0] = 0.0, {}
    return openai.types.Completion.model_validate(answer)


def _completion_chunks(chunks: list[dict]) -> list[openai.types.Completion]:
    """A completions stream validated chunk by chunk as ``openai.types.Completion``. OpenAI's own
    streams send ``finish_reason: null`` until a choice's last chunk, which that type (shared with
    non-streamed answers, where it is required) does not declare; the client builds chunks without
    validating. So each choice must have one non-null ``finish_reason``, on its last chunk, and
    the nulls before it alone are stood in for before validating."""
    chunks = json.loads(json.dumps(chunks))
    last = {c["index"]: (k, c) for k, chunk in enumerate(chunks) for c in chunk["choices"]}
    for k, chunk in enumerate(chunks):
        for choice in chunk["choices"]:
            if (k, choice) == last[choice["index"]]:
                assert choice["finish_reason"] in ("stop", "length"), choice
            else:
                assert choice["finish_reason"] is None, choice
                choice["finish_reason"] = "length"
    return [openai.types.Completion.model_validate(chunk) for chunk in chunks]


def _check_tokens(choice: dict, text: str) -> None:
    """``tokens`` and ``text_offset`` as long as ``token_logprobs``; each token found at its
    offset in ``text`` (one that is not a whole character alone is not looked for)."""
    logprobs = choice["logprobs"]
    size = len(logprobs["token_logprobs"])
    assert size > 0
    assert len(logprobs["tokens"]) == len(logprobs["text_offset"]) == len(logprobs["top_logprobs"])
    assert len(logprobs["tokens"]) == size
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    for token, offset in zip(logprobs["tokens"], logprobs["text_offset"], strict=True):
        assert 0 <= offset <= len(text)
        if "\ufffd" not in token and not (token.startswith("<|") and token.endswith("|>")):
            assert text[offset:].startswith(token), (token, offset, text)


GREEDY = {"model": "demo", "temperature": 0, "seed": 1234}
CHAT = {**GREEDY, "messages": [{"role": "user", "content": "Write a function."}]}


def test_answers_are_openai_types_with_null_logprobs_unless_asked(server):
    answer = _json(server, "/v1/completions", {**GREEDY, "prompt": "def ", "max_tokens": 4})
    openai.types.Completion.model_validate(answer)
    assert answer["choices"][0]["logprobs"] is None
    assert {"token_ids", "prompt_token_ids"}.isdisjoint(answer["choices"][0])
    cut = _json(server, "/v1/completions", {**GREEDY, "prompt": "def ", "stop": "\n", "n": 2})
    openai.types.Completion.model_validate(cut)
    assert all(c["logprobs"] is None for c in cut["choices"])
    chat = _json(server, "/v1/chat/completions", {**CHAT, "max_tokens": 4})
    openai.types.chat.ChatCompletion.model_validate(chat)
    assert chat["choices"][0]["logprobs"] is None
    assert chat["choices"][0]["message"]["refusal"] is None
    asked = _json(server, "/v1/chat/completions", {**CHAT, "max_tokens": 4, "logprobs": True})
    openai.types.chat.ChatCompletion.model_validate(asked)
    assert len(asked["choices"][0]["logprobs"]["content"]) == 4
    assert asked["choices"][0]["logprobs"]["refusal"] is None


@pytest.mark.parametrize(
    "fields",
    [
        {"stream_options": {"include_usage": True}},  # one choice, no stop: MAX's own events
        {},
        {"n": 2, "stop": "\n", "stream_options": {"include_usage": True}},
    ],
)
def test_streams_are_openai_chunks_with_null_logprobs_unless_asked(server, fields):
    body = {**GREEDY, "max_tokens": 6, **fields}
    chunks = _chunks(server, "/v1/completions", {**body, "prompt": "def "})
    _completion_chunks(chunks)
    for chunk in chunks:
        assert all(c["logprobs"] is None for c in chunk["choices"])
        assert all({"token_ids", "prompt_token_ids"}.isdisjoint(c) for c in chunk["choices"])
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usage) == (1 if "stream_options" in fields else 0)
    if usage:
        assert usage[0]["prompt_tokens"] > 0 and chunks[-1]["choices"] == []
    chat = _chunks(server, "/v1/chat/completions", {**CHAT, **body})
    for chunk in chat:
        openai.types.chat.ChatCompletionChunk.model_validate(chunk)
        assert all(c["logprobs"] is None for c in chunk["choices"])
    asked = _chunks(server, "/v1/chat/completions", {**CHAT, **body, "logprobs": True})
    for chunk in asked:
        openai.types.chat.ChatCompletionChunk.model_validate(chunk)
        for choice in chunk["choices"]:
            assert choice.get("logprobs") is None or choice["logprobs"]["refusal"] is None
    assert any(c["logprobs"] and c["logprobs"]["content"] for k in asked for c in k["choices"])


@pytest.mark.parametrize("logprobs", [0, 2])
def test_completion_logprobs_carry_tokens_and_text_offsets(server, logprobs):
    body = {**GREEDY, "prompt": "def ", "max_tokens": 8, "logprobs": logprobs}
    answer = _json(server, "/v1/completions", body)
    choice = openai.types.Completion.model_validate(answer).choices[0]
    _check_tokens(answer["choices"][0], choice.text)
    assert choice.logprobs.text_offset[0] == 0
    assert "".join(choice.logprobs.tokens) == choice.text  # ASCII code: each token whole
    tops = choice.logprobs.top_logprobs
    assert all(len(t) <= logprobs + 1 for t in tops) and all(len(t) >= 1 for t in tops)
    tokens, offsets = [], []
    for chunk in _completion_chunks(_chunks(server, "/v1/completions", body)):
        for c in chunk.choices:
            tokens += c.logprobs.tokens if c.logprobs else []
            offsets += c.logprobs.text_offset if c.logprobs else []
    assert (tokens, offsets) == (choice.logprobs.tokens, choice.logprobs.text_offset)
    cut = _json(server, "/v1/completions", {**body, "max_tokens": 32, "stop": "\n"})
    cut_choice = openai.types.Completion.model_validate(cut).choices[0]
    _check_tokens(cut["choices"][0], cut_choice.text)
    assert all(offset < len(cut_choice.text) for offset in cut_choice.logprobs.text_offset)


@pytest.mark.parametrize("max_tokens", [0, 1])
@pytest.mark.parametrize("prompt", ["def main():\n    return 1", CONTEXT])
def test_echoed_logprobs_carry_tokens_and_text_offsets_from_the_prompt_on(
    server, prompt, max_tokens
):
    body = {**GREEDY, "prompt": prompt, "max_tokens": max_tokens, "echo": True, "logprobs": 1}
    answer = _json(server, "/v1/completions", body)
    choice = _echoed_completion(answer).choices[0]
    _check_tokens(answer["choices"][0], choice.text)
    assert choice.logprobs.text_offset[0] == 0
    size = answer["usage"]["prompt_tokens"] + max_tokens
    assert len(choice.logprobs.tokens) == len(choice.logprobs.token_logprobs) == size
    if isinstance(prompt, str):  # its <|bos|> is not in the text: at 0, as the next token
        assert choice.logprobs.tokens[0] == "<|bos|>" and choice.logprobs.text_offset[1] == 0
        assert choice.text.startswith(prompt)


VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 3),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12),
    st.lists(st.integers(-5, 4000), max_size=6), st.lists(st.text(max_size=4), max_size=5),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=3),
)  # fmt: skip
FIELDS = st.sampled_from(
    ["prompt", "max_tokens", "temperature", "top_p", "n", "stream", "logprobs", "echo", "stop",
     "seed", "best_of", "suffix", "presence_penalty", "frequency_penalty", "top_k", "min_p",
     "min_tokens", "ignore_eos", "stop_token_ids", "user", "stream_options", "logit_bias"]
)  # fmt: skip
CHAT_FIELDS = st.sampled_from(
    ["messages", "max_tokens", "max_completion_tokens", "temperature", "n", "stream", "stop",
     "logprobs", "top_logprobs", "seed", "response_format", "tools", "user"]
)  # fmt: skip


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    fields=st.dictionaries(FIELDS | CHAT_FIELDS, VALUES, max_size=4),
    raw=st.sampled_from([None, b"", b"{", b"[]", b'"x"', b"\xff\xfe", b"{" * 5000]),
)
def test_hostile_bodies_get_an_answer_and_the_server_stays_up(server, route, fields, raw):
    base = {"model": "demo", "max_tokens": 4}
    base |= {"prompt": "def "} if route == "/v1/completions" else {
        "messages": [{"role": "user", "content": "hi"}]
    }  # fmt: skip
    body = raw if raw is not None else {**base, **fields}
    status, answer = _raw(server, route, body)
    assert status == 200 or 400 <= status < 500, (status, answer)
    if status != 200 and isinstance(answer, dict):
        assert "\n" not in answer["error"]["message"]
    assert _raw(server, "/health", None, method="GET")[0] == 200
