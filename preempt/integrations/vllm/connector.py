"""`PreemptKVConnector`: vLLM 0.32's preempted requests resume from preempt's host pool.

vLLM V1 preempts by recompute only: `Scheduler._preempt_request` frees the victim's blocks
at once and, on resume, the whole sequence is prefilled again. This connector (vLLM's
KV-connector API, loaded by module path) saves the victim's KV before its blocks are
reused and, when the request is admitted again, has vLLM load it instead of recomputing:

    vllm serve MODEL --scheduler-cls preempt.integrations.vllm.scheduler.PreemptScheduler \\
      --kv-transfer-config '{"kv_connector": "PreemptKVConnector",
        "kv_connector_module_path": "preempt.integrations.vllm.connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"preempt": {"codec": "raw"}}}'

Two halves, as every vLLM connector (docs/vllm_plugin.md, "Save and restore"):
- scheduler side (the engine core): follows every request's block table from the
  scheduler's outputs, so when `preempted_req_ids` names a victim it knows the blocks and
  how many tokens they hold; asks the plugin (`SaveAdvisor`, set by `PreemptScheduler`)
  whether to save it and which running requests to copy early; on re-admission reports
  the saved tokens to `get_num_new_matched_tokens` (None while the copy is still being
  stored; asynchronous by default, `loads`) and plans the load into the new blocks.
- worker side (where the KV lives): `handle_preemptions` runs before the step's new blocks
  are zeroed and before the forward pass, the last moment the victim's blocks still hold
  its KV: it gathers them (`kv_store.PagedKV`) and hands the encode to a worker thread
  (`preempt.kv.store.CopiesById`, over the engine's host store). `start_load_kv` hands a
  copy's decode into the new blocks to a load thread (`loads: async`, vLLM's load-ready
  protocol: the request waits in WAITING_FOR_REMOTE_KVS, its blocks its own, and
  `get_finished` reports the load once the thread is done, so no forward pass waits for
  it) or decodes it before the forward pass (`loads: sync`). A copy that cannot be stored
  (full pool, too large) is reported back and the request recomputes; one that fails to
  decode is reported as invalid blocks, which vLLM recomputes (`kv_load_failure_policy:
  recompute`, required), and an asynchronous one is still reported finished (vLLM frees or
  recomputes from there: an aborted request's blocks are freed only then).

Lossy copies (`fp8`, `mixed`) are never served to another request through vLLM's prefix
cache: blocks of a request that loaded one are not cached (`bind_kv_cache_manager`).
Imports vLLM; never import it from preempt's own code paths.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from preempt.integrations.vllm.kv_store import (
    PagedKV,
    check_transfer_config,
    host_copies,
    make_store_codec,
    never_cache,
)
from preempt.integrations.vllm.metrics import ConnectorMetrics, ConnectorMetricsExport
from preempt.kv.codec import CorruptBlobError
from preempt.kv.store import CopyReport

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput

logger = logging.getLogger("preempt.connector")


class SaveAdvisor(Protocol):
    """What the plugin decides for the connector (`PreemptScheduler` provides it)."""

    def should_save(self, request_id: str, num_tokens: int) -> bool: ...

    def early_targets(self, tables: dict[str, tuple[list[int], int]]) -> list[str]: ...

    def observe_save(self, num_tokens: int, seconds: float) -> None: ...

    def observe_load(self, num_tokens: int, seconds: float) -> None: ...


@dataclass
class CopyJob:
    """Tokens `[start, end)` of request `request_id`, whose block table is `block_ids`."""

    request_id: str
    block_ids: list[int]
    start: int
    end: int


@dataclass
class PreemptConnectorMetadata(KVConnectorMetadata):
    saves: list[CopyJob] = field(default_factory=list)  # victims of this step: copy now
    early: list[CopyJob] = field(default_factory=list)  # running requests: copy ahead
    loads: list[CopyJob] = field(default_factory=list)  # resumed requests: fill their blocks
    discards: list[str] = field(default_factory=list)  # copies no one will load


@dataclass
class PreemptWorkerMetadata(KVConnectorWorkerMetadata):
    stores: dict[str, CopyReport] = field(default_factory=dict)  # finished since the last step
    loads: dict[str, CopyReport] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        # Tensor-parallel workers each hold their shard's copy: a copy is whole only if
        # every worker stored (loaded) it, so an error anywhere wins.
        assert isinstance(other, PreemptWorkerMetadata)
        for mine, theirs in ((self.stores, other.stores), (self.loads, other.loads)):
            for request_id, report in theirs.items():
                if request_id not in mine or report.error is not None:
                    mine[request_id] = report
        return self


def _failed_load(err: Exception) -> CopyReport:
    """A load that raised: `corrupt` (the copy failed its checks) or `load` (anything else)."""
    if isinstance(err, CorruptBlobError):
        return CopyReport(error=f"corrupt: {err}")
    return CopyReport(error=f"load: {type(err).__name__}: {err}")


class PreemptKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.settings = check_transfer_config(self._kv_transfer_config)
        groups = kv_cache_config.kv_cache_groups if kv_cache_config is not None else []
        if len(groups) != 1:
            raise ValueError(
                "preempt's connector needs one KV cache group (one attention type); "
                f"this model has {len(groups)}"
            )
        self.spec = groups[0].kv_cache_spec
        self.layer_names = list(groups[0].layer_names)
        self.num_blocks = kv_cache_config.num_blocks
        self.block_size = self.spec.block_size
        if role == KVConnectorRole.SCHEDULER:
            self.advisor: SaveAdvisor | None = None
            self.tables: dict[str, tuple[list[int], int]] = {}  # request -> (block table, tokens with KV)
            self.copied: dict[str, int] = {}  # request -> tokens sent to the worker (early + final)
            self.saving: dict[str, int] = {}  # victim -> tokens its copy will hold, not yet stored
            self.saved: dict[str, int] = {}  # victim -> tokens its stored copy holds
            self.matched: dict[str, int] = {}  # request -> local tokens at get_num_new_matched_tokens
            self.lossy: set[str] = set()  # requests that loaded lossy KV: never prefix-cached
            self.meta = PreemptConnectorMetadata()
            self.metrics = ConnectorMetrics()
            self.export = ConnectorMetricsExport()
            self._warned_no_advisor = False
        else:
            self.store = host_copies(
                self.settings,
                make_store_codec(
                    self.settings, len(self.layer_names), self.spec.num_kv_heads, log=logger.warning
                ),
            )
            self.paged: PagedKV | None = None
            self.invalid_blocks: set[int] = set()
            self.load_reports: dict[str, CopyReport] = {}
            self.loading: dict[str, tuple[CopyJob, Future]] = {}  # asynchronous loads in flight
            logger.info(
                "preempt connector: %s codec, host pool %s (%d blocks of %d tokens per layer)",
                self.settings.codec,
                self.settings.host_pool,
                self.num_blocks,
                self.block_size,
            )

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a copy that is not made is a recompute, never a lost request

    # ================================================================ scheduler side
    def bind_kv_cache_manager(self, kv_cache_manager) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self.settings.lossless or not kv_cache_manager.enable_caching:
            return
        never_cache(kv_cache_manager.coordinator, self.lossy)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        request_id = request.request_id
        if request_id in self.saving:
            self.metrics.resume_waits += 1
            return None, False  # its copy is still being stored: ask again next step
        saved = self.saved.get(request_id)
        if saved is None:
            return 0, False
        # whole blocks (kv_store.PagedKV), and the last token is always computed (its
        # logits sample the next one): the last partial block is recomputed
        num_external = self._floor(min(saved, request.num_tokens - 1)) - num_computed_tokens
        self.matched[request_id] = num_computed_tokens
        if num_external <= 0:
            return 0, False
        if not self.settings.lossless:
            self.lossy.add(request_id)
        return num_external, self.settings.loads == "async"

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        request_id = request.request_id
        if request_id not in self.saved:
            return
        self.saved.pop(request_id)
        self.copied.pop(request_id, None)
        if num_external_tokens <= 0:  # the prefix cache held it all: the copy is not needed
            self.metrics.fallback("prefix_cache")
            self.meta.discards.append(request_id)
            return
        start = self.matched.pop(request_id, 0)
        block_ids = list(blocks.get_block_ids()[0])
        self.meta.loads.append(CopyJob(request_id, block_ids, start, start + num_external_tokens))

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        for request_id in scheduler_output.preempted_req_ids or ():
            self._on_preempted(request_id)
        if self.settings.early and self.advisor is not None:
            # The tables as of the last step: what the blocks hold when the worker gathers
            # (before this step's forward pass). A request with a copy to store or load is
            # not copied again; one resumed this step is not in them yet.
            busy = {job.request_id for job in self.meta.loads} | self.saving.keys() | self.saved.keys()
            candidates = {rid: table for rid, table in self.tables.items() if rid not in busy}
            for request_id in self.advisor.early_targets(candidates):
                self._copy_early(request_id)
        self._follow_tables(scheduler_output)
        meta, self.meta = self.meta, PreemptConnectorMetadata()
        return meta

    def _floor(self, num_tokens: int) -> int:
        return num_tokens - num_tokens % self.block_size

    def _on_preempted(self, request_id: str) -> None:
        table = self.tables.pop(request_id, None)
        if table is None or table[1] == 0:
            return
        block_ids, num_tokens = table
        self.metrics.preempted(num_tokens)
        if self.settings.saves == "none":
            return
        num_tokens = self._floor(num_tokens)
        if num_tokens == 0:
            return  # not one whole block: nothing worth a copy
        if self.advisor is None:
            if not self._warned_no_advisor:
                logger.warning(
                    "preempt connector without preempt's scheduler (--scheduler-cls %s): every victim "
                    "is saved, no early copies",
                    "preempt.integrations.vllm.scheduler.PreemptScheduler",
                )
                self._warned_no_advisor = True
        elif not self.advisor.should_save(request_id, num_tokens):
            self.metrics.fallback("cost")
            if request_id in self.copied:
                self.copied.pop(request_id)
                self.meta.discards.append(request_id)
            return
        start = self.copied.get(request_id, 0)
        self.meta.saves.append(CopyJob(request_id, block_ids, start, num_tokens))
        self.copied[request_id] = num_tokens
        self.saving[request_id] = num_tokens

    def _copy_early(self, request_id: str) -> None:
        block_ids, num_tokens = self.tables[request_id]
        start, num_tokens = self.copied.get(request_id, 0), self._floor(num_tokens)
        if num_tokens <= start:
            return  # no whole block new since the last copy
        self.meta.early.append(CopyJob(request_id, list(block_ids), start, num_tokens))
        self.copied[request_id] = num_tokens
        self.metrics.early_tokens += num_tokens - start

    def _forget(self, request_id: str) -> None:
        """A finished request: its copy, if any, goes; an early copy of a request that was
        never preempted was wasted."""
        self.tables.pop(request_id, None)
        self.lossy.discard(request_id)
        self.matched.pop(request_id, None)
        copied = self.copied.pop(request_id, None) is not None
        victim = (self.saved.pop(request_id, None) is not None) | (
            self.saving.pop(request_id, None) is not None
        )
        if copied and not victim:
            self.metrics.early_wasted += 1
        if copied or victim:
            self.meta.discards.append(request_id)

    def _follow_tables(self, scheduler_output: SchedulerOutput) -> None:
        """Each scheduled request's block table and the tokens its blocks hold once this
        step's forward pass has run (async scheduling runs it before the next step's
        `handle_preemptions`)."""
        scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            self.tables[new.req_id] = (
                list(new.block_ids[0]),
                new.num_computed_tokens + scheduled.get(new.req_id, 0),
            )
        cached = scheduler_output.scheduled_cached_reqs
        for i, request_id in enumerate(cached.req_ids):
            old = self.tables.get(request_id, ([], 0))[0]
            new_blocks = cached.new_block_ids[i]
            if request_id in cached.resumed_req_ids:
                table = list(new_blocks[0]) if new_blocks is not None else []
            else:
                table = old + list(new_blocks[0]) if new_blocks is not None else old
            self.tables[request_id] = (table, cached.num_computed_tokens[i] + scheduled.get(request_id, 0))

    def update_connector_output(self, connector_output) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, PreemptWorkerMetadata):
            for request_id, report in meta.stores.items():
                self._on_stored(request_id, report)
            for report in meta.loads.values():
                self.metrics.loaded(report)
                if report.error is None and self.advisor is not None:
                    self.advisor.observe_load(report.num_tokens, report.seconds)
        self.export.sync(self.metrics)

    def _on_stored(self, request_id: str, report: CopyReport) -> None:
        wanted = self.saving.get(request_id)
        if report.error is not None:
            self.metrics.fallback(report.error.split(":")[0])
            self.saving.pop(request_id, None)
            if self.copied.pop(request_id, None) is not None:
                self.meta.discards.append(request_id)
            return
        if wanted is None or report.num_tokens < wanted:
            return  # an early copy's segment, or a victim's copy still growing
        self.saving.pop(request_id)
        self.saved[request_id] = report.num_tokens
        self.metrics.stored(report)
        if self.advisor is not None:
            self.advisor.observe_save(report.num_tokens, report.seconds)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._forget(request.request_id)
        return False, None

    # ================================================================ worker side
    def register_kv_caches(self, kv_caches: dict) -> None:
        self.paged = PagedKV(
            [kv_caches[name] for name in self.layer_names],
            self.num_blocks,
            self.block_size,
            self.spec.num_kv_heads,
            self.spec.head_size,
        )

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        meta = kv_connector_metadata
        if not isinstance(meta, PreemptConnectorMetadata) or self.paged is None:
            return
        for request_id in meta.discards:
            self.store.discard(request_id)
        for job in (*meta.saves, *meta.early):
            if job.start == 0:  # a copy from the first token: whatever is left of an old one is stale
                self.store.discard(job.request_id)
            if job.end > job.start:
                self.store.save(job.request_id, self.paged, job.block_ids, job.start, job.end)
            else:  # an early copy already holds it all: report it stored
                self.store.touch(job.request_id)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        # vLLM calls this before the forward pass when a load is synchronous, after it when
        # every load of the step is asynchronous (their requests are not in the batch)
        meta = self._connector_metadata
        if not isinstance(meta, PreemptConnectorMetadata) or self.paged is None:
            return
        for job in meta.loads:
            if self.settings.loads == "sync":
                self._loaded(job, self._load_now(job))
            else:
                future = self.store.load_later(job.request_id, self.paged, job.block_ids, job.start, job.end)
                self.loading[job.request_id] = (job, future)

    def _load_now(self, job: CopyJob) -> CopyReport:
        try:
            return self.store.load(job.request_id, self.paged, job.block_ids, job.start, job.end)
        except Exception as err:  # noqa: BLE001 - any failed load is a recompute, never a dead engine
            return _failed_load(err)

    def _loaded(self, job: CopyJob, report: CopyReport) -> None:
        """A load ended: a failed one's blocks are reported invalid (vLLM recomputes them)."""
        if report.error is not None:
            logger.warning("preempt connector: request %s recomputes: %s", job.request_id, report.error)
            self.store.discard(job.request_id)  # a load that failed early may have left it
            first, last = job.start // self.block_size, (job.end - 1) // self.block_size
            self.invalid_blocks.update(job.block_ids[first : last + 1])
            report = CopyReport(error=report.error.split(":")[0])
        self.load_reports[job.request_id] = report

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        # The asynchronous loads that ended, failed ones too: vLLM must hear of every load
        # (an aborted request's blocks are freed only then), and gets a failed one's
        # invalid blocks in the same pass (get_block_ids_with_load_errors, called after).
        done = {request_id for request_id, (_, future) in self.loading.items() if future.done()}
        for request_id in done:
            job, future = self.loading.pop(request_id)
            try:
                report = future.result()
            except Exception as err:  # noqa: BLE001 - as in _load_now
                report = _failed_load(err)
            self._loaded(job, report)
        return None, done or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # whole copies: a synchronous load is done before the forward pass starts

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # saves happen at preemption (handle_preemptions), not per layer

    def wait_for_save(self) -> None:
        return  # the encode thread owns its copies; the blocks were copied before returning

    def get_block_ids_with_load_errors(self) -> set[int]:
        invalid, self.invalid_blocks = self.invalid_blocks, set()
        return invalid

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        stores = {}
        for request_id, seconds in self.store.finished().items():
            if request_id not in self.store.copies:
                continue  # discarded meanwhile
            num_tokens, error = self.store.stored(request_id)
            raw, stored = self.store.nbytes(request_id)
            stores[request_id] = CopyReport(num_tokens, raw, stored, seconds, error)
        loads, self.load_reports = self.load_reports, {}
        if not stores and not loads:
            return None
        return PreemptWorkerMetadata(stores, loads)

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.WORKER:
            self.store.close()  # waits for the loads in flight
