"""The operator stops when told: SIGTERM at any point of its life ends it with exit 0 within a bound.

The hang this guards against: on Python 3.11 ``asyncio.wait_for`` returns the inner result when a
cancellation lands just after the inner future finished, swallowing the cancel. The resync and
remediation tasks waited on the client's credentials that way before every request, so a task
cancelled at shutdown could carry on to its next pass, and the cleanup awaited it for ever.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time

import pytest

from kvpilot.operator.aio import wait_event
from tests.operator.conftest import OperatorProcess
from tests.operator.test_operator_kmock import ISVCS, NS, new_isvc


def test_a_cancel_that_lands_as_the_event_is_set_is_not_swallowed():
    async def main() -> tuple[bool, int]:
        event, passes = asyncio.Event(), []

        async def loop() -> None:
            while True:
                await wait_event(event, 10)
                passes.append(1)
                await asyncio.sleep(0.01)

        task = asyncio.create_task(loop())
        await asyncio.sleep(0.01)  # the loop waits on the event
        event.set()
        await asyncio.sleep(0)  # the event's waiter is woken, the loop not resumed yet
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=1.0)
        task.cancel()
        return bool(done) and task.cancelled(), len(passes)

    ended, passes = asyncio.run(main())
    assert ended, f"the loop went on after its cancel ({passes} more passes)"


def test_wait_event_reports_a_timeout_and_an_event_already_set():
    async def main() -> tuple[bool, bool]:
        event = asyncio.Event()
        timed_out = await wait_event(event, 0.01)
        event.set()
        return timed_out, await wait_event(event, 0)

    assert asyncio.run(main()) == (False, True)


# Delays after the start, in seconds: during imports and login, the first reconciles, and the
# resync and remediation passes that follow every 0.2 s.
POINTS = (0.5, 1.0, 1.5, 2.5, 3.5, 5.0)


@pytest.mark.timeout(240)
def test_sigterm_at_any_point_exits_zero(api, tmp_path):
    for name in ("stop-a", "stop-b"):  # something to reconcile and remediate at every start
        api.create(ISVCS, new_isvc(name))
    failures = []
    for delay in POINTS:
        proc = OperatorProcess(
            api, tmp_path, [NS], ["--resync-interval", "0.2", "--scrape-interval", "0.2", "--liveness", ""]
        )
        time.sleep(delay)
        proc.proc.send_signal(signal.SIGTERM)
        try:
            code = proc.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.proc.kill()
            proc.proc.wait()
            code = None
        proc.stop()
        if code != 0:
            failures.append((delay, code, proc.log[-1500:]))
    assert failures == [], failures
