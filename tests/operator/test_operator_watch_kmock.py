"""The real operator process across the watch events an API server sends besides object changes:
bookmarks (``allowWatchBookmarks``, which kopf always asks for) and the end of a stream on the
server's own timeout. The fake sends a bookmark every 0.25 s and ends every watch after 1 s, so
over a few seconds the operator reconnects many times, each time from the newest version it saw.
"""

from __future__ import annotations

import collections

import pytest

from tests.operator.conftest import wait_for
from tests.operator.test_operator_kmock import (
    ISVCS,
    NS,
    args_of,
    child_path,
    create_and_wait,
    isvc_path,
    mark_rolled_out,
    new_isvc,
    wait_for_passes,
)

BOOKMARK_INTERVAL_S = 0.25
WATCH_TIMEOUT_S = 1.0


@pytest.fixture(scope="module")
def operator(api, start_operator):
    api.set_watch_behaviour(max_timeout_s=WATCH_TIMEOUT_S, bookmark_interval_s=BOOKMARK_INTERVAL_S)
    proc = start_operator([NS], ["--resync-interval", "1", "--scrape-interval", "0.5"])
    wait_for(lambda: "Initial authentication has finished" in proc.log, what="the operator to log in")
    yield proc
    api.set_watch_behaviour()


@pytest.fixture(autouse=True)
def delete_afterwards(api):
    yield
    for item in (api.get(ISVCS) or {"items": []})["items"]:
        api.delete(isvc_path(item["metadata"]["name"]))


def test_bookmarks_and_server_timeouts_cost_no_action_and_a_change_is_handled_once(api, operator):
    create_and_wait(api, new_isvc("marks"))
    mark_rolled_out(api, "marks", ready=2)
    wait_for(lambda: api.get(isvc_path("marks"))["status"]["phase"] == "Ready", what="Ready")
    wait_for_passes(api, "marks", 1)  # whatever was in flight when Ready showed has finished
    before = len(api.writes)
    sent, ended, started = len(api.sent(ISVCS)), len(api.ended(ISVCS)), len(api.watches(ISVCS))

    def resumed_from_a_bookmark() -> str | None:
        """A watch of InferenceServices started from a version only a bookmark had announced."""
        events = api.sent(ISVCS)
        marks = {v for kind, v in events if kind == "BOOKMARK"} - {
            v for kind, v in events if kind != "BOOKMARK"
        }
        return next((v for v in api.watches(ISVCS)[started:] if v in marks), None)

    wait_for(resumed_from_a_bookmark, what="kopf to resume a watch from a bookmark's version")
    wait_for(
        lambda: sum(kind == "BOOKMARK" for kind, _ in api.sent(ISVCS)[sent:]) >= 4,
        what="bookmarks delivered to the settled operator",
    )
    wait_for(lambda: api.ended(ISVCS)[ended:].count("timeout") >= 3, what="three server-side timeouts")
    wait_for(lambda: len(api.watches(ISVCS)) >= started + 3, what="three reconnections")
    wait_for_passes(api, "marks", 2)
    assert api.writes[before:] == [], "bookmarks and reconnections alone change nothing"
    # Every reconnection resumes from a version (no fresh list, no replay): no object event twice.
    assert None not in api.watches(ISVCS)[started:]
    delivered = collections.Counter(e for e in api.sent(ISVCS) if e[0] != "BOOKMARK")
    assert [e for e, n in delivered.items() if n > 1] == []
    assert "Ignoring an unsupported event type" not in operator.log
    assert "Traceback" not in operator.log

    # The next change is handled once across all that: one apply of the Deployment.
    path = child_path("Deployment", "marks")
    api.merge_patch(isvc_path("marks"), {"spec": {"engine": {"maxNumSeqs": 64}}})
    wait_for(lambda: "64" in args_of(api.get(path)), what="the change applied")
    wait_for_passes(api, "marks", 2)
    assert [w for w in api.writes[before:] if w[1] == path] == [("PATCH", path)]
