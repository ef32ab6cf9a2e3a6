"""Speculative KV copies, both ways: early saves of running requests, and restores started
before admission (restore prefetch, and its host decode ahead).

Owns: which requests hold such copies and the counters of what became of them. Every
speculative byte ends used (claimed by a preemption's save, or by the restore at
admission), wasted (the request finished or was aborted, evicted for a demand save, or a
prefetch cancelled) or is held now; the property tests check that after every step.

Bookkeeping only, plain Python: the saver moves the bytes and frees the host slots;
preempt.early.early_save and preempt.early.prefetch decide whom to copy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

from preempt.core.request import Request
from preempt.kv.store import Segment, in_flight


class EarlyCopies:
    """Early segments of running requests, oldest first, until a preemption claims them."""

    def __init__(self) -> None:
        # Keyed by the request object (identity, and a live reference: an id() could be
        # reused by a new request once an old one is garbage-collected).
        self._segments: dict[Request, list[Segment]] = {}
        self.num_early_saves = 0
        self.early_bytes_raw = 0
        self.early_bytes_used = 0  # claimed by a preemption: that much less to copy then
        self.early_bytes_wasted = 0  # freed unused: the request finished, or evicted for space
        self.speculative_bytes = 0  # raw bytes of unclaimed early segments held now
        # Early saves asked for with new full blocks that the saver turned down (speculation
        # budget, in-flight bound, no spare host slot): warnings that copied nothing.
        self.num_refused = 0

    def covered(self, request: Request) -> int:
        """Tokens of `request` already copied early (from token 0)."""
        return sum(segment.num_tokens for segment in self._segments.get(request, ()))

    def add(self, request: Request, segment: Segment) -> None:
        self._segments.setdefault(request, []).append(segment)
        self.num_early_saves += 1
        self.early_bytes_raw += segment.nbytes_raw
        self.speculative_bytes += segment.nbytes_raw

    def take(self, request: Request) -> list[Segment]:
        """Hand over (and forget) the request's early segments; still speculative until
        `claimed` (or freed by the caller)."""
        return self._segments.pop(request, [])

    def claimed(self, segments: list[Segment]) -> None:
        """A preemption's save uses these segments: no longer speculation."""
        for segment in segments:
            segment.speculative = False
            self.speculative_bytes -= segment.nbytes_raw
            self.early_bytes_used += segment.nbytes_raw

    def freed(self, segment: Segment, wasted: bool) -> None:
        """The saver freed a segment's slot; count it if it was still speculative."""
        if segment.speculative:
            self.speculative_bytes -= segment.nbytes_raw
            if wasted:
                self.early_bytes_wasted += segment.nbytes_raw
            segment.speculative = False

    def held(self) -> Mapping[Request, Sequence[Segment]]:
        """Read-only: each request's unclaimed early segments, oldest first (for a probe
        that measures them, preempt.bench.early; only this class changes them)."""
        return MappingProxyType(self._segments)

    def evictable(self) -> list[list[Segment]]:
        """Every request's unclaimed early segments (to free them for a demand save)."""
        return [segments for segments in self._segments.values() if segments]

    def num_in_flight(self, now: float) -> int:
        return sum(
            1 for segments in self._segments.values() for segment in segments if in_flight(segment, now)
        )


@dataclass
class Prefetched:
    """A restore started before admission: the KV already sits in the request's blocks
    `block_ids`; the host copy stays until the restore claims it."""

    block_ids: list[int]
    ok: bool
    dropped: np.ndarray | None
    end_s: float  # virtual: when its host-to-device copy ends
    nbytes: int  # raw bytes copied in


@dataclass
class Predecoded:
    """A host decode started before admission: the decoded KV waits in host memory."""

    end_s: float  # virtual: when the decode ends
    nbytes: int  # decoded (raw) bytes held on the host


class RestoresAhead:
    """Restores (and host decodes) of waiting requests started before their admission."""

    def __init__(self) -> None:
        self.prefetched: dict[Request, Prefetched] = {}
        self.predecoded: dict[Request, Predecoded] = {}
        self.num_predecodes = 0
        self.predecode_bytes = 0
        self.predecode_bytes_used = 0
        self.predecode_bytes_wasted = 0  # the request was aborted
        self.num_prefetches = 0
        # Restores that found work done ahead (a copy-in, else a decode): `hits` where it
        # had ended by the admission (nothing left to wait for), `late` where it was still
        # running then (started too late to hide all of it: most of a full pool's copy-ins,
        # started by the hook right before the admission's step).
        self.num_prefetch_hits = 0
        self.num_prefetch_hits_late = 0
        self.num_prefetch_misses = 0  # restores (with prefetch on) that had to start then
        self.prefetch_bytes = 0
        self.prefetch_bytes_used = 0
        self.prefetch_bytes_wasted = 0  # cancelled (blocks needed) or the request aborted

    @property
    def prefetch_bytes_held(self) -> int:
        return sum(p.nbytes for p in self.prefetched.values())

    @property
    def predecode_bytes_held(self) -> int:
        return sum(p.nbytes for p in self.predecoded.values())

    def add_prefetch(self, request: Request, prefetched: Prefetched) -> None:
        self.prefetched[request] = prefetched
        self.num_prefetches += 1
        self.prefetch_bytes += prefetched.nbytes

    def add_predecode(self, request: Request, predecoded: Predecoded) -> None:
        self.predecoded[request] = predecoded
        self.num_predecodes += 1
        self.predecode_bytes += predecoded.nbytes

    def claim(self, request: Request, now: float) -> tuple[Prefetched | None, Predecoded | None]:
        """At the restore (at `now`): take what was done ahead for `request` (counted used;
        a hit if it had ended by `now`, else late)."""
        prefetched = self.prefetched.pop(request, None)
        predecoded = self.predecoded.pop(request, None)
        if predecoded is not None:
            self.predecode_bytes_used += predecoded.nbytes
        if prefetched is not None and prefetched.block_ids != request.block_ids[: len(prefetched.block_ids)]:
            # Cannot happen while only the prefetcher hands blocks out: never trust it then.
            self.prefetch_bytes_wasted += prefetched.nbytes
            prefetched = None
        if prefetched is not None:
            self.prefetch_bytes_used += prefetched.nbytes
            self._count_hit(prefetched.end_s, now)
        elif predecoded is not None:
            self._count_hit(predecoded.end_s, now)
        return prefetched, predecoded

    def _count_hit(self, end_s: float, now: float) -> None:
        if end_s <= now:
            self.num_prefetch_hits += 1
        else:
            self.num_prefetch_hits_late += 1

    def cancel(self, request: Request) -> None:
        """Drop a prefetched restore (its blocks are freed by the caller): the copy-in was wasted."""
        prefetched = self.prefetched.pop(request, None)
        if prefetched is not None:
            self.prefetch_bytes_wasted += prefetched.nbytes

    def discard(self, request: Request) -> None:
        """The request was aborted: whatever was done ahead for it was wasted."""
        self.cancel(request)
        predecoded = self.predecoded.pop(request, None)
        if predecoded is not None:
            self.predecode_bytes_wasted += predecoded.nbytes

    def stats(self) -> dict[str, int]:
        return {
            "num_prefetches": self.num_prefetches,
            "num_prefetch_hits": self.num_prefetch_hits,
            "num_prefetch_hits_late": self.num_prefetch_hits_late,
            "num_prefetch_misses": self.num_prefetch_misses,
            "prefetch_bytes": self.prefetch_bytes,
            "prefetch_bytes_used": self.prefetch_bytes_used,
            "prefetch_bytes_wasted": self.prefetch_bytes_wasted,
            "num_predecodes": self.num_predecodes,
            "predecode_bytes": self.predecode_bytes,
            "predecode_bytes_used": self.predecode_bytes_used,
            "predecode_bytes_wasted": self.predecode_bytes_wasted,
        }
