"""The MAX model server behind the gateway, supervised: started on a loopback port of its own,
restarted with back-off when it dies, given up on when it keeps dying.

A model worker that dies takes ``max serve`` with it (MAX 26.7 exits when its worker does), so
the unit supervised is the whole ``max serve`` process group (:class:`ServerProcess`, which
also ends it with this process, however this process dies).
"""

from __future__ import annotations

import asyncio
import collections
import socket
import time
from collections.abc import Callable, Mapping, Sequence

import aiohttp

from .._serve import ServerProcess

__all__ = ["Backend", "free_port"]


def free_port(host: str = "127.0.0.1") -> int:
    """A port on ``host`` that nothing listens on now."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


class Backend:
    """``max serve`` run and restarted by :meth:`run`; requests go to :attr:`url` while
    :attr:`ready`.

    Parameters
    ----------
    argv_for : callable
        The command line of ``max serve`` listening on the given loopback port.
    env : mapping
        Its environment.
    restarts : int
        Restarts allowed within ``window_s``; one more failure and :meth:`run` gives up.
    backoff_s : sequence of float
        The wait before the first, second, ... restart in a row (the last one repeats).
    ready_timeout_s : float
        How long one start may take to answer ``/health`` (a cold graph compile takes minutes).
    log : callable
        Where the supervisor's one-line messages go.
    """

    def __init__(
        self,
        argv_for: Callable[[int], Sequence[str]],
        env: Mapping[str, str] | None,
        *,
        restarts: int = 5,
        window_s: float = 600.0,
        backoff_s: Sequence[float] = (1.0, 2.0, 4.0, 8.0, 16.0),
        ready_timeout_s: float = 1800.0,
        log: Callable[[str], None] = print,
    ) -> None:
        self.argv_for = argv_for
        self.env = env
        self.restarts = restarts
        self.window_s = window_s
        self.backoff_s = tuple(backoff_s)
        self.ready_timeout_s = ready_timeout_s
        self.log = log
        self.url: str | None = None
        self.ready = False
        self.starts = 0  # how many times max serve was started
        self.gave_up: str | None = None  # why run() stopped supervising
        self.exit_code = 0
        self.process: ServerProcess | None = None
        self._stopping = False

    async def run(self) -> None:
        """Start ``max serve``, wait until it answers, restart it whenever it exits.

        Returns when :meth:`stop` is called, or when it gives up (:attr:`gave_up` says why):
        a first start that never became ready, or more than ``restarts`` deaths within
        ``window_s``.
        """
        deaths: collections.deque[float] = collections.deque()
        ever_ready = False
        while not self._stopping:
            port = free_port()
            self.url = f"http://127.0.0.1:{port}"
            self.process = ServerProcess(list(self.argv_for(port)), self.env)
            self.starts += 1
            became_ready = await self._wait_ready(self.process)
            if became_ready:
                self.ready = ever_ready = True
                if self.starts > 1:
                    self.log(f"attnquant: MAX model server ready again (start {self.starts})")
            code = await asyncio.to_thread(self.process.wait)
            self.ready = False
            if self._stopping:
                return
            if not ever_ready:
                self._give_up(f"MAX model server exited with code {code} before it was ready", code)
                return
            now = time.monotonic()
            deaths.append(now)
            while deaths and deaths[0] < now - self.window_s:
                deaths.popleft()
            if len(deaths) > self.restarts:
                self._give_up(
                    f"MAX model server died {len(deaths)} times in {self.window_s:g} s "
                    f"(last exit code {code}); giving up",
                    code or 1,
                )
                return
            delay = self.backoff_s[min(len(deaths), len(self.backoff_s)) - 1]
            self.log(
                f"attnquant: MAX model server exited with code {code}; restarting in {delay:g} s "
                f"(restart {len(deaths)} of {self.restarts} allowed in {self.window_s:g} s)"
            )
            await asyncio.sleep(delay)

    def _give_up(self, why: str, code: int) -> None:
        self.gave_up = why
        self.exit_code = code if code > 0 else 1
        self.log(f"attnquant: {why}")

    async def _wait_ready(self, process: ServerProcess) -> bool:
        """Poll ``/health`` until it answers 200 (True), or the process exits (False)."""
        deadline = time.monotonic() + self.ready_timeout_s
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5.0)) as client:
            while time.monotonic() < deadline and not self._stopping:
                if process.proc.poll() is not None:
                    return False
                try:
                    async with client.get(f"{self.url}/health") as response:
                        if response.status == 200:
                            return True
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.25)
        if not self._stopping:
            self.log(f"attnquant: MAX model server not ready in {self.ready_timeout_s:g} s")
            await asyncio.to_thread(process.stop)
        return False

    async def stop(self) -> None:
        """Shut ``max serve`` down (SIGINT, SIGTERM, SIGKILL to its group) and stop supervising."""
        self._stopping = True
        self.ready = False
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)
