"""The gateway's request checks and answer rewrites, without a server (no MAX graph)."""

from __future__ import annotations

import json
from types import SimpleNamespace

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
from attnquant_max.gateway._rewrite import (
    StreamTokens,
    TextOffsets,
    fix_chat,
    fix_chat_choice,
    keep_tokens,
    parse_sse,
    sse,
    sum_usage,
)

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
    """Where the stop that ends first begins (generation stops there), or -1."""
    found = [(p + len(s), p) for s in stops if (p := text.find(s)) >= 0]
    return min(found)[1] if found else -1


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


def test_stop_scanner_cuts_at_the_stop_that_ends_first():
    """Hypothesis found this split-dependent: "a" ends before "\na\n" completes."""
    assert _scan(["a", "\na\n"], ["\na", "\n"]) == ("\n", True)
    assert _scan(["a", "\na\n"], ["\na\n"]) == ("\n", True)


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


# -- log-probabilities: null unless asked, tokens and text_offset when asked ---------------------

#: A byte-level vocabulary: "€" is two tokens (5, 6), neither a character alone.
PIECES = {0: b"<s>", 1: b"def", 2: b" f", 3: b"(", 4: b"x", 5: b"\xe2\x82", 6: b"\xac", 7: b"\n"}


def _decode(ids: list[int]) -> str:
    return b"".join(PIECES[i] for i in ids).decode("utf-8", "replace")


def _max_completion(text, ids, prompt_ids, token_logprobs, tops=None):
    """A MAX 26.7 completions answer with ``return_token_ids``; no logprobs asked by default."""
    return {
        "choices": [
            {
                "index": 0,
                "text": text,
                "finish_reason": "length",
                "logprobs": {
                    "text_offset": None,
                    "token_logprobs": token_logprobs,
                    "tokens": None,
                    "top_logprobs": tops if tops is not None else [{} for _ in token_logprobs],
                },
                "token_ids": ids,
                "prompt_token_ids": prompt_ids,
            }
        ],
        "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids)},
    }


MAX_CHAT = {
    "choices": [
        {
            "index": 0,
            "finish_reason": "length",
            "logprobs": {"content": [], "refusal": []},
            "message": {"role": "assistant", "content": "hi", "refusal": ""},
        }
    ]
}


def _chat_plan(**fields):
    return check_chat(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}, FACTS
    )


def test_logprobs_not_asked_are_null_in_completions_and_chat():
    plan = _completion(max_tokens=2)
    assert not plan.logprobs and "return_token_ids" not in plan.body
    choice = fix_completion(_max_completion("(x", [3, 4], [0, 1], []), plan, _decode)["choices"][0]
    assert choice["logprobs"] is None
    assert "token_ids" not in choice and "prompt_token_ids" not in choice
    chat = fix_chat(json.loads(json.dumps(MAX_CHAT)), _chat_plan())["choices"][0]
    assert chat["logprobs"] is None and chat["message"]["refusal"] is None


def test_chat_logprobs_asked_keep_content_and_have_a_null_refusal():
    answer = json.loads(json.dumps(MAX_CHAT))
    answer["choices"][0]["logprobs"]["content"] = [{"token": "hi", "logprob": -1.0}]
    chat = fix_chat(answer, _chat_plan(logprobs=True))["choices"][0]
    assert chat["logprobs"] == {"content": [{"token": "hi", "logprob": -1.0}], "refusal": None}
    assert chat["message"]["refusal"] is None


def test_stream_chunks_have_null_logprobs_unless_asked():
    chunk = {"index": 0, "text": "(", "logprobs": {"token_logprobs": [], "top_logprobs": []}}
    chunk |= {"token_ids": [3], "prompt_token_ids": [0, 1]}
    StreamTokens(_decode).fill(chunk, _completion(stream=True))
    assert chunk == {"index": 0, "text": "(", "logprobs": None}
    delta = {"index": 0, "delta": {"content": "hi"}}  # MAX leaves logprobs out of chat chunks
    fix_chat_choice(delta, _chat_plan(stream=True))
    assert delta["logprobs"] is None
    asked = {"index": 0, "delta": {"content": "hi"}, "logprobs": {"content": [], "refusal": []}}
    fix_chat_choice(asked, _chat_plan(stream=True, logprobs=True))
    assert asked["logprobs"] == {"content": [], "refusal": None}


def test_completion_logprobs_get_tokens_and_offsets_into_the_completion_text():
    """Without echo the prompt is decoded only as context: offsets start at 0 in the new text,
    and the two halves of "€" share the character's offset."""
    plan = _completion(prompt="def f", logprobs=1, max_tokens=4)
    assert plan.body["return_token_ids"] is True
    answer = _max_completion("(x€", [3, 4, 5, 6], [0, 1, 2], [-1.0, -2.0, -3.0, -4.0])
    choice = fix_completion(answer, plan, _decode)["choices"][0]
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == ["(", "x", "\ufffd", "\ufffd"]
    assert logprobs["text_offset"] == [0, 1, 2, 2]
    assert logprobs["token_logprobs"] == [-1.0, -2.0, -3.0, -4.0]
    assert "token_ids" not in choice and "prompt_token_ids" not in choice


def test_echo_offsets_start_at_the_prompt_and_skip_a_bos_the_text_does_not_show():
    plan = _completion(prompt="def f", echo=True, logprobs=1, max_tokens=1)
    answer = _max_completion("(", [3], [0, 1, 2], [-1.0, -2.0, -3.0])  # MAX: no first entry
    choice = fix_completion(answer, plan, _decode)["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == "def f("
    assert logprobs["tokens"] == ["<s>", "def", " f", "("]
    assert logprobs["text_offset"] == [0, 0, 3, 5]
    assert logprobs["token_logprobs"] == [None, -1.0, -2.0, -3.0]
    assert all(len(logprobs[k]) == 4 for k in ("tokens", "text_offset", "top_logprobs"))


def test_echo_with_max_tokens_0_drops_the_extra_token_from_every_list():
    plan = _completion(prompt=[[1, 2]], echo=True, logprobs=1, max_tokens=0)
    answer = _max_completion("(", [3], [1, 2], [-1.0, -2.0])
    choice = fix_completion(answer, plan, _decode)["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"] == "def f"
    assert logprobs == {
        "text_offset": [0, 3],
        "token_logprobs": [None, -1.0],
        "tokens": ["def", " f"],
        "top_logprobs": [None, {}],
    }


def test_logprobs_0_asks_max_for_1_and_keeps_the_sampled_token_alone():
    """MAX 26.7 returns no log-probabilities at all for ``logprobs: 0``."""
    plan = _completion(logprobs=0, max_tokens=1)
    assert plan.body["logprobs"] == 1 and plan.sampled_only
    answer = _max_completion("x", [4], [0], [-2.0], tops=[{"(": -0.5, "x": -2.0}])
    logprobs = fix_completion(answer, plan, _decode)["choices"][0]["logprobs"]
    assert logprobs["top_logprobs"] == [{"x": -2.0}] and logprobs["tokens"] == ["x"]


def test_streamed_offsets_count_from_the_start_of_the_whole_completion():
    plan = _completion(prompt="def f", logprobs=1, stream=True)
    track = StreamTokens(_decode)
    offsets = []
    for k, ids in enumerate([[3], [4], [5], [6]]):
        chunk = {"index": 0, "text": "", "token_ids": ids, "logprobs": {"token_logprobs": [-1.0]}}
        if k == 0:
            chunk["prompt_token_ids"] = [0, 1, 2]
        track.fill(chunk, plan)
        assert "token_ids" not in chunk and "prompt_token_ids" not in chunk
        offsets += chunk["logprobs"]["text_offset"]
    assert offsets == [0, 1, 2, 2]


def test_text_offsets_match_the_decoded_prefix_of_real_text():
    """On text that decodes whole, each offset is the length of what the tokens before decode to."""
    ids = [1, 2, 3, 5, 6, 4, 7]
    offsets = TextOffsets(_decode).feed(ids)
    assert offsets[:4] == [len(_decode(ids[:k])) for k in range(4)]
    assert offsets[4] == offsets[3]  # the second half of "€"
    assert offsets[5:] == [len(_decode(ids[:k])) for k in (5, 6)]


def test_a_stop_keeps_only_the_tokens_inside_the_returned_text():
    logprobs = {"tokens": ["(", "x", "\n"], "text_offset": [0, 1, 2]}
    logprobs |= {"token_logprobs": [-1.0, -2.0, -3.0], "top_logprobs": [{}, {}, {}]}
    keep_tokens(logprobs, 2)
    assert logprobs == {
        "tokens": ["(", "x"],
        "text_offset": [0, 1],
        "token_logprobs": [-1.0, -2.0],
        "top_logprobs": [{}, {}],
    }
    untouched = {"token_logprobs": [-1.0]}
    keep_tokens(untouched, 0)  # no offsets (no ids from MAX): nothing to cut by
    assert untouched == {"token_logprobs": [-1.0]}


def test_collected_chat_choice_has_null_refusals():
    from attnquant_max.gateway._app import _choice

    choice = _choice(_chat_plan(logprobs=True, stop="\n"), 0, "x", "stop", {"content": []})
    assert choice["message"]["refusal"] is None and choice["logprobs"]["refusal"] is None
    assert _choice(_chat_plan(stop="\n"), 0, "x", "stop", {})["logprobs"] is None


# -- streams: every one rewritten; one choice without stops keeps MAX's events -----------------


class _FakeStream:
    """What :class:`aiohttp.ClientResponse` gives ``_events``: its lines, then close."""

    def __init__(self, events: list[dict | str]) -> None:
        self.lines = [line for e in events for line in sse(e).splitlines(keepends=True)]
        self.closed = False

    @property
    def content(self):
        async def lines():
            for line in self.lines:
                yield line

        return lines()

    def close(self) -> None:
        self.closed = True


def _streamed(plan, events: list[dict | str]) -> list[dict | str]:
    import asyncio

    from attnquant_max.gateway._app import Gateway

    tokenizer = SimpleNamespace(decode=_decode)  # all a stream's rewrite asks of a tokenizer
    gateway = Gateway(None, FACTS, tokenizer)
    stream = _FakeStream(events)

    async def run() -> list[bytes]:
        return [chunk async for chunk in gateway._merged(plan, [stream])]

    out = [line.decode() for line in asyncio.run(run())]
    assert stream.closed
    return [data if data == "[DONE]" else json.loads(data) for data in (o[6:-2] for o in out)]


USAGE = {
    "prompt_tokens": 3,
    "completion_tokens": 1,
    "total_tokens": 4,
    "prompt_tokens_details": {"cached_tokens": 0},
}


def test_one_stream_keeps_max_events_and_usage_with_logprobs_nulled():
    plan = _completion(stream=True, stream_options={"include_usage": True})
    empty = {"text_offset": None, "token_logprobs": [], "tokens": None, "top_logprobs": []}
    chunk = {"id": "a", "object": "text_completion", "usage": None, "choices": []}
    chunk["choices"] = [{"index": 0, "text": "(", "logprobs": empty, "finish_reason": "length"}]
    tail = {"id": "a", "object": "text_completion", "choices": [], "usage": USAGE}
    got = _streamed(plan, [chunk, tail, "[DONE]"])
    want = json.loads(json.dumps(chunk))
    want["choices"][0]["logprobs"] = None
    assert got == [want, tail, "[DONE]"]  # usage as MAX counted it, details included


def test_one_stream_without_usage_asked_and_an_error_event_ending_it():
    plan = _chat_plan(stream=True)
    chunk = {"id": "c", "choices": [{"index": 0, "delta": {"content": "h"}}]}
    error = {"error": {"code": "500", "message": "Internal server error.", "param": "", "type": ""}}
    got = _streamed(plan, [chunk, error])
    nulled = {"index": 0, "delta": {"content": "h"}, "logprobs": None}
    assert got == [{"id": "c", "choices": [nulled]}, error]  # no [DONE] after an error, as MAX
    assert _streamed(plan, [chunk, "[DONE]"])[-1] == "[DONE]"


def test_a_stream_error_becomes_the_collected_answer_status():
    from attnquant_max.gateway._app import _UpstreamError

    error = {"error": {"code": "400", "message": "bad", "param": "", "type": ""}}
    assert _UpstreamError.of_event(error).status == 400
    assert _UpstreamError.of_event({"error": {"code": ""}}).status == 500


def test_a_streamed_stop_drops_the_tokens_past_it():
    plan = _completion(prompt="def f", logprobs=1, stop="x", stream=True)

    def chunk(text, ids, **more):
        logprobs = {"token_logprobs": [-1.0] * len(ids), "top_logprobs": [{}] * len(ids)}
        choice = {"index": 0, "text": text, "logprobs": logprobs, "token_ids": ids, **more}
        return {"id": "a", "choices": [choice]}

    got = _streamed(plan, [chunk("(", [3], prompt_token_ids=[0, 1, 2]), chunk("x\n", [4, 7])])
    first, cut, done = got
    assert first["choices"][0]["logprobs"]["tokens"] == ["("]
    assert cut["choices"][0]["finish_reason"] == "stop" and cut["choices"][0]["text"] == ""
    assert cut["choices"][0]["logprobs"] == {
        "token_logprobs": [],
        "top_logprobs": [],
        "tokens": [],
        "text_offset": [],
    }
    assert done == "[DONE]"
