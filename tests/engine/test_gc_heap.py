"""``freeze_startup_heap``: what lives at the end of start-up leaves the collector's passes, what
serving allocates afterwards is still collected."""

from __future__ import annotations

import gc
import weakref

import pytest

from kvpilot.engine.gc_heap import freeze_startup_heap


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # the rest of the test session runs with the collector as it was


def cycle() -> tuple[Node, weakref.ref]:
    a, b = Node(), Node()
    a.other, b.other = b, a
    return a, weakref.ref(b)


def test_the_start_up_heap_leaves_the_passes_and_later_garbage_is_still_collected(unfrozen) -> None:
    garbage, garbage_ref = cycle()
    kept, _ = cycle()
    del garbage
    frozen = freeze_startup_heap()
    assert garbage_ref() is None  # collected first: start-up garbage is not frozen in
    assert frozen == gc.get_freeze_count() > 0
    tracked = {id(o) for o in gc.get_objects()}
    assert id(kept) not in tracked and id(kept.other) not in tracked  # frozen: no pass walks them
    later, later_ref = cycle()
    assert id(later) in {id(o) for o in gc.get_objects()}
    del later
    gc.collect()
    assert later_ref() is None  # a cycle made while serving is still collected
    assert kept.other is not None and kept.other.other is kept  # frozen objects stay usable
