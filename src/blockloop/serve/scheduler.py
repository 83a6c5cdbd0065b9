"""First-come-first-served slot scheduling: waiting requests take free slots, finished ones give them back."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from blockloop.serve.requests import Request, RequestStatus


class Scheduler:
    """A FIFO queue of WAITING requests and a table of RUNNING ones by slot."""

    def __init__(self, n_slots: int) -> None:
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Request] = {}
        self.free: list[int] = list(range(n_slots - 1, -1, -1))

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def admit(self, fits: Callable[[list[Request], Request], bool]) -> list[tuple[int, Request]]:
        """Pop waiting requests into free slots (lowest slot first), marking them RUNNING; stop at the first
        request that ``fits(admitted so far, request)`` rejects (it waits, first in line)."""
        admitted: list[tuple[int, Request]] = []
        while self.waiting and self.free:
            if not fits([r for _, r in admitted], self.waiting[0]):
                break
            slot, request = self.free.pop(), self.waiting.popleft()
            request.status, request.slot = RequestStatus.RUNNING, slot
            self.running[slot] = request
            admitted.append((slot, request))
        return admitted

    def release(self, slot: int) -> None:
        del self.running[slot]
        self.free.append(slot)
        self.free.sort(reverse=True)

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.running
