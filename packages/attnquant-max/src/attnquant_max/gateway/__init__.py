"""The OpenAI-compatible front of ``attnquant serve``: checks every request, serves what MAX
does not (``n``, stop sequences, echo's text, ``max_tokens: 0``, log-probabilities as OpenAI's,
lm-eval's tokenizer routes), and supervises the MAX model server behind it (docs:
``docs/serving.md``).

One request must never take the server down: a request MAX could not survive is refused with
a 4xx before it gets there, and a MAX server that dies anyway is restarted with back-off while
the gateway answers 503.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping, Sequence

from ._backend import Backend, free_port
from ._rewrite import StopScanner, fix_completion, merge_responses
from ._schema import ModelFacts, RequestError, RequestPlan, check_chat, check_completion
from ._tokens import ModelTokenizer

__all__ = [
    "ECHO_SERVE_ARGS",
    "Backend",
    "ModelFacts",
    "ModelTokenizer",
    "RequestError",
    "RequestPlan",
    "StopScanner",
    "check_chat",
    "check_completion",
    "fix_completion",
    "free_port",
    "merge_responses",
    "run_gateway",
]

#: ``max serve`` flags for prompt log-probabilities: all-position logits, and every prompt
#: computed whole (a cached prefix or a chunk would leave prompt positions without a value:
#: MAX 26.7 then returns fewer log-probabilities than prompt tokens).
ECHO_SERVE_ARGS = ("--enable-echo", "--no-enable-prefix-caching", "--no-enable-chunked-prefill")


def run_gateway(
    model_path: str | os.PathLike[str],
    *,
    host: str,
    port: int,
    name: str,
    max_length: int,
    echo: bool,
    argv_for: Callable[[int], Sequence[str]],
    env: Mapping[str, str] | None = None,
    log: Callable[[str], None] = print,
    restarts: int = 5,
) -> int:
    """Serve the gateway on ``host:port`` until SIGINT/SIGTERM (exit code 0), or until the MAX
    server behind it gives up (its exit code, or 1).

    ``argv_for(port)`` is the ``max serve`` command line listening on a loopback ``port``;
    ``name``, ``max_length`` and ``echo`` are what it serves (the served model name, its
    window, whether it was built for prompt log-probabilities).
    """
    import uvicorn

    from ._app import make_app

    tokenizer = ModelTokenizer(model_path)
    facts = ModelFacts(name=name, vocab_size=tokenizer.vocab_size, max_length=max_length, echo=echo)
    backend = Backend(argv_for, env, restarts=restarts, log=log)
    server: uvicorn.Server | None = None

    def give_up() -> None:
        if server is not None:
            server.should_exit = True

    app = make_app(backend, facts, tokenizer, on_give_up=give_up)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=10,
    )
    server = uvicorn.Server(config)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the signal it stopped on
        server.run()
    return backend.exit_code if backend.gave_up is not None else 0
