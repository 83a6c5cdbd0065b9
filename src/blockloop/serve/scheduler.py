"""First-come-first-served slot scheduling: waiting requests take free slots, finished ones give them back."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from heapq import heappop, heappush
from itertools import islice

from blockloop.serve.requests import Request, RequestStatus


class Scheduler:
    """A FIFO queue of WAITING requests and a table of RUNNING ones by slot."""

    def __init__(self, n_slots: int) -> None:
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.free: list[int] = list(range(n_slots))  # a heap: the lowest free slot first

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def admit(self, fits: Callable[[list[Request]], bool]) -> list[tuple[int, Request]]:
        """Pop the longest run of waiting requests, from the head of the queue, that ``fits(requests)`` lets in
        together, into free slots (lowest slot first), marking them RUNNING; the next one waits, first in line.
        ``fits`` must never hold for a longer run when it fails for a shorter one (room only shrinks as requests
        join), so the run is found with a few checks by bisection rather than one per request: asked once per
        request, over the group so far, admitting thousands at once took seconds of host time."""
        n = min(len(self.waiting), len(self.free))
        candidates = list(islice(self.waiting, n))
        if n and not fits(candidates):
            low, high = 0, n - 1  # fits(candidates[:low]) holds; fits(candidates[:high + 1]) does not
            while low < high:
                mid = (low + high + 1) // 2
                low, high = (mid, high) if fits(candidates[:mid]) else (low, mid - 1)
            n = low
        admitted: list[tuple[int, Request]] = []
        for _ in range(n):
            slot, request = heappop(self.free), self.waiting.popleft()
            request.status, request.slot = RequestStatus.RUNNING, slot
            self.running[slot] = request
            admitted.append((slot, request))
        return admitted

    def release(self, slot: int) -> None:
        del self.running[slot]
        heappush(self.free, slot)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
