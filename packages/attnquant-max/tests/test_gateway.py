"""The gateway's request checks and answer rewrites, without a server (no MAX graph)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnquant_max.gateway import (
    ModelFacts,
    RequestError,
    StopScanner,
    check_chat,
    check_completion,
    fix_completion,
    merge_responses,
)
from attnquant_max.gateway._rewrite import parse_sse, sse, sum_usage

FACTS = ModelFacts(name="m", vocab_size=100, max_length=64, echo=True)
NO_ECHO = ModelFacts(name="m", vocab_size=100, max_length=64, echo=False)


def _completion(**fields):
    return check_completion({"model": "m", "prompt": "hi", **fields}, FACTS)


# -- stop sequences ----------------------------------------------------------------------------


def _scan(stops: list[str], pieces: list[str]) -> tuple[str, bool]:
    scanner = StopScanner(stops)
    out, stopped = "", False
    for piece in pieces:
        text, stopped = scanner.feed(piece)
        out += text
        if stopped:
            break
    if not stopped:
        out += scanner.flush()
    return out, stopped


def _first_stop(text: str, stops: list[str]) -> int:
    found = [p for p in (text.find(s) for s in stops) if p >= 0]
    return min(found) if found else -1


@settings(max_examples=300, deadline=None)
@given(
    stops=st.lists(st.text("ab\n", min_size=1, max_size=4), min_size=1, max_size=4),
    pieces=st.lists(st.text("ab\nc", max_size=6), max_size=8),
)
def test_stop_scanner_cuts_before_the_first_stop_however_the_text_is_split(stops, pieces):
    text = "".join(pieces)
    out, stopped = _scan(stops, pieces)
    cut = _first_stop(text, stops)
    assert stopped == (cut >= 0)
    assert out == (text[:cut] if cut >= 0 else text)


def test_stop_scanner_holds_back_only_a_possible_stop_start():
    scanner = StopScanner(["\nEND"])
    assert scanner.feed("abc\nE") == ("abc", False)  # "\nE" may begin "\nEND"
    assert scanner.feed("X") == ("\nEX", False)
    assert scanner.feed("y\nEND z") == ("y", True)
    assert scanner.feed("more") == ("", True)


# -- completions: what is refused, and why -----------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"prompt": [5, 100]}, "token id 100, outside the vocabulary [0, 100)"),
        ({"prompt": [5, -1]}, "token id -1"),
        ({"prompt": [[5], []]}, "empty list of token ids"),
        ({"prompt": [5, True]}, "not a mix"),
        ({"prompt": [[5, 2.5]]}, "not a token id"),
        ({"prompt": ["a", [5]]}, "not a mix"),
        ({"prompt": 17}, "prompt must be"),
        ({"prompt": list(range(65))}, "window is 64"),
        ({"max_tokens": -3}, "max_tokens must be in [0, 64]"),
        ({"max_tokens": 65}, "max_tokens must be in [0, 64]"),
        ({"max_tokens": 1.5}, "max_tokens must be an integer"),
        ({"temperature": -1}, "temperature must be in [0, 2]"),
        ({"temperature": "hot"}, "temperature must be a finite number"),
        ({"seed": 2**64}, "seed must be in"),
        ({"n": 0}, "n must be in [1, 16]"),
        ({"n": 2, "best_of": 3}, "best_of other than n"),
        ({"logprobs": 8}, "logprobs must be in [0, 7]"),
        ({"logit_bias": {"5": 100}}, "logit_bias is not supported"),
        ({"suffix": "x"}, "suffix is not supported"),
        ({"stop": ["a", "b", "c", "d", "e"]}, "at most 4"),
        ({"stop": [""]}, "empty string"),
        ({"stop": "\n", "echo": True}, "echo is served without stream and stop"),
        ({"max_tokens": 0, "stream": True}, "max_tokens 0 is served without"),
        ({"stream_options": {"include_usage": True}}, "only allowed with stream"),
        ({"prompt": "\ud800"}, "unpaired UTF-16 surrogate"),
        ({"frobnicate": 1}, "unknown field 'frobnicate'"),
        ({"stop_token_ids": [1000]}, "outside the vocabulary"),
    ],
)
def test_completion_refusals_name_the_field(fields, needle):
    with pytest.raises(RequestError) as caught:
        _completion(**fields)
    assert caught.value.status == 400
    assert needle in str(caught.value)
    assert "\n" not in str(caught.value)


def test_unknown_model_is_404_and_missing_fields_are_400():
    with pytest.raises(RequestError) as caught:
        check_completion({"model": "other", "prompt": "x"}, FACTS)
    assert caught.value.status == 404
    assert "this server serves 'm'" in str(caught.value)
    for body in ({"prompt": "x"}, {"model": "m"}, {"model": "m", "prompt": None}, [], "x", None):
        with pytest.raises(RequestError):
            check_completion(body, FACTS)


def test_echo_logprobs_on_a_server_without_echo_is_a_400_not_a_crash():
    body = {"model": "m", "prompt": "x", "echo": True, "logprobs": 1, "max_tokens": 0}
    with pytest.raises(RequestError, match="--echo"):
        check_completion(body, NO_ECHO)
    plan = check_completion({"model": "m", "prompt": "x", "echo": True}, NO_ECHO)
    assert plan.echo and "echo" not in plan.body  # the text is prepended by the gateway


def test_plan_of_an_lm_eval_loglikelihood_request():
    body = {"prompt": [[1, 2, 3]], "max_tokens": 0, "echo": True, "logprobs": 1, "seed": 1234}
    plan = _completion(**body, temperature=0)
    assert plan.prompt_logprobs and plan.zero_tokens and plan.echo
    assert plan.body["max_tokens"] == 1 and plan.body["echo"] is True
    assert plan.n == 1 and not plan.stream and plan.stop == ()


def test_plan_of_n_and_stop():
    plan = _completion(n=3, stop="\n", stream=True, stream_options={"include_usage": True})
    assert plan.n == 3 and plan.stop == ("\n",) and plan.include_usage
    assert "n" not in plan.body and plan.body["stop"] == "\n"


# -- chat ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"messages": "not a list"}, "messages must be a non-empty list"),
        ({"messages": []}, "messages must be a non-empty list"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "role must be one of"),
        ({"messages": [{"role": "user", "content": 5}]}, "content must be a string"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "parts must be"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "unsupported field"),
        ({"top_logprobs": 2}, "needs logprobs: true"),
        ({"max_tokens": 0}, "at least 1"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": []}, "unknown field 'tools'"),
    ],
)
def test_chat_refusals_name_the_field(fields, needle):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(RequestError, match=None) as caught:
        check_chat(body, FACTS)
    assert needle in str(caught.value)


def test_chat_accepts_text_parts_and_an_empty_assistant_turn():
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None},
    ]
    plan = check_chat({"model": "m", "messages": messages, "n": 2, "logprobs": True}, FACTS)
    assert plan.kind == "chat" and plan.n == 2


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)
FIELDS = st.sampled_from(
    ["prompt", "max_tokens", "temperature", "top_p", "n", "stream", "logprobs", "echo", "stop",
     "seed", "stream_options", "best_of", "suffix", "logit_bias", "top_k", "messages",
     "top_logprobs", "max_completion_tokens", "min_tokens", "stop_token_ids", "user"]
)  # fmt: skip


@settings(max_examples=400, deadline=None)
@given(fields=st.dictionaries(FIELDS, JSON, max_size=5))
def test_any_json_is_a_plan_or_a_request_error(fields):
    """Hostile values in every field: the checks refuse with RequestError or accept, never crash,
    and what they accept is JSON MAX can read (finite numbers, ids in the vocabulary)."""
    for check, base in ((check_completion, {"prompt": "x"}), (check_chat, {"messages": []})):
        try:
            plan = check({"model": "m", **base, **fields}, FACTS)
        except RequestError as exc:
            refused: RequestError | None = exc
        else:
            refused = None
            json.dumps(plan.body, allow_nan=False)
            assert 1 <= plan.n <= 16
        if refused is not None:
            assert 400 <= refused.status < 500
            json.dumps(refused.body())


# -- answers ------------------------------------------------------------------------------------


def _answer(text: str, token_logprobs: list[float], prompt_tokens: int, completion: int):
    top = [{"t": v} for v in token_logprobs]
    return {
        "choices": [
            {
                "index": 0,
                "text": text,
                "finish_reason": "length",
                "logprobs": {"token_logprobs": token_logprobs, "top_logprobs": top},
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion,
        },
    }


def test_echo_puts_the_prompt_first_and_realigns_log_probabilities():
    """MAX leaves out the first prompt token's entry: a null goes back in its place."""
    plan = _completion(prompt=[[7, 8, 9]], echo=True, logprobs=1, max_tokens=1)
    fixed = fix_completion(_answer("!", [-1.0, -2.0, -3.0], 3, 1), plan, lambda ids: "<789>")
    choice = fixed["choices"][0]
    assert choice["text"] == "<789>!"
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -2.0, -3.0]
    assert choice["logprobs"]["top_logprobs"][0] is None


def test_max_tokens_zero_drops_the_token_asked_for():
    plan = _completion(prompt="abc", echo=True, logprobs=1, max_tokens=0)
    fixed = fix_completion(_answer("!", [-1.0, -2.0, -3.0], 4, 1), plan, lambda ids: "")
    choice = fixed["choices"][0]
    assert choice["text"] == "abc"
    assert choice["logprobs"]["token_logprobs"] == [None, -1.0, -2.0]
    assert fixed["usage"] == {"prompt_tokens": 4, "completion_tokens": 0, "total_tokens": 4}


def test_n_copies_merge_with_openai_indices():
    def answer(tag):
        return {
            "choices": [{"index": i, "text": f"{tag}{i}"} for i in range(2)],
            "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7},
        }

    merged = merge_responses([answer("a"), answer("b"), answer("c")], 3)
    assert [c["text"] for c in merged["choices"]] == ["a0", "b0", "c0", "a1", "b1", "c1"]
    assert [c["index"] for c in merged["choices"]] == list(range(6))
    assert merged["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11}
    assert sum_usage([None]) is None


def test_sse_round_trip():
    event = {"choices": [{"index": 0, "text": "é\n"}]}
    line = sse(event).decode().strip()
    assert parse_sse(line) == event
    assert parse_sse("data: [DONE]") is None and parse_sse(": ping") is None


def test_collected_choice_keeps_log_probabilities_asked_for_with_logprobs_0():
    """``logprobs: 0`` asks for the sampled tokens' own log-probabilities (0 is not false)."""
    from attnquant_max.gateway._app import _choice

    stream = {"token_logprobs": [-1.5], "top_logprobs": [{}]}
    asked = _choice(_completion(logprobs=0, stop="\n"), 0, "x", "stop", stream)
    assert asked["logprobs"]["token_logprobs"] == [-1.5]
    assert _choice(_completion(stop="\n"), 0, "x", "stop", stream)["logprobs"] is None
