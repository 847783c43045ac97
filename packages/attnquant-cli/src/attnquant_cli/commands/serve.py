"""``attnquant serve``: a checkpoint behind an OpenAI-compatible endpoint, through MAX."""

from __future__ import annotations

import signal
from typing import Annotated

import typer

from attnquant_core.serving import ServingOptions

from .._extra import require_max
from ._serving import serving_flags
from ._shared import Devices, MaxBatch, MaxLength, ModelArg, console, model_path

__all__ = ["serve"]


@serving_flags
def serve(
    model: ModelArg = None,
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
    host: Annotated[str, typer.Option(help="Address to bind.")] = "127.0.0.1",
    devices: Devices = "cpu",
    max_length: MaxLength = 512,
    max_batch_size: MaxBatch = 8,
    served_model_name: Annotated[
        str | None, typer.Option(help="Model name clients ask for (default: the directory name).")
    ] = None,
    echo: Annotated[
        bool,
        typer.Option(
            "--echo/--no-echo",
            help="Serve prompt log-probabilities (echo with logprobs, as evaluation harnesses "
            "ask); --no-echo refuses those requests with a 400.",
        ),
    ] = True,
    restarts: Annotated[
        int,
        typer.Option(min=0, help="Restarts of a dying MAX server allowed within 10 minutes."),
    ] = 5,
    options: ServingOptions = ServingOptions(),
) -> int:
    """Serve MODEL behind an OpenAI-compatible endpoint through MAX (Ctrl-C stops it)."""
    require_max("serve")
    from attnquant_core import require_intact
    from attnquant_max import plan_serving, serve_command, serve_env
    from attnquant_max._serve import check_port_free
    from attnquant_max.gateway import ECHO_SERVE_ARGS, run_gateway

    path = model_path(model)
    env = serve_env(options)  # the options, as the max serve child will read them back
    plan = plan_serving(path, options)  # validates a theta checkpoint's keys and bands
    check_port_free(host, port)  # one line now, not a MAX traceback after the model loads
    require_intact(path)  # every tensor against its digest (ATTNQUANT_VERIFY_DIGESTS=0: skip)
    name = served_model_name or ("demo" if model in (None, "demo") else path.name)
    console.print(plan.describe(), highlight=False, soft_wrap=True)
    console.print(
        f"OpenAI-compatible API at http://{host}:{port}/v1, model {name!r}; "
        f"prompt log-probabilities {'on' if echo else 'off (--no-echo)'}",
        highlight=False,
        soft_wrap=True,
    )

    def argv_for(backend_port: int) -> list[str]:
        return serve_command(
            path,
            port=backend_port,
            devices=devices,
            max_length=max_length,
            max_batch_size=max_batch_size,
            served_model_name=name,
            extra_args=ECHO_SERVE_ARGS if echo else (),
        )

    argv_for(0)  # refuses a model the device cannot run (Gemma on a CPU) before anything starts

    def terminated(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM shuts down as cleanly as Ctrl-C

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        code = run_gateway(
            path,
            host=host,
            port=port,
            name=name,
            max_length=max_length,
            echo=echo,
            argv_for=argv_for,
            env=env,
            log=lambda line: console.print(line, highlight=False, markup=False, soft_wrap=True),
            restarts=restarts,
        )
    except KeyboardInterrupt:
        code = 0
    finally:
        signal.signal(signal.SIGTERM, previous)
    console.print("attnquant: server stopped")
    return code
