"""Fault injection for preempt's KV connector, loaded by vLLM itself through
`kv_connector_module_path` (tests/integrations/test_vllm_connector.py). Runs in the peer."""

from __future__ import annotations

import time

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from preempt.integrations.vllm.connector import PreemptKVConnector
from preempt.kv.store import resolve

STORE_DELAY_S = 0.3


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


class SlowStoringConnector(PreemptKVConnector):
    """Every store takes `STORE_DELAY_S` more on the encode worker, so vLLM is ready to
    resume victims whose copies are still being stored (vLLM #46014's assert on
    re-admission while a store is in flight): they must wait, then load."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.WORKER:
            host = self.store.store
            store = host._store

            def slow_store(*args, **kwargs):
                time.sleep(STORE_DELAY_S)
                return store(*args, **kwargs)

            host._store = slow_store


LOAD_DELAY_S = 0.3


class SlowLoadingConnector(PreemptKVConnector):
    """Every load takes `LOAD_DELAY_S` more on the load thread, so a client can go away
    while its request's KV is still being loaded into blocks vLLM gave it: vLLM must not
    free those blocks before the connector reports the load finished."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.WORKER:
            load = self.store.load

            def slow_load(*args, **kwargs):
                time.sleep(LOAD_DELAY_S)
                return load(*args, **kwargs)

            self.store.load = slow_load


class BrokenLoadingConnector(PreemptKVConnector):
    """Every other load raises an error that is not a failed checksum (a bug, a device
    error): the request must recompute and the engine keep serving."""

    def __init__(self, vllm_config, role, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        if role == KVConnectorRole.WORKER:
            load, count = self.store.load, [0]

            def broken_load(*args, **kwargs):
                count[0] += 1
                if count[0] % 2:
                    raise RuntimeError("injected load failure")
                return load(*args, **kwargs)

            self.store.load = broken_load
