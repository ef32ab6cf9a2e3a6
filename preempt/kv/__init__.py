"""Where a preempted request's KV goes and how it comes back.

- `record`: `PreemptionRecord` (what a preemption did to the KV; the scheduler owns and
  writes it), `is_preemption`, the `KVMover` interface the scheduler calls and its
  results `SaveResult` / `RestoreResult`;
- `saver`: the `KVMover`: owns the host copies and returns each move's result, composed of
  `blobs` (a segment into one host-pool blob and back: codecs, head plan, workers),
  `timing` (virtual time of each move, and when copied-out blocks are free again) and
  `speculative` (early copies, restores started before admission, their accounting);
  `segment`: a host copy's blobs and the futures of what a worker learns later;
- `copy_out`: blocks still being copied out (the one model of it: the scheduler feeds
  it, the engine stalls by it);
- `codec`: raw / zstd / mixed-precision blobs; `host_pool`: the pinned host arena of slots;
- `kv_cache`: the device KV tensors.

Acting code: it moves bytes when told to. Who is saved, restored or prefetched is decided
in `preempt.engine.engine` (scheduler, early-save policies, prefetcher), which imports this
package; this package never imports `preempt.engine.engine`.
"""
