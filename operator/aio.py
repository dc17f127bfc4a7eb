"""asyncio helpers the operator's long-running tasks share."""

from __future__ import annotations

import asyncio


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait until ``event`` is set (True) or ``timeout`` seconds pass (False).

    Unlike ``asyncio.wait_for`` on Python 3.11, a cancellation is never swallowed: ``wait_for``
    returns the inner result when the cancel lands just after the inner future finished, so a task
    cancelled at shutdown could carry on to its next pass and never end. An event already set
    returns at once, without a suspension point.
    """
    if event.is_set():
        return True
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
    except TimeoutError:
        return False
    return True
