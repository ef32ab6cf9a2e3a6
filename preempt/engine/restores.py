"""Asynchronous restores in flight (`preemption.async_restore`, virtual clock).

A request admitted with its KV on the host may wait READY out of the batch while its
copy-in runs: its blocks and its seat are held, and it joins the batch, in admission
order, on the first step at or after the copy-in (and the copy-out of any block it
reuses) ends. The scheduler decides who starts one; this class keeps who is waiting,
until when, and what the waits added up to.

A READY request counts against `max_num_seqs`, as a synchronous restore's seat would:
vLLM does not count a WAITING_FOR_REMOTE_KVS request as running (it parks it in a
KV-holding queue drained first once loaded), but then a loaded request can be left
holding blocks without a seat, and the priority trigger would no longer see who waits;
here only the batch's wait differs from a synchronous restore. A READY request is never
a victim (it is not running); a restore that falls back (unusable copy) recomputes.
"""

from __future__ import annotations

from collections.abc import Iterator

from preempt.core.request import Request


class AsyncRestores:
    """READY requests in admission order, each with the time its copy-in ends and the time
    it was admitted."""

    def __init__(self) -> None:
        self.requests: list[Request] = []  # admission order
        self._times: dict[Request, tuple[float, float]] = {}  # (ready_s, admitted_s)
        self.num_started = 0  # requests that waited out of the batch for their copy-in
        self.wait_s = 0.0  # their time from admission to joining the batch, summed

    def __bool__(self) -> bool:
        return bool(self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __contains__(self, request: Request) -> bool:
        return request in self._times

    def start(self, request: Request, ready_s: float, now: float) -> None:
        """`request` (admitted now) waits READY until `ready_s`."""
        self.num_started += 1
        self.requests.append(request)
        self._times[request] = (ready_s, now)

    def next_ready_s(self) -> float | None:
        """When the first copy-in in flight ends (None: none is)."""
        if not self.requests:
            return None
        return min(ready for ready, _ in self._times.values())

    def ready_at(self, request: Request) -> tuple[float, float]:
        """(when its copy-in ends, when it was admitted)."""
        return self._times[request]

    def pop_ready(self, now: float) -> list[Request]:
        """Those whose copy-in has ended by `now`, out of the waiting set, admission order;
        their waits are added to `wait_s`."""
        ready, still = [], []
        for request in self.requests:
            ready_s, admitted_s = self._times[request]
            if ready_s <= now:
                del self._times[request]
                self.wait_s += now - admitted_s
                ready.append(request)
            else:
                still.append(request)
        self.requests = still
        return ready

    def remove(self, request: Request) -> None:
        """Take out a READY request that ends before joining (aborted, finished)."""
        self.requests.remove(request)
        del self._times[request]
