"""The scheduler's FCFS queues (waiting, swapped): a deque with O(1) removal of any request (torch-free).

Aborting a queued request must not cost a scan of the queue: a client that leaves with a hundred
thousand queued sequences would otherwise stall the engine loop for seconds (a ``deque.remove`` each).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from kvpilot.engine.request import Request


class _Node:
    __slots__ = ("prev", "next", "req", "is_linked")

    def __init__(self, req: Request | None) -> None:
        self.prev: _Node = self
        self.next: _Node = self
        self.req = req
        self.is_linked = True


class RequestQueue:
    """An ordered queue of distinct requests: ``append``, ``appendleft``, ``popleft``, ``remove`` and
    ``in`` are O(1), ``len`` too; ``queue[i]`` walks ``i`` entries.

    Iterating while the queue changes is safe: a request removed meanwhile is not yielded any more,
    the walk goes on from where it was, and requests added at the front are not visited (like
    iterating a snapshot). Adding a request that is already queued raises ``ValueError``, as does
    removing one that is not.
    """

    def __init__(self, reqs: Iterable[Request] = ()) -> None:
        self._root = _Node(None)
        self._nodes: dict[Request, _Node] = {}
        self.extend(reqs)

    def __len__(self) -> int:
        return len(self._nodes)

    def __bool__(self) -> bool:
        return bool(self._nodes)

    def __contains__(self, req: object) -> bool:
        return req in self._nodes

    def __iter__(self) -> Iterator[Request]:
        node = self._root.next
        while node is not self._root:
            if node.is_linked:
                yield node.req
            node = node.next

    def __getitem__(self, index: int) -> Request:
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("RequestQueue index out of range")
        for i, req in enumerate(self):
            if i == index:
                return req
        raise IndexError("RequestQueue index out of range")

    def __repr__(self) -> str:
        return f"RequestQueue({[r.req_id for r in self]})"

    def _link(self, req: Request, after: _Node) -> None:
        if req in self._nodes:
            raise ValueError(f"request {req.req_id!r} is already queued")
        node = _Node(req)
        node.prev, node.next = after, after.next
        after.next.prev = node
        after.next = node
        self._nodes[req] = node

    def append(self, req: Request) -> None:
        self._link(req, self._root.prev)

    def appendleft(self, req: Request) -> None:
        self._link(req, self._root)

    def extend(self, reqs: Iterable[Request]) -> None:
        for req in reqs:
            self.append(req)

    def remove(self, req: Request) -> None:
        node = self._nodes.pop(req, None)
        if node is None:
            raise ValueError(f"request {req.req_id!r} is not queued")
        node.prev.next = node.next
        node.next.prev = node.prev
        # ``node.next`` stays as it was so that an iterator standing on this node walks on.
        node.is_linked = False

    def popleft(self) -> Request:
        if not self._nodes:
            raise IndexError("pop from an empty RequestQueue")
        req = self._root.next.req
        self.remove(req)
        return req
