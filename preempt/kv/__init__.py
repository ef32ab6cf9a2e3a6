"""Where a preempted request's KV goes and how it comes back.

- `record`: `PreemptionRecord` (what a preemption did to the KV), the `KVMover`
  interface the scheduler calls, `MODE_CODEC`;
- `saver`: the data path and its timing (device blocks -> codec -> host slot, and back;
  early copies, restore prefetch);
- `codec`: raw / zstd / mixed-precision blobs; `host_pool`: the pinned host arena of slots;
- `kv_cache`: the device KV tensors.

Acting code: it moves bytes when told to. Who is saved, restored or prefetched is decided
in `preempt.engine.engine` (scheduler, early-save policies, prefetcher), which imports this
package; this package never imports `preempt.engine.engine`.
"""
