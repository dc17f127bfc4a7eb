"""The front door's hold (``router.hold.ColdStartHold``) and the proxy's use of it, on a fake replica:
requests that find no ready replica wait (bounded in number and time), the door asks for a replica
while they wait, and every waiting request goes through once one is ready."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from aiohttp import web

from kvpilot.operator.router.hold import OUTCOME_FULL, OUTCOME_READY, OUTCOME_TIMEOUT, ColdStartHold
from kvpilot.operator.router.proxy import POLICY_LEAST_IN_FLIGHT, BalancingProxy
from tests.operator.conftest import serve_routes

LOG = logging.getLogger("test")


def test_hold_bounds_and_wakes():
    async def scenario() -> None:
        asked: list[int] = []
        ready = False

        async def wake() -> None:
            asked.append(1)

        hold = ColdStartHold(wake, max_waiting=2, timeout_s=0.4, rewake_s=0.1, poll_s=0.01)
        # Nothing becomes ready: two wait and time out, a third is refused at once; the door asked
        # again while they waited (every rewake_s), not once per request.
        first = asyncio.create_task(hold.wait(lambda: ready))
        second = asyncio.create_task(hold.wait(lambda: ready))
        await asyncio.sleep(0.05)
        assert hold.waiting == 2
        assert await hold.wait(lambda: ready) == OUTCOME_FULL
        assert await first == OUTCOME_TIMEOUT and await second == OUTCOME_TIMEOUT
        assert 2 <= len(asked) <= 6, asked
        assert hold.waiting == 0 and hold.outcomes[OUTCOME_TIMEOUT] == 2 and hold.outcomes[OUTCOME_FULL] == 1

        # A replica comes: every waiting request is released.
        asked.clear()
        waiting = [asyncio.create_task(hold.wait(lambda: ready)) for _ in range(2)]
        await asyncio.sleep(0.05)
        ready = True
        assert await asyncio.gather(*waiting) == [OUTCOME_READY, OUTCOME_READY]
        assert asked, "the door asked for a replica"
        # Ready already: no wait, no wake.
        asked.clear()
        assert await hold.wait(lambda: True) == OUTCOME_READY and asked == []

    asyncio.run(scenario())


def test_a_failing_wake_is_retried_and_does_not_fail_the_request():
    async def scenario() -> None:
        calls: list[int] = []
        ready = False

        async def wake() -> None:
            nonlocal ready
            calls.append(1)
            if len(calls) < 3:
                raise ConnectionError("API down")
            ready = True

        hold = ColdStartHold(wake, timeout_s=5, rewake_s=0.05, poll_s=0.01, logger=LOG)
        assert await hold.wait(lambda: ready) == OUTCOME_READY
        assert len(calls) == 3 and hold.wake_errors == 2 and hold.wakes == 1

    asyncio.run(scenario())


@pytest.mark.parametrize("bad", [{"max_waiting": 0}, {"timeout_s": 0}, {"rewake_s": -1}])
def test_hold_refuses_bad_bounds(bad):
    with pytest.raises(ValueError):
        ColdStartHold(None, **bad)


def test_the_proxy_holds_a_request_until_a_replica_is_ready_and_refuses_past_the_bounds():
    async def scenario() -> None:
        async def completions(request: web.Request) -> web.Response:
            return web.json_response({"served": True})

        runner, replica = await serve_routes(("POST", "/v1/completions", completions))

        ready: list[str] = []
        asked: list[str] = []

        async def wake() -> None:
            asked.append("wake")
            asyncio.get_running_loop().call_later(0.3, ready.append, replica)  # the pod becomes Ready

        hold = ColdStartHold(wake, max_waiting=1, timeout_s=3, rewake_s=1, poll_s=0.01)
        proxy = BalancingProxy(
            lambda: list(ready), port=0, logger=LOG, policy=POLICY_LEAST_IN_FLIGHT, hold=hold
        )
        door = await proxy.start()
        try:
            async with aiohttp.ClientSession() as client:
                held = asyncio.create_task(client.post(door + "/v1/completions", json={"prompt": "hi"}))
                await asyncio.sleep(0.1)
                # One waits already: the next is refused at once, with Retry-After.
                async with client.post(door + "/v1/completions", json={"prompt": "hi"}) as refused:
                    assert refused.status == 503 and refused.headers["Retry-After"] == "1"
                    assert "already wait" in (await refused.json())["error"]["message"]
                async with await held as answer:
                    assert answer.status == 200 and (await answer.json()) == {"served": True}
                assert asked == ["wake"] and proxy.served[replica] == 1
                # No replica again and nobody wakes one: a 503 once the hold times out.
                ready.clear()
                hold.wake, hold.timeout_s = None, 0.2
                async with client.post(door + "/v1/completions", json={"prompt": "hi"}) as timed_out:
                    assert timed_out.status == 503
                    assert "within 0.2s" in (await timed_out.json())["error"]["message"]
                assert hold.outcomes == {OUTCOME_READY: 1, OUTCOME_FULL: 1, OUTCOME_TIMEOUT: 1}
        finally:
            await proxy.close()
            await runner.cleanup()

    asyncio.run(scenario())
