"""Fault injection for preempt's KV connector, loaded by vLLM itself through
`kv_connector_module_path` (tests/integrations/test_vllm_connector.py). Runs in the peer."""

from __future__ import annotations

from preempt.integrations.vllm.connector import PreemptKVConnector
from preempt.kv.store import resolve


class CorruptingConnector(PreemptKVConnector):
    """Flips one byte of every other saved copy just before it is loaded: the checksum
    must catch it and vLLM must recompute that request."""

    num_loads = 0

    def start_load_kv(self, forward_context, **kwargs) -> None:
        for job in getattr(self._connector_metadata, "loads", ()):
            self.store.wait(job.request_id)
            copy = self.store.copies.get(job.request_id)
            handle = resolve(copy.segments[0].handle) if copy and copy.segments else None
            if handle is not None and self.num_loads % 2 == 0:
                self.store.pool._array[handle.offset + handle.nbytes // 2] ^= 0xFF
            self.num_loads += 1
        super().start_load_kv(forward_context, **kwargs)
