"""What the gateway does to MAX's answers so that they mean what OpenAI's do.

* **Stop sequences** (:class:`StopScanner`): the text ends before the first stop string, which
  is not returned, and a stream holds back only what could still begin one.
* **Echo**: the prompt's text leads each choice's text; MAX 26.7 leaves the first prompt token
  out of ``token_logprobs`` (it has no context), so a ``null`` is put back in its place, one entry
  per prompt token as OpenAI's legacy API (and lm-eval's ``[ctxlen:-1]`` slice) expects.
* **max_tokens 0**: MAX was asked for one token, which is taken off again.
* **n**: one MAX request per choice; choice ``j`` of prompt ``i`` gets index ``i * n + j``.
* **Log-probabilities**: ``null`` unless asked for (MAX 26.7 sends empty lists), in answers and
  stream chunks; a completion's ``tokens`` and ``text_offset`` are filled from the token ids MAX
  returns when asked (``return_token_ids``), which the client never sees; ``logprobs: 0`` keeps
  the sampled token alone in ``top_logprobs`` (MAX was asked for 1, as it returns none for 0);
  chat's ``refusal`` is ``null``, in the message and in ``logprobs`` (MAX gives ``""`` and ``[]``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from ._schema import RequestPlan

__all__ = [
    "LISTS",
    "StopScanner",
    "StreamTokens",
    "TextOffsets",
    "choice_text",
    "fix_chat",
    "fix_chat_choice",
    "fix_completion",
    "keep_tokens",
    "merge_responses",
    "parse_sse",
    "set_choice_text",
    "sse",
    "sum_usage",
]


class StopScanner:
    """Cut one choice's text before the first of ``stops``, fed a piece at a time: the first to
    end, where generation stops (of two ending together, the one that begins first), so that the
    cut is the same however the text is split.

    :meth:`feed` returns the text that is safe to send now and whether a stop was found (the
    choice then ends, and everything after is dropped); it holds back the longest tail of what
    it has seen that could still begin a stop string, which :meth:`flush` releases at the end.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(stops)
        self.pending = ""
        self.done = False
        self.sent = 0  # characters released so far

    def feed(self, text: str) -> tuple[str, bool]:
        if self.done:
            return "", True
        buffer = self.pending + text
        found = [(p + len(s), p) for s in self.stops if (p := buffer.find(s)) >= 0]
        if found:
            self.done, self.pending = True, ""
            out = buffer[: min(found)[1]]
            self.sent += len(out)
            return out, True
        keep = 0
        for size in range(
            min(len(buffer), max((len(s) for s in self.stops), default=1) - 1), 0, -1
        ):
            if any(s.startswith(buffer[-size:]) for s in self.stops):
                keep = size
                break
        out, self.pending = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
        self.sent += len(out)
        return out, False

    def flush(self) -> str:
        out, self.pending = ("" if self.done else self.pending), ""
        self.sent += len(out)
        return out


def choice_text(kind: str, choice: dict[str, Any]) -> str:
    """A choice's new text: ``text`` (completions) or ``delta.content`` (a chat stream chunk)."""
    if kind == "completion":
        return choice.get("text") or ""
    return (choice.get("delta") or {}).get("content") or ""


def set_choice_text(kind: str, choice: dict[str, Any], text: str) -> None:
    if kind == "completion":
        choice["text"] = text
    elif choice.get("delta") is not None and (text or "content" in choice["delta"]):
        choice["delta"]["content"] = text


class TextOffsets:
    """Token ids decoded as they come: each one's character offset in the text they decode to,
    in linear time (a short window decoded again per token, as vLLM's detokenizer does).

    Text is settled once it decodes whole: a token ending inside a character (a byte-level piece
    of a multi-byte one) shares its offset with the tokens that complete the character.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.start = 0  # the window: ids[start:settled] decode to the last settled piece
        self.settled = 0
        self.length = 0  # characters settled

    def feed(self, ids: Iterable[int]) -> list[int]:
        """The offset of each of ``ids`` (in order, after every id fed before)."""
        offsets = []
        for token in ids:
            offsets.append(self.length)
            self.ids.append(token)
            before = len(self.decode(self.ids[self.start : self.settled]))
            text = self.decode(self.ids[self.start :])
            if len(text) > before and not text.endswith("\ufffd"):
                self.length += len(text) - before
                self.start, self.settled = self.settled, len(self.ids)
        return offsets


#: A completion's log-probability lists, one entry per token each.
LISTS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def _sampled_only(logprobs: dict[str, Any]) -> None:
    """``logprobs: 0``: each entry of ``top_logprobs`` made the sampled token's alone."""
    pairs = zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or [], strict=False)
    logprobs["top_logprobs"] = [None if v is None else {t: v} for t, v in pairs]


def keep_tokens(logprobs: dict[str, Any] | None, length: int) -> None:
    """Keep the entries of the tokens that begin inside the first ``length`` characters of the
    text (a stop string cut it there); nothing is cut without ``text_offset``."""
    if not logprobs or not isinstance(logprobs.get("text_offset"), list):
        return
    keep = sum(1 for offset in logprobs["text_offset"] if offset < length)
    for key in LISTS:
        if isinstance(logprobs.get(key), list):
            logprobs[key] = logprobs[key][:keep]


def _fill_tokens(
    logprobs: dict[str, Any],
    prompt_ids: list[int],
    ids: list[int],
    decode: Callable[[list[int]], str],
    *,
    echo: str | None,
    text: str,
) -> None:
    """``tokens`` and ``text_offset`` of a completion choice whose ``text`` is ``echo`` (the
    prompt's text, or None) then what ``ids`` decode to: offsets count from the text's start.

    The prompt is decoded ahead of ``ids`` for their context; its own offsets are moved so that
    its decoded text ends where ``echo`` does (a ``<bos>`` a text prompt does not show gets 0)."""
    track = TextOffsets(decode)
    prompt_offsets = track.feed(prompt_ids)
    base = track.length
    lead = len(echo) if echo is not None else 0
    tail = len(text) - lead
    offsets = [lead + min(max(o - base, 0), tail) for o in track.feed(ids)]
    tokens = [decode([token]) for token in ids]
    if echo is not None:
        shift = base - lead
        offsets = [min(max(o - shift, 0), lead) for o in prompt_offsets] + offsets
        tokens = [decode([token]) for token in prompt_ids] + tokens
    logprobs["tokens"], logprobs["text_offset"] = tokens, offsets


def fix_completion(
    response: dict[str, Any], plan: RequestPlan, decode: Callable[[list[int]], str]
) -> dict[str, Any]:
    """One MAX completions response (n=1) made to mean what OpenAI's does: echo's prompt text,
    log-probabilities (null unless asked; aligned, with ``tokens`` and ``text_offset``),
    ``max_tokens: 0``. Choice ``i`` answers prompt ``i``."""
    for choice in response.get("choices", []):
        prompt = plan.prompts[choice["index"]]
        prompt_ids = choice.pop("prompt_token_ids", None) or []
        ids = choice.pop("token_ids", None)
        logprobs = choice.get("logprobs") if plan.logprobs else None
        choice["logprobs"] = logprobs
        if plan.zero_tokens:
            choice["text"] = ""
            choice["finish_reason"] = "length"
            ids = ids[:-1] if ids else ids
            if logprobs and logprobs.get("token_logprobs"):
                for key in ("token_logprobs", "top_logprobs"):
                    if isinstance(logprobs.get(key), list):
                        logprobs[key] = logprobs[key][:-1]
        if plan.prompt_logprobs and logprobs:
            for key in ("token_logprobs", "top_logprobs"):
                if isinstance(logprobs.get(key), list):
                    logprobs[key] = [None, *logprobs[key]]
        echo = None
        if plan.echo:
            echo = prompt if isinstance(prompt, str) else decode(prompt)
            choice["text"] = echo + (choice.get("text") or "")
        if logprobs is not None and ids is not None:
            _fill_tokens(
                logprobs, prompt_ids, ids, decode, echo=echo, text=choice.get("text") or ""
            )
            if plan.sampled_only:
                _sampled_only(logprobs)
    if plan.zero_tokens and isinstance(response.get("usage"), dict):
        usage = response["usage"]
        usage["completion_tokens"] = 0
        usage["total_tokens"] = usage.get("prompt_tokens") or 0
    return response


class StreamTokens:
    """One streamed completion choice's ``tokens`` and ``text_offset``, chunk by chunk, from the
    token ids MAX sends with each (its first also carries the prompt's, decoded as context):
    offsets count from the start of the whole completion's text, as OpenAI's do."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self.decode = decode
        self.track = TextOffsets(decode)
        self.base = 0

    def fill(self, choice: dict[str, Any], plan: RequestPlan) -> None:
        """Rewrite one stream chunk's choice in place (its ids taken out)."""
        prompt_ids = choice.pop("prompt_token_ids", None)
        ids = choice.pop("token_ids", None) or []
        if not plan.logprobs:
            choice["logprobs"] = None
            return
        if prompt_ids:
            self.track.feed(prompt_ids)
            self.base = self.track.length
        offsets = [max(o - self.base, 0) for o in self.track.feed(ids)]
        logprobs = choice.get("logprobs")
        if isinstance(logprobs, dict):
            logprobs["tokens"] = [self.decode([token]) for token in ids]
            logprobs["text_offset"] = offsets
            if plan.sampled_only:
                _sampled_only(logprobs)


def fix_chat_choice(choice: dict[str, Any], plan: RequestPlan) -> None:
    """A chat choice or stream chunk's choice as OpenAI's: ``logprobs`` null unless asked,
    ``refusal`` null (MAX 26.7 gives ``""`` in the message and ``[]`` in the log-probabilities)."""
    message = choice.get("message")
    if isinstance(message, dict) and not message.get("refusal"):
        message["refusal"] = None
    if not plan.logprobs:
        choice["logprobs"] = None
    elif isinstance(choice.get("logprobs"), dict):
        choice["logprobs"]["refusal"] = None


def fix_chat(response: dict[str, Any], plan: RequestPlan) -> dict[str, Any]:
    """One MAX chat response with each choice rewritten by :func:`fix_chat_choice`."""
    for choice in response.get("choices", []):
        fix_chat_choice(choice, plan)
    return response


def sum_usage(usages: Iterable[dict[str, Any] | None]) -> dict[str, int] | None:
    """Token counts of several MAX requests answering one: prompts counted once."""
    usages = [u for u in usages if isinstance(u, dict)]
    if not usages:
        return None
    prompt = int(usages[0].get("prompt_tokens") or 0)
    completion = sum(int(u.get("completion_tokens") or 0) for u in usages)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


def merge_responses(responses: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """Responses to the ``n`` copies of one request as one: choices re-indexed, usage summed."""
    if n == 1:
        return responses[0]
    merged = dict(responses[0])
    choices = []
    for j, response in enumerate(responses):
        for choice in response.get("choices", []):
            choices.append({**choice, "index": choice["index"] * n + j})
    merged["choices"] = sorted(choices, key=lambda c: c["index"])
    merged["usage"] = sum_usage(r.get("usage") for r in responses)
    return merged


def parse_sse(line: str) -> dict[str, Any] | None:
    """One ``data: {...}`` line of a server-sent event stream; None for anything else."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if not data or data == "[DONE]":
        return None
    event = json.loads(data)
    return event if isinstance(event, dict) else None


def sse(event: dict[str, Any] | str) -> bytes:
    """A server-sent event: a JSON object, or the closing ``[DONE]``."""
    data = event if isinstance(event, str) else json.dumps(event, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
