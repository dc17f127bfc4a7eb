"""The intake timer's bookkeeping: only a request the server had to itself gives a time."""

from __future__ import annotations

from kvpilot.engine.server.intake import Intakes


def test_a_request_taken_in_alone_gives_its_time() -> None:
    intakes = Intakes()
    intake = intakes.begin()
    seconds = intakes.end(intake)
    assert seconds is not None and seconds >= 0.0
    assert intakes.end(intake) is None  # ended once


def test_overlapping_intakes_give_none_either_of_them() -> None:
    intakes = Intakes()
    first = intakes.begin()
    second = intakes.begin()
    assert intakes.end(first) is None
    assert intakes.end(second) is None
    third = intakes.begin()  # after both ended: alone again
    assert intakes.end(third) is not None


def test_a_scrape_meanwhile_leaves_the_intake_untimed() -> None:
    intakes = Intakes()
    intake = intakes.begin()
    intakes.interrupt()
    assert intakes.end(intake) is None
    intakes.interrupt()  # nothing open: the next intake is unaffected
    assert intakes.end(intakes.begin()) is not None
