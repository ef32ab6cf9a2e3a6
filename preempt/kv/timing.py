"""Virtual time of KV moves: the PCIe link, the host codec and the device-side packing.

Owns: the link timelines on the virtual clock (demand saves' device-to-host copies,
speculative copies below them, restores' host-to-device copies, the prefetch's host
decode lanes). Each save's copy-out end goes back in its result; what a step that
reuses the freed blocks waits for is preempt.kv.copy_out.

A save is the target's KV bytes crossing PCIe on a device-to-host copy timeline (the
blocks are busy until that copy ends), then the host-side encode at the codec's
calibrated throughput; a restore is decode plus the host-to-device copy. What each part costs
is the codec's (`Codec.device_time`, `Codec.host_time_s`): `mixed` packs on the device first
(one HBM pass reading the raw and writing the packed bytes), so only the packed bytes cross
PCIe. Plain Python: times from sizes, no data moves here.
"""

from __future__ import annotations

from collections.abc import Mapping

from preempt.core.cost_model import CostModel
from preempt.kv.codec import Codec
from preempt.kv.store import SavedCopy


class VirtualTiming:
    def __init__(
        self,
        cost_model: CostModel,
        codecs: Mapping[str, Codec],
        encode_mb_s: Mapping[str, float],
        decode_mb_s: Mapping[str, float],
        staged_restores: bool,
        num_decode_lanes: int,
    ) -> None:
        self.encode_mb_s = encode_mb_s  # codec name -> calibrated host throughput (0: free)
        self.decode_mb_s = decode_mb_s
        self.cost_model = cost_model
        self.codecs = codecs
        # With restore prefetch on, a restore of a blob still encoding copies back its raw
        # staging bytes instead of waiting for the encode (see `restore_end`).
        self.staged_restores = staged_restores
        self._d2h_free_at = 0.0  # demand saves' copy timeline
        self._early_d2h_free_at = 0.0  # speculative copies, below demand saves
        self._h2d_free_at = 0.0
        self._decode_free_at = [0.0] * num_decode_lanes  # the prefetch's host decode threads
        self.restore_end_s = 0.0  # when the latest restore's copy-in ends

    # ----------------------------------------------------------------- saves
    def save(self, num_tokens: int, codec: str, now: float, speculative: bool) -> tuple[float, float]:
        """(copy end, host copy ready) of a save starting at `now`. Demand saves have
        priority on the device-to-host link (as on a dedicated high-priority stream):
        they queue only behind each other; speculative copies go when it is free."""
        device_s, copy_bytes = self.device_side(num_tokens, codec)
        # One duplex link: a copy-out while a restore still streams in shares the both-ways rate.
        both_ways = self._h2d_free_at > now
        duration = device_s + self.cost_model.copy_time_s(copy_bytes, both_ways=both_ways)
        if speculative:
            start = max(now, self._d2h_free_at, self._early_d2h_free_at)
            self._early_d2h_free_at = copy_end = start + duration
        else:
            start = max(now, self._d2h_free_at)
            self._d2h_free_at = copy_end = start + duration
        return copy_end, copy_end + self.host_s(copy_bytes, codec, self.encode_mb_s)

    # ----------------------------------------------------------------- restores
    def restore_end(self, saved: SavedCopy, now: float, decoded_s: float | None = None) -> float:
        """When a restore of `saved` started at `now` ends (decode, then the host-to-device
        copy, queued on the link); takes the link until then. With `decoded_s` the host
        decode was done ahead (it ends then) and only the copy is left."""
        if self.staged_restores:
            return self._staged_restore_end(saved, now, decoded_s)
        ready = max([now, *(segment.ready_at_s for segment in saved.segments)])
        end = max(ready, self._h2d_free_at, decoded_s or 0.0)
        for segment in saved.segments:
            device_s, copy_bytes = self.device_side(segment.num_tokens, segment.codec)
            if decoded_s is None:
                end += self.host_s(copy_bytes, segment.codec, self.decode_mb_s)
            both_ways = max(self._d2h_free_at, self._early_d2h_free_at) > end  # saves still copying out
            end += self.cost_model.copy_time_s(copy_bytes, both_ways=both_ways) + device_s
        self._h2d_free_at = end
        return end

    def _staged_restore_end(self, saved: SavedCopy, now: float, decoded_s: float | None) -> float:
        """`restore_end` with prefetch on: a segment whose host encode is still running at
        `now` is copied back from its raw staging bytes (on the host since its copy-out
        ended), neither waiting for the encode nor decoding; the others wait for their
        blob (or the decode done ahead) and decode as usual."""
        end = max(now, self._h2d_free_at)
        for segment in saved.segments:
            device_s, copy_bytes = self.device_side(segment.num_tokens, segment.codec)
            if segment.ready_at_s > now:  # still encoding: the raw staging copy
                end = max(end, segment.copy_end_s)
            elif decoded_s is not None:
                end = max(end, decoded_s)
            else:
                end = max(end, segment.ready_at_s)
                end += self.host_s(copy_bytes, segment.codec, self.decode_mb_s)
            both_ways = max(self._d2h_free_at, self._early_d2h_free_at) > end  # saves still copying out
            end += self.cost_model.copy_time_s(copy_bytes, both_ways=both_ways) + device_s
        self._h2d_free_at = end
        return end

    def restored(self, end_s: float) -> None:
        """A restore that compute waits for ends at `end_s`."""
        self.restore_end_s = max(self.restore_end_s, end_s)

    def predecode_end(self, saved: SavedCopy, now: float) -> float:
        """When a host decode of `saved` started at `now` on the freest decode lane ends
        (blobs still encoding are skipped: their raw staging bytes need no decode)."""
        lane = min(range(len(self._decode_free_at)), key=self._decode_free_at.__getitem__)
        blobs_ready = [s.ready_at_s for s in saved.segments if s.ready_at_s <= now]
        end = max([now, self._decode_free_at[lane], *blobs_ready])
        for segment in saved.segments:
            _, copy_bytes = self.device_side(segment.num_tokens, segment.codec)
            if segment.ready_at_s <= now:
                end += self.host_s(copy_bytes, segment.codec, self.decode_mb_s)
        self._decode_free_at[lane] = end
        return end

    # ----------------------------------------------------------------- costs
    def device_side(self, num_tokens: int, codec: str) -> tuple[float, float]:
        """(device kernel seconds, bytes over PCIe) of moving `num_tokens` of the
        deployment's KV through `codec`."""
        nbytes = num_tokens * self.cost_model.target.kv_bytes_per_token
        return self.codecs[codec].device_time(nbytes, self.cost_model)

    def host_s(self, nbytes: float, codec: str, mb_s: Mapping[str, float]) -> float:
        """Host codec seconds for `nbytes` at the throughputs `mb_s`."""
        return self.codecs[codec].host_time_s(nbytes, mb_s)

    def needs_decode(self, saved: SavedCopy) -> bool:
        """The copy costs host decode time on restore (zstd; mixed with zstd)."""
        mb_s = self.decode_mb_s
        return any(self.host_s(1.0, segment.codec, mb_s) > 0 for segment in saved.segments)
