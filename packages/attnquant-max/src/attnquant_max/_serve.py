"""The ``max serve`` command line that serves a checkpoint through the attnquant architectures."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from attnquant_core import AttnquantError
from attnquant_core.serving import ServingOptions

from ._config import require_device, require_implemented

__all__ = [
    "PortInUseError",
    "ServerProcess",
    "architectures_path",
    "check_port_free",
    "max_entrypoint",
    "serve_command",
    "serve_env",
]


def architectures_path() -> Path:
    """The folder to pass as ``--custom-architectures`` / ``custom_architectures=[...]``.

    It holds the module ``attnquant_architectures`` exposing ``ARCHITECTURES``.
    """
    return Path(__file__).resolve().parent / "attnquant_architectures"


def max_entrypoint() -> list[str]:
    """The argv prefix that runs MAX's command line from this environment.

    The ``max`` script installed next to the running interpreter when there is
    one, else ``python -m max._entrypoints.pipelines`` (what the script runs).
    """
    script = Path(sys.executable).with_name("max.exe" if os.name == "nt" else "max")
    if script.is_file():
        return [str(script)]
    return [sys.executable, "-m", "max._entrypoints.pipelines"]


def serve_command(
    model_path: str | os.PathLike[str],
    *,
    port: int,
    host: str = "127.0.0.1",
    devices: str = "cpu",
    quantization_encoding: str | None = None,
    max_length: int | None = None,
    max_batch_size: int | None = None,
    served_model_name: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The argv of MAX's OpenAI-compatible server for ``model_path`` on the attnquant path.

    Parameters
    ----------
    model_path : path
        A local checkpoint directory, theta or dense.
    port, host : int, str
        Where the HTTP API listens; loopback by default.
    devices : str
        MAX's ``--devices``: ``"cpu"``, ``"gpu"``, ``"gpu:0,1"``.
    quantization_encoding : str, optional
        MAX's ``--quantization-encoding``; ``float32`` on CPU when not given
        (the only encoding MAX runs there), MAX's choice otherwise.
    max_length, max_batch_size : int, optional
        Passed through when given.
    served_model_name : str, optional
        The model name clients see (defaults to the path).
    extra_args : sequence of str
        Appended as they are.

    Run it with :func:`serve_env` as its environment.
    """
    require_device(model_path, devices, quantization_encoding, max_length)  # say why not
    if quantization_encoding is None and devices == "cpu":
        quantization_encoding = "float32"
    argv = [
        *max_entrypoint(),
        "serve",
        "--model-path",
        str(model_path),
        "--custom-architectures",
        str(architectures_path()),
        "--devices",
        devices,
        "--host",
        host,
        "--port",
        str(int(port)),
    ]
    if quantization_encoding is not None:
        argv += ["--quantization-encoding", quantization_encoding]
    if max_length is not None:
        argv += ["--max-length", str(int(max_length))]
    if max_batch_size is not None:
        argv += ["--max-batch-size", str(int(max_batch_size))]
    if served_model_name is not None:
        argv += ["--served-model-name", served_model_name]
    argv += list(extra_args)
    return argv


def serve_env(
    options: ServingOptions | None = None,
    env: Mapping[str, str] | None = None,
    *,
    offline: bool = True,
) -> dict[str, str]:
    """The environment for :func:`serve_command`: ``env`` (``os.environ``), offline settings, and
    ``options`` as canonical ``ATTNQUANT_*`` variables (:meth:`ServingOptions.to_env`).

    Telemetry off, ``HF_HUB_OFFLINE=1`` when ``offline``, and the ``attnquant_max`` logger let
    through max serve's log filter. ``options`` default to ``env``'s own variables, checked here
    (a bad value, or a combination this release does not serve, fails before a process starts);
    the ``max serve`` child reads them back once, at import of the architectures.
    """
    base = dict(os.environ if env is None else env)
    options = ServingOptions.from_env(base) if options is None else options
    require_implemented(options)
    out = options.to_env(base)
    out.setdefault("MAX_SERVE_DISABLE_TELEMETRY", "1")
    # max serve's log handlers drop every logger outside max.* unless named here;
    # attnquant_max logs the chosen path and G, r once at load.
    components = [c for c in out.get("MAX_SERVE_LOGS_ENABLE_COMPONENTS", "").split(",") if c]
    if "attnquant_max" not in components:
        out["MAX_SERVE_LOGS_ENABLE_COMPONENTS"] = ",".join([*components, "attnquant_max"])
    if offline:
        out["HF_HUB_OFFLINE"] = "1"
    return out


# -- running the server ----------------------------------------------------------------------


class PortInUseError(AttnquantError, OSError):
    """The address ``max serve`` would listen on is already taken."""


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`PortInUseError` naming ``host:port`` when a server already listens there.

    Binds the address as uvicorn will (``SO_REUSEADDR``, so a port in TIME_WAIT is free) and
    lets it go at once; checked before MAX starts, which otherwise fails minutes later, after
    loading the model.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortInUseError(f"cannot resolve --host {host!r}: {exc.strerror}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PortInUseError(
                    f"port {port} on {host} is already in use (another server?); stop it or "
                    f"pass --port"
                ) from None
            raise PortInUseError(f"cannot listen on {host}:{port}: {exc.strerror}") from None


# The watchdog: a separate tiny process that holds the read end of a pipe only the supervisor
# can write. Whatever ends the supervisor (SIGKILL included), the kernel closes its end; the
# watchdog then reads EOF and ends the server's whole process group (max serve and the model
# and metrics workers it spawns), SIGTERM first, SIGKILL after a grace period. A clean exit
# writes "stop" first, so the watchdog leaves a group the supervisor already reaped.
_WATCHDOG = """
import os, signal, sys, time
pgid, grace = int(sys.argv[1]), float(sys.argv[2])
line = sys.stdin.readline()
if line.strip() != "stop":
    try:
        os.killpg(pgid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline:
            os.killpg(pgid, 0)
            time.sleep(0.1)
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
"""


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """preexec_fn: SIGTERM this process when its parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    if sys.platform.startswith("linux"):
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


class ServerProcess:
    """``max serve`` run as a supervised process group that cannot outlive its supervisor.

    The server gets a session (and process group) of its own, so everything it spawns can be
    ended together; a parent-death signal (Linux) and a watchdog process end that group when
    this process dies in any way, ``kill -9`` included. :meth:`stop` shuts it down gracefully:
    SIGINT (what Ctrl-C sends), then SIGTERM, then SIGKILL to the whole group.
    """

    def __init__(
        self,
        argv: Sequence[str],
        env: Mapping[str, str] | None = None,
        *,
        grace_s: float = 10.0,
    ) -> None:
        self.proc = subprocess.Popen(
            list(argv),
            env=None if env is None else dict(env),
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
        self.pgid = self.proc.pid  # a session leader's group id is its pid
        self._reaping = threading.Lock()  # wait() and stop() may run in two threads
        read_end, self._alive = os.pipe()
        try:
            self.watchdog = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG, str(self.pgid), str(grace_s)],
                stdin=read_end,
                start_new_session=True,
            )
        except BaseException:
            os.close(self._alive)
            self._kill_group(signal.SIGKILL)
            self.proc.wait()
            raise
        finally:
            os.close(read_end)

    @property
    def pid(self) -> int:
        """The process id of ``max serve``."""
        return self.proc.pid

    def wait(self) -> int:
        """Wait until the server exits, end whatever it left in its group, return its code."""
        code = self.proc.wait()
        self._reap()
        return code

    def stop(self, *, waits: Sequence[float] = (30.0, 10.0, 10.0)) -> int:
        """Shut down: SIGINT, then SIGTERM, then SIGKILL to the group; returns the exit code."""
        for sig, wait in zip((signal.SIGINT, signal.SIGTERM, signal.SIGKILL), waits, strict=True):
            if self.proc.poll() is not None:
                break
            if sig == signal.SIGKILL:
                self._kill_group(sig)
            else:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
            except KeyboardInterrupt:  # a second Ctrl-C: on to the next signal at once
                continue
        self._reap()
        return self.proc.returncode if self.proc.returncode is not None else -signal.SIGKILL

    def _kill_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def _reap(self) -> None:
        """Once ``max serve`` is gone: SIGKILL what it left in its group, dismiss the watchdog."""
        with self._reaping:
            self._reap_group()

    def _reap_group(self) -> None:
        # Workers normally exit with their server; one that did not (max serve itself
        # SIGKILLed, say) still holds the model and may hold the port.
        deadline = time.monotonic() + 5.0
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._group_alive():
            self._kill_group(signal.SIGKILL)
        if self._alive >= 0:
            with contextlib.suppress(OSError):
                os.write(self._alive, b"stop\n")
            os.close(self._alive)
            self._alive = -1
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.watchdog.wait(timeout=5)

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
