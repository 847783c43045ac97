"""The gateway: the OpenAI-compatible HTTP API ``attnquant serve`` listens on, in front of a
supervised MAX model server on a loopback port of its own.

Every request is checked first (:mod:`._schema`), so that a bad one gets a 4xx with one line of
reason and never reaches MAX; what MAX does not do the OpenAI way is done here (:mod:`._rewrite`);
while MAX is down (loading, or restarting after its worker died) requests get 503 with
``Retry-After``, and the gateway stays up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from ._backend import Backend
from ._rewrite import (
    LISTS,
    StopScanner,
    StreamTokens,
    choice_text,
    fix_chat,
    fix_chat_choice,
    fix_completion,
    keep_tokens,
    merge_responses,
    parse_sse,
    set_choice_text,
    sse,
    sum_usage,
)
from ._schema import (
    ModelFacts,
    RequestError,
    RequestPlan,
    _text,
    _token_ids,
    check_chat,
    check_completion,
)
from ._tokens import ModelTokenizer

__all__ = ["make_app"]

#: The largest request body read (MAX's own limit is larger; prompts past the window are
#: refused anyway).
MAX_BODY_BYTES = 16 << 20
ROUTES = {"completion": "/v1/completions", "chat": "/v1/chat/completions"}


def _error(exc: RequestError) -> JSONResponse:
    headers = {"Retry-After": "5"} if exc.status == 503 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


class _UpstreamError(Exception):
    """MAX answered with an error: its status and body go to the client as they are."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(status)
        self.status, self.body = status, body

    def response(self) -> Response:
        return Response(self.body, status_code=self.status, media_type="application/json")

    @classmethod
    def of_event(cls, event: dict[str, Any]) -> _UpstreamError:
        """An error event of MAX's stream (``{"error": {"code": "500", ...}}``) as a response."""
        code = str((event.get("error") or {}).get("code") or "")
        status = int(code) if code.isdigit() and 400 <= int(code) < 600 else 500
        return cls(status, json.dumps(event).encode())


class Gateway:
    """The routes, the supervised backend and the HTTP client that talks to it."""

    def __init__(self, backend: Backend, facts: ModelFacts, tokenizer: ModelTokenizer) -> None:
        self.backend = backend
        self.facts = facts
        self.tokenizer = tokenizer
        self.client: aiohttp.ClientSession | None = None

    # -- plumbing -------------------------------------------------------------------------

    def _require_ready(self) -> None:
        """503 (with ``Retry-After``) while MAX loads or restarts."""
        if not self.backend.ready or self.client is None:
            starting = self.backend.starts <= 1
            raise RequestError(
                "the model is loading; retry shortly"
                if starting
                else "the model server is restarting; retry shortly",
                status=503,
            )

    def _url(self, path: str) -> str:
        self._require_ready()
        return f"{self.backend.url}{path}"

    async def _body(self, request: Request) -> object:
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise RequestError(f"request body over {MAX_BODY_BYTES >> 20} MiB", status=413)
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise RequestError("the request body is not valid JSON") from None

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self.client is not None
        try:
            async with self.client.post(self._url(path), json=body) as response:
                content = await response.read()
        except aiohttp.ClientError:
            raise self._lost() from None
        if response.status != 200:
            raise _UpstreamError(response.status, content)
        return json.loads(content)

    def _lost(self) -> RequestError:
        return RequestError("the model server went away during the request; retry", status=503)

    # -- routes ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        return Response(status_code=200 if self.backend.ready else 503)

    async def models(self, request: Request) -> Response:
        try:
            self._require_ready()
        except RequestError as exc:
            return _error(exc)
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": self.facts.name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "attnquant",
                    }
                ],
            }
        )

    async def tokenize(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
                raise RequestError("tokenize needs a body {'prompt': string}", param="prompt")
            special = body.get("add_special_tokens", True)
            if not isinstance(special, bool):
                raise RequestError("add_special_tokens must be true or false")
            ids = self.tokenizer.encode(_text("prompt", body["prompt"]), add_special_tokens=special)
        except RequestError as exc:
            return _error(exc)
        return JSONResponse(
            {"tokens": ids, "count": len(ids), "max_model_len": self.facts.max_length}
        )

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await self._body(request)
            if not isinstance(body, dict) or not isinstance(body.get("tokens"), list):
                raise RequestError("detokenize needs a body {'tokens': [ids]}", param="tokens")
            ids = _token_ids("tokens", body["tokens"], self.facts) if body["tokens"] else []
        except RequestError as exc:
            return _error(exc)
        return JSONResponse({"prompt": self.tokenizer.decode(ids)})

    async def tokenizer_info(self, request: Request) -> Response:
        return JSONResponse(self.tokenizer.info(self.facts.max_length))

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, check_completion)

    async def chat(self, request: Request) -> Response:
        return await self._generate(request, check_chat)

    async def _generate(
        self, request: Request, check: Callable[[object, ModelFacts], RequestPlan]
    ) -> Response:
        try:
            self._require_ready()  # 503 at once, before the body is read
            plan = check(await self._body(request), self.facts)
            if plan.stream:
                return await self._stream(plan)
            if plan.stop:
                answers = await asyncio.gather(*(self._collect(plan, j) for j in range(plan.n)))
            else:
                path = ROUTES[plan.kind]
                answers = await asyncio.gather(
                    *(self._post(path, plan.body_for(j)) for j in range(plan.n))
                )
                answers = [
                    fix_completion(a, plan, self.tokenizer.decode)
                    if plan.kind == "completion"
                    else fix_chat(a, plan)
                    for a in answers
                ]
        except RequestError as exc:
            return _error(exc)
        except _UpstreamError as exc:
            return exc.response()
        return JSONResponse(merge_responses(list(answers), plan.n))

    # -- streams --------------------------------------------------------------------------

    async def _open(self, plan: RequestPlan, j: int) -> aiohttp.ClientResponse:
        """Streamed MAX request ``j``, its status checked (an error is raised as it is)."""
        assert self.client is not None
        body = {**plan.body_for(j), "stream": True}
        if plan.stop or plan.n > 1:
            body["stream_options"] = {"include_usage": True}  # the gateway sums usage itself
        try:
            response = await self.client.post(self._url(ROUTES[plan.kind]), json=body)
            if response.status != 200:
                content = await response.read()
                response.release()
                raise _UpstreamError(response.status, content)
        except aiohttp.ClientError:
            raise self._lost() from None
        return response

    async def _events(
        self,
        plan: RequestPlan,
        response: aiohttp.ClientResponse,
        j: int,
        stopped: set[int] | None = None,
    ) -> AsyncIterator[dict[str, Any]]:
        """MAX's stream ``j`` as events with stops applied, log-probabilities rewritten and
        indices made ``i * n + j``; closed as soon as every choice in it has met a stop (each
        ``i`` then added to ``stopped``), or after an error event, the last one yielded."""
        count = len(plan.prompts) if plan.kind == "completion" else 1
        scanners = [StopScanner(plan.stop) for _ in range(count)]
        tracks = [StreamTokens(self.tokenizer.decode) for _ in range(count)]
        lines = _lines(response)
        try:
            async for line in lines:
                event = parse_sse(line)
                if event is None:
                    continue
                if "error" in event:
                    yield event
                    return
                choices = []
                for choice in event.get("choices") or []:
                    i = int(choice.get("index", 0))
                    scanner = scanners[i] if i < count else StopScanner(())
                    if scanner.done:
                        continue
                    if plan.kind == "chat":
                        fix_chat_choice(choice, plan)
                    else:
                        (tracks[i] if i < count else StreamTokens(self.tokenizer.decode)).fill(
                            choice, plan
                        )
                    text, stop = scanner.feed(choice_text(plan.kind, choice))
                    if stop:
                        choice["finish_reason"] = "stop"
                        keep_tokens(choice.get("logprobs"), scanner.sent)
                        if stopped is not None:
                            stopped.add(i)
                    elif choice.get("finish_reason") is not None:
                        text += scanner.flush()
                        scanner.done = True
                    set_choice_text(plan.kind, choice, text)
                    choice["index"] = i * plan.n + j
                    choices.append(choice)
                if choices or event.get("usage"):
                    yield {**event, "choices": choices}
                if all(s.done for s in scanners):
                    tail = await _usage_tail(lines)
                    if tail is not None:
                        yield tail
                    return
        finally:
            response.close()

    async def _stream(self, plan: RequestPlan) -> Response:
        responses = []
        try:
            for j in range(plan.n):
                responses.append(await self._open(plan, j))
        except BaseException:
            for response in responses:
                response.close()
            raise
        return StreamingResponse(self._merged(plan, responses), media_type="text/event-stream")

    async def _merged(
        self, plan: RequestPlan, responses: list[aiohttp.ClientResponse]
    ) -> AsyncIterator[bytes]:
        """The ``n`` streams as one, event by event (:meth:`_events`); an error event ends it, as
        MAX ends its own. One stream without stops keeps MAX's events, usage included, as sent."""
        whole = plan.n == 1 and not plan.stop
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        usages: list[dict[str, Any]] = []

        async def pump(j: int) -> None:
            try:
                async for event in self._events(plan, responses[j], j):
                    await queue.put(event)
            except (aiohttp.ClientError, ValueError):  # MAX went away, or sent no JSON
                await queue.put(self._lost().body())
            finally:
                await queue.put(None)

        tasks = [asyncio.create_task(pump(j)) for j in range(plan.n)]
        last: dict[str, Any] = {}
        try:
            open_streams = plan.n
            while open_streams:
                event = await queue.get()
                if event is None:
                    open_streams -= 1
                    continue
                if "error" in event or whole:
                    yield sse(event)
                    if "error" in event:
                        return
                    continue
                if event.get("usage"):
                    usages.append(event["usage"])
                if event.get("choices"):
                    last = event
                    yield sse({k: v for k, v in event.items() if k != "usage"} | {"usage": None})
            if plan.include_usage and usages:
                yield sse({**last, "choices": [], "usage": sum_usage(usages)})
            yield sse("[DONE]")
        finally:
            for task in tasks:
                task.cancel()

    async def _collect(self, plan: RequestPlan, j: int) -> dict[str, Any]:
        """MAX's stream ``j`` gathered into a non-streamed response (stops applied). A completion
        cut at a stop keeps the log-probabilities of the tokens that begin inside its text; a chat
        keeps those of every token up to the chunk that held the stop."""
        response = await self._open(plan, j)
        count = len(plan.prompts) if plan.kind == "completion" else 1
        texts = [""] * count
        finish: list[str | None] = [None] * count
        logprobs: list[dict[str, list[Any]]] = [{} for _ in range(count)]
        usage, head, stopped = None, {}, set[int]()
        try:
            async for event in self._events(plan, response, 0, stopped):
                if "error" in event:
                    raise _UpstreamError.of_event(event)
                head = head or event
                usage = event.get("usage") or usage
                for choice in event["choices"]:
                    i = choice["index"] // plan.n  # _events numbers it i * n + 0
                    texts[i] += choice_text(plan.kind, choice)
                    finish[i] = choice.get("finish_reason") or finish[i]
                    for key, values in (choice.get("logprobs") or {}).items():
                        if isinstance(values, list):
                            logprobs[i].setdefault(key, []).extend(values)
        except (aiohttp.ClientError, ValueError):
            raise self._lost() from None
        for i in stopped:
            keep_tokens(logprobs[i], len(texts[i]))
        return {
            "id": head.get("id", ""),
            "object": "text_completion" if plan.kind == "completion" else "chat.completion",
            "created": head.get("created", int(time.time())),
            "model": self.facts.name,
            "choices": [
                _choice(plan, i, texts[i], finish[i] or "length", logprobs[i]) for i in range(count)
            ],
            "usage": sum_usage([usage]),
        }


async def _lines(response: aiohttp.ClientResponse) -> AsyncIterator[str]:
    """A streamed answer's lines, decoded."""
    async for line in response.content:
        yield line.decode("utf-8", "replace").rstrip("\r\n")


async def _usage_tail(lines: AsyncIterator[str], wait_s: float = 1.0) -> dict[str, Any] | None:
    """MAX's closing usage event, when it comes within ``wait_s``: it was given the stop
    strings too and ends at them, but the gateway does not wait on a generation it cut."""
    with contextlib.suppress(TimeoutError, aiohttp.ClientError, ValueError):
        async with asyncio.timeout(wait_s):
            async for line in lines:
                event = parse_sse(line)
                if event is not None and event.get("usage"):
                    return {**event, "choices": []}
    return None


def _choice(plan: RequestPlan, index: int, text: str, finish: str, logprobs: dict) -> dict:
    """A non-streamed choice; log-probabilities only when the request asked for them."""
    if plan.kind == "completion":
        return {
            "index": index,
            "text": text,
            "finish_reason": finish,
            "logprobs": {k: logprobs.get(k, []) for k in LISTS} if plan.logprobs else None,
        }
    return {
        "index": index,
        "message": {"role": "assistant", "content": text, "refusal": None},
        "finish_reason": finish,
        "logprobs": {"content": logprobs.get("content", []), "refusal": None}
        if plan.logprobs
        else None,
    }


async def _not_found(request: Request, exc: Exception) -> Response:
    return _error(RequestError(f"no route {request.url.path}", status=404))


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return _error(
        RequestError(f"{request.method} is not allowed on {request.url.path}", status=405)
    )


def make_app(
    backend: Backend,
    facts: ModelFacts,
    tokenizer: ModelTokenizer,
    *,
    on_give_up: Callable[[], None],
) -> Starlette:
    """The gateway's ASGI app; its lifespan runs and stops the supervised backend."""
    gateway = Gateway(backend, facts, tokenizer)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # aiohttp: about half httpx's CPU per streamed token (0.25 against 0.51 ms measured
        # here), which a 2-core machine otherwise takes from MAX's decode.
        timeout = aiohttp.ClientTimeout(total=None, connect=5.0, sock_read=None)
        # A fresh loopback connection per request: a pooled one that MAX's server closed while
        # idle (uvicorn's keep-alive is 5 s) would fail the next request sent on it.
        connector = aiohttp.TCPConnector(limit=512, force_close=True)
        gateway.client = aiohttp.ClientSession(connector=connector, timeout=timeout)

        async def supervise() -> None:
            await backend.run()
            if backend.gave_up is not None:
                on_give_up()

        task = asyncio.create_task(supervise())
        try:
            yield
        finally:
            await backend.stop()
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await gateway.client.close()

    routes = [
        Route("/health", gateway.health, methods=["GET"]),
        Route("/v1/models", gateway.models, methods=["GET"]),
        Route("/v1/completions", gateway.completions, methods=["POST"]),
        Route("/v1/chat/completions", gateway.chat, methods=["POST"]),
        Route("/tokenize", gateway.tokenize, methods=["POST"]),
        Route("/detokenize", gateway.detokenize, methods=["POST"]),
        Route("/tokenizer_info", gateway.tokenizer_info, methods=["GET"]),
    ]
    handlers = {404: _not_found, 405: _not_allowed}
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)
