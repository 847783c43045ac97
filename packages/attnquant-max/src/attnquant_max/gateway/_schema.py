"""What the gateway accepts: every field of OpenAI's completions and chat schemas, checked
before a request reaches MAX, so that no value can take the model worker down.

MAX 26.7 validates most fields itself, but not all: a prompt token id outside the vocabulary
kills its model worker (and with it the server), an echo request on a model built without
``enable_echo`` does the same, a seed past 2**64 answers 500, and ``logit_bias``, ``suffix``
and ``n > 1`` are dropped without a word. Here each field gets its type and range checked and a
one-line reason when refused (:class:`RequestError`, HTTP 4xx), and what MAX does not do is
either done by the gateway (``n``, stop sequences, echo's text, ``max_tokens: 0``) or refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ModelFacts", "RequestError", "RequestPlan", "check_chat", "check_completion"]

#: Choices one request may ask for (each one a request to MAX).
MAX_N = 16
#: Prompts in one completions request, and messages in one chat request.
MAX_PROMPTS = 256
MAX_MESSAGES = 256
#: Stop sequences per request (OpenAI's limit) and the longest one, in characters.
MAX_STOPS = 4
MAX_STOP_CHARS = 256
#: MAX 26.7's range of top log-probabilities per token.
MAX_LOGPROBS = 7
#: Seeds MAX can serialize (it answers 500 past these).
SEED_RANGE = (0, 2**63 - 1)


class RequestError(Exception):
    """A request the gateway refuses: an HTTP status and a one-line reason naming the field."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param

    @property
    def kind(self) -> str:
        """OpenAI's error ``type`` for the status."""
        return {404: "not_found_error", 413: "invalid_request_error"}.get(
            self.status, "invalid_request_error"
        )

    def body(self) -> dict[str, Any]:
        """The OpenAI error envelope."""
        return {
            "error": {
                "message": str(self),
                "type": self.kind,
                "param": self.param,
                "code": str(self.status),
            }
        }


@dataclass(frozen=True)
class ModelFacts:
    """What the gateway knows of the served model: enough to check a request against it."""

    name: str
    vocab_size: int  # token ids must be below this
    max_length: int  # prompt plus completion, in tokens
    echo: bool  # built with enable_echo: prompt log-probabilities can be served


@dataclass
class RequestPlan:
    """A checked request: the body to send MAX (once per choice) and what the gateway does."""

    kind: str  # "completion" or "chat"
    body: dict[str, Any]  # for MAX, once per choice: no n, no echo text
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    stop: tuple[str, ...] = ()
    echo: bool = False  # completions: prepend the prompt to each choice's text
    prompt_logprobs: bool = False  # echo with logprobs: MAX returns them, realigned here
    logprobs: bool = False  # asked for (else null in every answer)
    sampled_only: bool = False  # completions' logprobs 0: MAX asked for 1, cut back here
    zero_tokens: bool = False  # max_tokens == 0: one token asked of MAX, then dropped
    prompts: list[str | list[int]] = field(default_factory=list)

    def body_for(self, j: int) -> dict[str, Any]:
        """The body of MAX request ``j`` of ``n``: a seeded request gets seeds ``seed + j``, so
        that its ``n`` choices differ and are each reproducible."""
        if j == 0 or self.body.get("seed") is None:
            return self.body
        return {**self.body, "seed": (self.body["seed"] + j) % (SEED_RANGE[1] + 1)}


# -- field checks --------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)  # type: ignore[arg-type]


def _integer(name: str, lo: int, hi: int) -> Callable[[object], None]:
    def check(value: object) -> None:
        if not _is_int(value):
            raise RequestError(f"{name} must be an integer, got {_show(value)}", param=name)
        if not lo <= value <= hi:  # type: ignore[operator]
            raise RequestError(f"{name} must be in [{lo}, {hi}], got {value}", param=name)

    return check


def _number(name: str, lo: float, hi: float) -> Callable[[object], None]:
    def check(value: object) -> None:
        if not _is_number(value):
            raise RequestError(f"{name} must be a finite number, got {_show(value)}", param=name)
        if not lo <= value <= hi:  # type: ignore[operator]
            raise RequestError(f"{name} must be in [{lo:g}, {hi:g}], got {value}", param=name)

    return check


def _boolean(name: str) -> Callable[[object], None]:
    def check(value: object) -> None:
        if not isinstance(value, bool):
            raise RequestError(f"{name} must be true or false, got {_show(value)}", param=name)

    return check


def _string(name: str, *, max_chars: int = 1 << 20) -> Callable[[object], None]:
    def check(value: object) -> None:
        _text(name, value, max_chars=max_chars)

    return check


def _text(name: str, value: object, *, max_chars: int = 1 << 20) -> str:
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string, got {_show(value)}", param=name)
    if len(value) > max_chars:
        raise RequestError(f"{name} is longer than {max_chars} characters", param=name)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise RequestError(f"{name} holds an unpaired UTF-16 surrogate", param=name) from None
    return value


def _show(value: object) -> str:
    """A value as a refusal names it: its JSON type, and itself when short."""
    kinds = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}
    kind = "null" if value is None else kinds.get(type(value), f"a {type(value).__name__}")
    if isinstance(value, dict):
        kind = "an object"
    elif isinstance(value, list):
        kind = "an array"
    text = repr(value)
    return f"{kind} ({text})" if len(text) <= 40 and not isinstance(value, dict | list) else kind


def _token_ids(name: str, ids: list[object], facts: ModelFacts) -> list[int]:
    if not ids:
        raise RequestError(f"{name} is an empty list of token ids", param=name)
    if len(ids) > facts.max_length:
        raise RequestError(
            f"{name} holds {len(ids)} tokens; the model's window is {facts.max_length}",
            param=name,
        )
    for token in ids:
        if not _is_int(token):
            raise RequestError(f"{name} holds {_show(token)}, not a token id", param=name)
        if not 0 <= token < facts.vocab_size:  # type: ignore[operator]
            raise RequestError(
                f"{name} holds token id {token}, outside the vocabulary [0, {facts.vocab_size})",
                param=name,
            )
    return ids  # type: ignore[return-value]


def _prompts(value: object, facts: ModelFacts) -> list[str | list[int]]:
    """``prompt`` as a list of prompts: a string, token ids, or a list of either."""
    if isinstance(value, str):
        return [_text("prompt", value)]
    if not isinstance(value, list) or not value:
        raise RequestError(
            f"prompt must be a string, a list of strings or token ids, got {_show(value)}",
            param="prompt",
        )
    if all(_is_int(v) for v in value):
        return [_token_ids("prompt", value, facts)]
    if len(value) > MAX_PROMPTS:
        raise RequestError(f"prompt holds {len(value)} prompts; at most {MAX_PROMPTS}")
    if all(isinstance(v, str) for v in value):
        return [_text("prompt", v) for v in value]
    if all(isinstance(v, list) for v in value):
        return [_token_ids("prompt", v, facts) for v in value]
    raise RequestError(
        "prompt must be a string, a list of strings, token ids or lists of token ids, not a mix",
        param="prompt",
    )


def _stops(value: object) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS:
        raise RequestError(
            f"stop must be a string or a list of at most {MAX_STOPS} strings", param="stop"
        )
    out = tuple(_text("stop", s, max_chars=MAX_STOP_CHARS) for s in stops)
    if any(not s for s in out):
        raise RequestError("stop holds an empty string", param="stop")
    return out


def _stream_options(body: Mapping[str, Any]) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not body.get("stream"):
        raise RequestError("stream_options is only allowed with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError(
            "stream_options must be an object with at most include_usage", param="stream_options"
        )
    _boolean("stream_options.include_usage")(options.get("include_usage", False))
    return bool(options.get("include_usage", False))


def _stop_token_ids(facts: ModelFacts) -> Callable[[object], None]:
    def check(value: object) -> None:
        if not isinstance(value, list) or len(value) > 64:
            raise RequestError("stop_token_ids must be a list of at most 64 token ids")
        if value:
            _token_ids("stop_token_ids", value, facts)

    return check


def _refuse(name: str, reason: str, allowed: Callable[[object], bool]) -> Callable[[object], None]:
    def check(value: object) -> None:
        if not allowed(value):
            raise RequestError(f"{name} {reason}", param=name)

    return check


def _sampling(facts: ModelFacts) -> dict[str, Callable[[object], None]]:
    """Fields completions and chat share, with MAX's sampling extensions."""
    window = facts.max_length
    return {
        "temperature": _number("temperature", 0.0, 2.0),
        "top_p": _number("top_p", 0.0, 1.0),
        "n": _integer("n", 1, MAX_N),
        "stream": _boolean("stream"),
        "presence_penalty": _number("presence_penalty", -2.0, 2.0),
        "frequency_penalty": _number("frequency_penalty", -2.0, 2.0),
        "seed": _integer("seed", *SEED_RANGE),
        "user": _string("user", max_chars=1024),
        "max_tokens": _integer("max_tokens", 0, window),
        # MAX's extensions (vLLM's names)
        "top_k": _integer("top_k", -1, facts.vocab_size),
        "min_p": _number("min_p", 0.0, 1.0),
        "repetition_penalty": _number("repetition_penalty", 0.01, 2.0),
        "min_tokens": _integer("min_tokens", 0, window),
        "ignore_eos": _boolean("ignore_eos"),
        "stop_token_ids": _stop_token_ids(facts),
        "logit_bias": _refuse(
            "logit_bias", "is not supported (MAX would ignore it)", lambda v: v in (None, {})
        ),
    }


def _check_fields(
    body: object, checks: Mapping[str, Callable[[object], None]], required: tuple[str, ...]
) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_show(body)}")
    unknown = sorted(set(body) - set(checks) - {"stop", "stream_options", "model", *required})
    if unknown:
        raise RequestError(f"unknown field {unknown[0]!r}", param=unknown[0])
    for name in required:
        if body.get(name) is None:
            raise RequestError(f"{name} is required", param=name)
    for name, check in checks.items():
        if body.get(name) is not None:
            check(body[name])
    return body


def _model(body: Mapping[str, Any], facts: ModelFacts) -> None:
    model = body.get("model")
    if model is None:
        raise RequestError("model is required", param="model")
    if model != facts.name:
        name = _text("model", model, max_chars=256)
        raise RequestError(
            f"model {name!r} is not served here; this server serves {facts.name!r}",
            status=404,
            param="model",
        )


def _plan(kind: str, body: dict[str, Any], stops: tuple[str, ...]) -> RequestPlan:
    """The parts every plan shares; ``body`` is forwarded without n (one request per choice).

    Stop sequences go to MAX too, which then ends generation early, but the gateway cuts the
    text itself: MAX 26.7 returns the stop string in a completion's text, and answers a
    non-streamed completion with a stop sequence 400."""
    forward = {k: v for k, v in body.items() if v is not None and k != "n"}
    return RequestPlan(
        kind=kind,
        body=forward,
        n=body.get("n") or 1,
        stream=bool(body.get("stream")),
        include_usage=_stream_options(body),
        stop=stops,
        logprobs=body.get("logprobs") is not None and body["logprobs"] is not False,  # 0 asks
    )


def check_completion(body: object, facts: ModelFacts) -> RequestPlan:
    """Check a ``/v1/completions`` body; raise :class:`RequestError` or return its plan."""
    checks = {
        **_sampling(facts),
        "prompt": lambda v: None,  # checked below, into a list of prompts
        "echo": _boolean("echo"),
        "logprobs": _integer("logprobs", 0, MAX_LOGPROBS),
        "best_of": _integer("best_of", 1, MAX_N),
        "suffix": _refuse("suffix", "is not supported", lambda v: v in (None, "")),
    }
    body = _check_fields(body, checks, ("model", "prompt"))
    _model(body, facts)
    prompts = _prompts(body["prompt"], facts)
    stops = _stops(body.get("stop"))
    n = body.get("n") or 1
    if body.get("best_of") not in (None, n):
        raise RequestError("best_of other than n is not supported", param="best_of")
    echo = bool(body.get("echo"))
    logprobs = body.get("logprobs") is not None
    if echo and (stops or body.get("stream")):
        raise RequestError("echo is served without stream and stop; send them apart")
    if echo and logprobs and not facts.echo:
        raise RequestError(
            "echo with logprobs needs a server started with --echo (prompt log-probabilities)",
            param="echo",
        )
    plan = _plan("completion", body, stops)
    plan.body.pop("best_of", None)
    plan.prompts = prompts
    plan.echo = echo
    plan.prompt_logprobs = echo and logprobs
    if not plan.prompt_logprobs:
        plan.body.pop("echo", None)  # the gateway prepends the prompt text itself
    if logprobs:  # the ids give tokens and text_offset; MAX 26.7 returns none for logprobs 0
        plan.body["return_token_ids"] = True
        plan.sampled_only = plan.body["logprobs"] == 0
        plan.body["logprobs"] = max(plan.body["logprobs"], 1)
    if body.get("max_tokens") == 0:
        if plan.stream or stops:
            raise RequestError("max_tokens 0 is served without stream and stop")
        plan.zero_tokens = True
        plan.body["max_tokens"] = 1
    return plan


_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def _messages(value: object) -> None:
    if not isinstance(value, list) or not value:
        raise RequestError("messages must be a non-empty list", param="messages")
    if len(value) > MAX_MESSAGES:
        raise RequestError(f"messages holds {len(value)} messages; at most {MAX_MESSAGES}")
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise RequestError(f"{where} must be an object, got {_show(message)}", param=where)
        unknown = sorted(set(message) - {"role", "content", "name"})
        if unknown:
            raise RequestError(f"{where} has an unsupported field {unknown[0]!r}", param=where)
        if message.get("role") not in _ROLES:
            raise RequestError(f"{where}.role must be one of {sorted(_ROLES)}", param=where)
        if "name" in message:
            _text(f"{where}.name", message["name"], max_chars=256)
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                if not (isinstance(part, dict) and part.get("type") == "text" and len(part) == 2):
                    raise RequestError(
                        f"{where}.content parts must be {{'type': 'text', 'text': ...}}",
                        param=where,
                    )
                _text(f"{where}.content", part.get("text"))
        elif not (content is None and message["role"] == "assistant"):
            _text(f"{where}.content", content)


def check_chat(body: object, facts: ModelFacts) -> RequestPlan:
    """Check a ``/v1/chat/completions`` body; raise :class:`RequestError` or return its plan."""
    checks = {
        **_sampling(facts),
        "messages": _messages,
        "max_completion_tokens": _integer("max_completion_tokens", 0, facts.max_length),
        "logprobs": _boolean("logprobs"),
        "top_logprobs": _integer("top_logprobs", 0, MAX_LOGPROBS),
        "response_format": _refuse(
            "response_format",
            "other than {'type': 'text'} is not supported",
            lambda v: v == {"type": "text"},
        ),
    }
    body = _check_fields(body, checks, ("model", "messages"))
    _model(body, facts)
    if body.get("top_logprobs") is not None and not body.get("logprobs"):
        raise RequestError("top_logprobs needs logprobs: true", param="top_logprobs")
    if 0 in (body.get("max_tokens"), body.get("max_completion_tokens")):
        raise RequestError("max_tokens must be at least 1 in a chat request", param="max_tokens")
    return _plan("chat", body, _stops(body.get("stop")))
