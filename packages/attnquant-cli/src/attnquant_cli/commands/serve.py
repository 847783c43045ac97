"""``attnquant serve``: a checkpoint behind an OpenAI-compatible endpoint, through MAX."""

from __future__ import annotations

import signal
import tempfile
import time
from pathlib import Path
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
    verbose: Annotated[
        bool,
        typer.Option(
            "--verbose", "-v", help="Print all of MAX's output here (default: to its log file)."
        ),
    ] = False,
    max_log: Annotated[
        Path | None,
        typer.Option(
            help="Where MAX's output goes without --verbose "
            "(default: ~/.cache/attnquant/max-serve-PORT.log)."
        ),
    ] = None,
    options: ServingOptions = ServingOptions(),
) -> int:
    """Serve MODEL behind an OpenAI-compatible endpoint through MAX (Ctrl-C stops it)."""
    started = time.monotonic()  # the ready line counts from here
    require_max("serve")
    from attnquant_core import require_intact
    from attnquant_max import plan_serving, serve_command, serve_env
    from attnquant_max._serve import check_port_free
    from attnquant_max._startup import LogFollower, StartupReport, log_tail, logged_command
    from attnquant_max.gateway import ECHO_SERVE_ARGS, run_gateway

    path = model_path(model)
    env = serve_env(options)  # the options, as the max serve child will read them back
    plan = plan_serving(path, options)  # validates a theta checkpoint's keys and bands
    check_port_free(host, port)  # one line now, not a MAX traceback after the model loads
    require_intact(path)  # every tensor against its digest (ATTNQUANT_VERIFY_DIGESTS=0: skip)
    name = served_model_name or ("demo" if model in (None, "demo") else path.name)
    url = f"http://{host}:{port}/v1"
    _say(plan.describe())
    _say(
        f"OpenAI-compatible API at {url}, model {name!r}; "
        f"prompt log-probabilities {'on' if echo else 'off (--no-echo)'}"
    )
    log_path: Path | None = None  # MAX's output to the terminal (--verbose), else to this file

    def argv_for(backend_port: int) -> list[str]:
        argv = serve_command(
            path,
            port=backend_port,
            devices=devices,
            max_length=max_length,
            max_batch_size=max_batch_size,
            served_model_name=name,
            extra_args=ECHO_SERVE_ARGS if echo else (),
        )
        return argv if log_path is None else logged_command(argv, log_path)

    argv_for(0)  # refuses a model the device cannot run (Gemma on a CPU) before anything starts
    if not verbose:
        log_path = _log_file(max_log, port)
        _say(f"attnquant: MAX's log: {log_path} (--verbose prints it here)")
        env["PYTHONUNBUFFERED"] = "1"  # each line in the log as MAX writes it

    def terminated(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM shuts down as cleanly as Ctrl-C

    follower = None
    if log_path is not None:
        report = StartupReport(_say, shown=[plan.describe()], started=started)
        follower = LogFollower(
            log_path, report, f"{_local_url(host, port)}/health", f"ready to serve at {url}"
        )
        follower.start()
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
            log=_say,
            restarts=restarts,
        )
    except KeyboardInterrupt:
        code = 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        if follower is not None:
            follower.stop()
    if code and log_path is not None:
        tail = log_tail(log_path, _TAIL_LINES)
        _say(f"attnquant: the last {len(tail)} lines of MAX's log ({log_path}):")
        for line in tail:
            _say(line)
    console.print("attnquant: server stopped")
    return code


#: Lines of MAX's log printed when a start fails without --verbose.
_TAIL_LINES = 40


def _say(line: str) -> None:
    """Print one of serve's lines on the console, as it is (no markup, never folded)."""
    console.print(line, highlight=False, markup=False, soft_wrap=True)


def _log_file(given: Path | None, port: int) -> Path:
    """MAX's log, emptied for this start: ``given``, else the cache's (a temp file if unwritable)."""
    from attnquant_max._startup import default_log_path

    path = (given or default_log_path(port)).resolve()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"")
    except OSError as exc:
        if given is not None:
            raise ValueError(f"--max-log {given}: cannot write it ({exc.strerror})") from None
        path = Path(tempfile.gettempdir()) / path.name
        path.write_bytes(b"")
    return path


def _local_url(host: str, port: int) -> str:
    """The gateway's address as this process reaches it (a wildcard host: loopback)."""
    host = {"": "127.0.0.1", "0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
