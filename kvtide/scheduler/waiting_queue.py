"""WaitingQueue: the requests waiting to be scheduled, in the scheduling policy's order."""

from __future__ import annotations

import heapq
import itertools
from collections import deque

from kvtide.engine.request import Request


class WaitingQueue:
    """FCFS (a deque; preempted requests return to the front) or priority (a heap on
    (priority, arrival))."""

    def __init__(self, policy: str) -> None:
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling policy must be 'fcfs' or 'priority', got {policy!r}")
        self.policy = policy
        self._deque: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._deque) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self):
        if self.policy == "fcfs":
            return iter(self._deque)
        return (item[-1] for item in sorted(self._heap))

    def add(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._deque.append(request)
        else:
            heapq.heappush(self._heap, (*request.sort_key(), next(self._counter), request))

    def add_front(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._deque.appendleft(request)
        else:
            self.add(request)

    def peek(self) -> Request:
        return self._deque[0] if self.policy == "fcfs" else self._heap[0][-1]

    def pop(self) -> Request:
        return self._deque.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[-1]

    def remove(self, requests: set[Request]) -> None:
        if self.policy == "fcfs":
            self._deque = deque(r for r in self._deque if r not in requests)
        else:
            self._heap = [item for item in self._heap if item[-1] not in requests]
            heapq.heapify(self._heap)
