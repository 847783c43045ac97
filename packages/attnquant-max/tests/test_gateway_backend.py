"""The gateway's supervisor on real processes standing in for ``max serve`` (no MAX graph):
a server that answers ``/health`` and dies on cue, one that never starts, one that stays up."""

from __future__ import annotations

import asyncio
import sys

from attnquant_max.gateway import Backend
from attnquant_max.testing import fake_max_serve


def _backend(argv_for, lines: list[str], **kw) -> Backend:
    return Backend(
        argv_for, None, backoff_s=(0.05, 0.1), ready_timeout_s=60, log=lines.append, **kw
    )


def test_a_first_start_that_fails_is_not_retried():
    lines: list[str] = []
    backend = _backend(lambda port: [sys.executable, "-c", "raise SystemExit(7)"], lines)
    asyncio.run(backend.run())
    assert backend.starts == 1
    assert backend.exit_code == 7
    assert backend.gave_up == "MAX model server exited with code 7 before it was ready"
    assert not backend.ready


def test_a_server_that_keeps_dying_is_restarted_then_given_up():
    lines: list[str] = []
    backend = _backend(fake_max_serve(3.0), lines, restarts=2)
    asyncio.run(backend.run())
    assert backend.starts == 3  # the first start and two restarts
    assert backend.gave_up is not None and "died 3 times" in backend.gave_up
    assert backend.exit_code == 3
    restarts = [line for line in lines if "restarting in" in line]
    assert len(restarts) == 2
    assert "exited with code 3; restarting in 0.05 s (restart 1 of 2" in restarts[0]
    assert "restarting in 0.1 s (restart 2 of 2" in restarts[1]
    assert sum("ready again" in line for line in lines) == 2
    assert backend.process is not None and backend.process.proc.poll() is not None


def test_stop_ends_a_healthy_server_and_the_supervision():
    lines: list[str] = []
    backend = _backend(fake_max_serve(0), lines)

    async def scenario() -> None:
        task = asyncio.create_task(backend.run())
        while not backend.ready:
            await asyncio.sleep(0.05)
        await backend.stop()
        await asyncio.wait_for(task, timeout=60)

    asyncio.run(scenario())
    assert backend.gave_up is None and backend.starts == 1 and not backend.ready
    assert backend.process is not None and backend.process.proc.poll() is not None
    assert lines == []
