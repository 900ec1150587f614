"""Admission of generation requests, fair between tenants (the OpenAI routes' one place for it).

Three limits, in this order:

* a tenant holds at most ``per_tenant`` requests in flight (queued or decoding): one more is
  refused with 429 -- the default (16) lets one client stream 16 requests at once;
* the server holds at most ``max_queue`` in all: one more is refused with 503;
* of the admitted requests, at most ``slots`` sequences (a request of ``n`` choices is ``n``)
  are handed to the backend at once (its ``max_running``); the others wait here, and a freed
  slot goes to the waiting tenant that holds the fewest slots, among those the one granted
  longest ago (round robin), first come first served within a tenant. So tenant A's 16 queued requests do not starve tenant B: B's first request takes
  the next free slot ahead of all of A's that wait. (The backend's own queue is FIFO: without
  this gate B would wait behind every one of A's.)

Everything runs on the server's event loop (no lock); ``active`` is read by other threads
for a glance only.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import defaultdict, deque
from dataclasses import dataclass


class Refused(Exception):
    """Not admitted: ``status`` 429 (the tenant's limit) or 503 (the server's)."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


@dataclass
class _Waiter:
    need: int
    order: int
    ready: asyncio.Future


class FairGate:
    """See the module docstring."""

    def __init__(self, per_tenant: int, max_queue: int, slots: int):
        if min(per_tenant, max_queue, slots) < 1:
            raise ValueError("per_tenant, max_queue and slots must be >= 1")
        self.per_tenant, self.max_queue, self.slots = per_tenant, max_queue, slots
        self.active: defaultdict[str, int] = defaultdict(int)
        """Requests in flight per tenant (waiting here or in the backend)."""
        self.held: defaultdict[str, int] = defaultdict(int)
        """Backend slots each tenant holds now."""
        self.free = slots
        self._waiting: defaultdict[str, deque[_Waiter]] = defaultdict(deque)
        self._order = itertools.count()
        self._granted: dict[str, int] = {}
        """Each tenant's last grant (an ``_order`` tick): the round robin's tie-break."""

    def admit(self, tenant: str) -> None:
        """Count one request of ``tenant`` in flight, or raise ``Refused``."""
        if self.active[tenant] >= self.per_tenant:
            raise Refused(429)
        if sum(self.active.values()) >= self.max_queue:
            raise Refused(503)
        self.active[tenant] += 1

    def leave(self, tenant: str) -> None:
        """The request ``admit`` counted has ended."""
        self.active[tenant] -= 1

    async def acquire(self, tenant: str, n: int) -> int:
        """Wait for ``n`` backend slots (at most ``slots``); returns how many were taken."""
        need = min(n, self.slots)
        if need <= self.free and not any(self._waiting.values()):
            self._take(tenant, need)
            return need
        w = _Waiter(need, next(self._order), asyncio.get_running_loop().create_future())
        self._waiting[tenant].append(w)
        try:
            await w.ready
        except asyncio.CancelledError:
            if w.ready.done() and not w.ready.cancelled():
                self.release(tenant, need)  # granted as it was cancelled: give it back
            elif w in self._waiting[tenant]:
                self._waiting[tenant].remove(w)
            raise
        return need

    def release(self, tenant: str, taken: int) -> None:
        """Give back what ``acquire`` took; the freed slots go to waiters, fairly."""
        self.held[tenant] -= taken
        self.free += taken
        self._grant()

    def _take(self, tenant: str, need: int) -> None:
        self.free -= need
        self.held[tenant] += need
        self._granted[tenant] = next(self._order)

    def _grant(self) -> None:
        while True:
            queued = [(self.held[t], self._granted.get(t, -1), q[0].order, t)
                      for t, q in self._waiting.items() if q]
            if not queued:
                return
            t = min(queued)[-1]  # fewest slots held, then granted longest ago
            w = self._waiting[t][0]
            if w.need > self.free:
                return  # it waits for more to free: later ones do not overtake it
            self._waiting[t].popleft()
            self._take(t, w.need)
            w.ready.set_result(None)
