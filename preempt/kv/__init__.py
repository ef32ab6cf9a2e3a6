"""Where a preempted request's KV goes and how it comes back.

- `record`: `PreemptionRecord` (what a preemption did to the KV; the scheduler owns and
  writes it), `is_preemption`, the `KVMover` interface the scheduler calls and its
  results `SaveResult` / `RestoreResult`;
- `saver`: the `KVMover`: owns the host copies and returns each move's result, composed of
  `blobs` (the engine's side of the host store: its codecs, KV cache and workers),
  `timing` (virtual time of each move, and when copied-out blocks are free again) and
  `speculative` (early copies, restores started before admission, their accounting);
- `store`: the one home of a host copy, for the engine and the vLLM connector alike: a
  segment (one blob) and a saved copy, the encode worker, the host store that saves a
  segment out of a paged cache and restores it, and copies by request id;
- `copy_out`: blocks still being copied out (the one model of it: the scheduler feeds
  it, the engine stalls by it);
- `codec`: raw / zstd / mixed-precision / fp8 blobs, each codec one class with its device
  side (gather, scatter, what it costs); `host_pool`: the pinned host arena;
- `kv_cache`: the device KV tensors.

Acting code: it moves bytes when told to. Who is saved, restored or prefetched is decided
in `preempt.engine.engine` (scheduler, early-save policies, prefetcher), which imports this
package; this package never imports `preempt.engine.engine`.
"""

from preempt.core.registry import CODECS

# The codecs, by the name a config gives them (imported when first built).
CODECS.add("raw", "preempt.kv.codec:RawCodec")
CODECS.add("zstd", "preempt.kv.codec:ZstdCodec")
CODECS.add("mixed", "preempt.kv.codec:MixedCodec")
CODECS.add("fp8", "preempt.kv.codec:Fp8Codec")
CODECS.add("lz4", "preempt.kv.lz4:Lz4Codec")
