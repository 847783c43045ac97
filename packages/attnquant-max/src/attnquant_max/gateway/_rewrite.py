"""What the gateway does to MAX's answers so that they mean what OpenAI's do.

* **Stop sequences** (:class:`StopScanner`): the text ends before the first stop string, which
  is not returned, and a stream holds back only what could still begin one.
* **Echo**: the prompt's text leads each choice's text; MAX 26.7 leaves the first prompt token
  out of ``token_logprobs`` (it has no context), so a ``null`` is put back in its place, one entry
  per prompt token as OpenAI's legacy API (and lm-eval's ``[ctxlen:-1]`` slice) expects.
* **max_tokens 0**: MAX was asked for one token, which is taken off again.
* **n**: one MAX request per choice; choice ``j`` of prompt ``i`` gets index ``i * n + j``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

from ._schema import RequestPlan

__all__ = [
    "StopScanner",
    "choice_text",
    "fix_completion",
    "merge_responses",
    "parse_sse",
    "set_choice_text",
    "sse",
    "sum_usage",
]


class StopScanner:
    """Cut one choice's text before the first of ``stops``, fed a piece at a time.

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
        found = [p for p in (buffer.find(s) for s in self.stops) if p >= 0]
        if found:
            self.done, self.pending = True, ""
            out = buffer[: min(found)]
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


def fix_completion(
    response: dict[str, Any], plan: RequestPlan, decode: Callable[[list[int]], str]
) -> dict[str, Any]:
    """One MAX completions response (n=1) made to mean what OpenAI's does: echo's prompt text
    and log-probability alignment, ``max_tokens: 0``. Choice ``i`` answers prompt ``i``."""
    for choice in response.get("choices", []):
        prompt = plan.prompts[choice["index"]]
        logprobs = choice.get("logprobs")
        if plan.zero_tokens:
            choice["text"] = ""
            choice["finish_reason"] = "length"
            if logprobs and logprobs.get("token_logprobs"):
                for key in ("token_logprobs", "top_logprobs", "tokens", "text_offset"):
                    if isinstance(logprobs.get(key), list):
                        logprobs[key] = logprobs[key][:-1]
        if plan.prompt_logprobs and logprobs:
            for key in ("token_logprobs", "top_logprobs"):
                if isinstance(logprobs.get(key), list):
                    logprobs[key] = [None, *logprobs[key]]
        if plan.echo:
            text = prompt if isinstance(prompt, str) else decode(prompt)
            choice["text"] = text + (choice.get("text") or "")
    if plan.zero_tokens and isinstance(response.get("usage"), dict):
        usage = response["usage"]
        usage["completion_tokens"] = 0
        usage["total_tokens"] = usage.get("prompt_tokens") or 0
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
