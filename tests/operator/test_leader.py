"""Leader election rules on an in-memory Lease store with optimistic concurrency (the failover of
real operator processes is in test_leader_failover)."""

from __future__ import annotations

import asyncio
import copy
import itertools

import pytest

from kvpilot.operator.api.rest import ApiError
from kvpilot.operator.leader import LeaderElectionError, LeaderElector, LeaseConfig


class Store:
    """GET / POST / merge PATCH of one Lease, answering 409 on a stale resourceVersion or a
    create of an existing object, as the API server does."""

    def __init__(self) -> None:
        self.lease: dict | None = None
        self.versions = itertools.count(1)
        self.down = False
        self.writes = 0
        self.conflicts = 0
        self.refused = 0  # calls made while down
        self.on_refused = lambda: None

    def _check(self) -> None:
        if self.down:
            self.refused += 1
            self.on_refused()
            raise ApiError(0, "ClientConnectorError", "no answer from the API server")

    async def get(self, path: str) -> dict | None:
        self._check()
        lease = copy.deepcopy(self.lease)
        await asyncio.sleep(0)  # a network round trip: other candidates run in between
        return lease

    async def request(self, method: str, path: str, *, body: dict) -> dict:
        self._check()
        assert method == "POST" and path.endswith("/leases")
        if self.lease is not None:
            raise ApiError(409, "AlreadyExists", "leases.coordination.k8s.io already exists")
        self.lease = copy.deepcopy(body)
        self.lease["metadata"]["resourceVersion"] = str(next(self.versions))
        self.writes += 1
        return copy.deepcopy(self.lease)

    async def merge_patch(self, path: str, patch: dict) -> dict:
        self._check()
        if patch["metadata"]["resourceVersion"] != self.lease["metadata"]["resourceVersion"]:
            self.conflicts += 1
            raise ApiError(409, "Conflict", "the object has been modified")
        self.lease["spec"].update(patch["spec"])
        self.lease["metadata"]["resourceVersion"] = str(next(self.versions))
        self.writes += 1
        return copy.deepcopy(self.lease)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def config(identity: str, **timing: float) -> LeaseConfig:
    return LeaseConfig(name="kvpilot-operator", namespace="kvpilot-system", identity=identity, **timing)


def run(coro):
    return asyncio.run(coro)


def test_first_candidate_creates_the_lease_and_others_wait_a_full_duration_of_silence():
    store, clock = Store(), Clock()
    a = LeaderElector(store, config("a"), clock)
    b = LeaderElector(store, config("b"), clock)
    assert run(a.try_acquire_or_renew()) is True
    assert store.lease["spec"]["holderIdentity"] == "a" and store.lease["spec"]["leaseTransitions"] == 0
    assert run(b.try_acquire_or_renew()) is False
    # a renews: b sees the record change, so its wait starts over each time.
    for _ in range(10):
        clock.now += 10
        assert run(a.try_acquire_or_renew()) is True
        assert run(b.try_acquire_or_renew()) is False
    # a stops renewing: b takes over only once it has seen no change for the lease duration (15 s).
    clock.now += 15
    assert run(b.try_acquire_or_renew()) is False
    clock.now += 0.5
    assert run(b.try_acquire_or_renew()) is True
    assert store.lease["spec"]["holderIdentity"] == "b" and store.lease["spec"]["leaseTransitions"] == 1
    # a's next renewal fails: its read shows b holding a fresh Lease.
    assert run(a.try_acquire_or_renew()) is False and a.is_leader is False


def test_of_two_candidates_racing_for_an_expired_lease_exactly_one_wins():
    store, clock = Store(), Clock()
    a, b, c = (LeaderElector(store, config(n), clock) for n in "abc")
    run(a.try_acquire_or_renew())
    run(b.try_acquire_or_renew())
    run(c.try_acquire_or_renew())
    clock.now += 16

    async def race():
        # Both read the same resourceVersion before either writes.
        results = await asyncio.gather(b.try_acquire_or_renew(), c.try_acquire_or_renew())
        return results

    writes = store.writes
    results = run(race())
    assert sorted(results) == [False, True]
    assert store.writes == writes + 1 and store.conflicts == 1  # the loser's write got a 409
    assert store.lease["spec"]["holderIdentity"] == ("b" if results[0] else "c")


def test_leader_steps_down_after_the_renew_deadline_without_the_api():
    store, clock = Store(), Clock()
    cfg = config("a", lease_duration=3, renew_deadline=2, retry_period=0.01)
    a = LeaderElector(store, cfg, clock)
    assert run(a.try_acquire_or_renew()) is True
    store.down = True

    # Each failed renewal takes half a second of the lease's clock: the count of attempts, not the
    # real time between them, decides when it gives up.
    def half_a_second() -> None:
        clock.now += 0.5

    store.on_refused = half_a_second
    run(asyncio.wait_for(a.hold(), 30))
    assert a.is_leader is False
    # Failures at +0.5, +1.0 and +1.5 s keep it leading; the one at +2.0 s reaches the deadline.
    assert store.refused == 4, store.refused


def test_release_lets_a_standby_take_over_at_its_next_attempt():
    store, clock = Store(), Clock()
    a, b = LeaderElector(store, config("a"), clock), LeaderElector(store, config("b"), clock)
    run(a.try_acquire_or_renew())
    assert run(b.try_acquire_or_renew()) is False
    run(a.release())
    assert store.lease["spec"]["holderIdentity"] == ""
    assert run(b.try_acquire_or_renew()) is True


@pytest.mark.parametrize(
    ("timing", "message"),
    [
        ({"lease_duration": 10, "renew_deadline": 10}, "retry period < renew deadline < lease duration"),
        ({"retry_period": 0}, "0 < retry period"),
        ({"renew_deadline": 1, "retry_period": 2}, "a leader must stop before a standby may take over"),
    ],
)
def test_inconsistent_timing_is_refused(timing, message):
    with pytest.raises(LeaderElectionError, match=message):
        config("a", **timing)
