"""SGLang 0.5.23's scheduling loop, rule by rule, over this engine's block pool.

Owns: the `sglang_*` policies' step (`SglangScheduler.schedule`). Everything else (the
waiting queue, block allocation, what a preemption does to the KV, records, exits) is the
base `Scheduler`'s. Plain Python, no torch. SGLang itself cannot be imported on a CPU-only
machine without stubbing its CUDA dependencies (docs/sglang.md), so instead of a parity
harness every rule below names the file and line of the 0.5.23 release it follows
(`python/sglang/srt/...`: SCH managers/scheduler.py, SP managers/schedule_policy.py, SB
managers/schedule_batch.py, PB mem_cache/prefill_budget.py, NTR
managers/scheduler_components/new_token_ratio_tracker.py, ENV environ.py).

One step:
1. Prefill first (SCH:3975-4005). If a request is mid-chunk or some wait and the batch is
   not full, build a prefill batch (SCH:4090-4330): the chunked request first
   (SP:1140-1222), then waiting requests in queue order while the slot cap, the memory
   budget and the token budgets allow; stop at the first that does not fit (no skipping).
   Memory (PB:91-168, SP:785-798, 1407-1412): `rem_total = free tokens - total_offset`,
   where each running request adds `min(max_new - out, 4096) * new_token_ratio`; a
   candidate needs `extend + min(max_new - out, 4096) + page < rem_total`, and admitted
   work is reserved as `ceil_page(extend) + page + min(max_new, 4096)` (0 for a
   non-final chunk). A prompt longer than the chunk budget is cut to whole pages and
   becomes the one chunked request. With priority scheduling, a full batch lets the
   candidate preempt running requests of a lower level by more than the threshold
   (SP:1707-1778).
2. Otherwise decode every running request (SCH:4462-4545): if the pool cannot give each
   one whose KV fills its last page a new page (SB:3403-3449), retract requests in
   retraction order (the policy's `select_victim`) until it can, keeping at least one
   (SB:3451-3539); then the new-token ratio is re-estimated from the kept requests
   (NTR:40-49), else it decays by (0.7 - 0.098) / 600 per decode step (NTR:20-38). It
   resets when the scheduler is idle (SCH:5318).
Prefill and decode never share a step (`--enable-mixed-chunk` is off by default).

Differences, on purpose: no radix cache (SGLang's default is on; with it off, as here, a
retracted request recomputes its whole prompt and output: SB:2360-2395 keeps the output
ids), page size = `cache.block_size` (SGLang's default is 1 token), and what a
preemption does to the KV follows `preemption.mode` (SGLang retracts by recompute; use
`recompute` for a faithful arm). No rate cap and no failure fallback: SGLang has neither.
"""

from __future__ import annotations

import itertools

from preempt.core.block_pool import blocks_needed
from preempt.core.request import Request, RequestState, ScheduledChunk
from preempt.engine.scheduler import Scheduler, SchedulerOutput

CLIP_MAX_NEW_TOKENS = 4096  # ENV:650, SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION
INIT_NEW_TOKEN_RATIO = 0.7  # ENV:646
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14  # ENV:647
NEW_TOKEN_RATIO_DECAY_STEPS = 600  # ENV:648
RETRACT_DECODE_STEPS = 20  # ENV:649


class _PrefillBudget:
    """PB:60-168's `PrefillBudget` for one prefill pass, in tokens of this pool."""

    def __init__(self, scheduler: SglangScheduler) -> None:
        self.scheduler = scheduler
        self.page = scheduler.block_size
        self.total_offset = 0.0
        self.current_offset = 0

    def free_tokens(self) -> int:
        # SGLang counts free plus evictable (radix-cache) tokens; with no radix cache the
        # evictable ones here are paused requests' blocks, which allocation reclaims.
        scheduler = self.scheduler
        reclaimable = sum(len(r.block_ids) for r in scheduler.paused)
        return (scheduler.block_pool.num_free + reclaimable) * self.page

    @property
    def remaining_total(self) -> float:
        return self.free_tokens() - self.total_offset

    @property
    def remaining_current(self) -> float:
        return self.free_tokens() - self.current_offset

    def ceil_page(self, tokens: int) -> int:
        return -(-tokens // self.page) * self.page

    def reserve(self, extend: int, max_new: int) -> None:
        immediate = self.ceil_page(extend) + self.page
        self.total_offset += immediate + max_new
        self.current_offset += immediate


class SglangScheduler(Scheduler):
    """The `sglang_*` policies' loop (module docstring); the rest is `Scheduler`'s."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.sglang = self.config.sglang
        self.priority_scheduling = bool(getattr(self.policy, "priority_scheduling", False))
        # NTR:20-38: init = min(0.7 * conservativeness, 1), floor 0.14 x init, linear decay.
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * self.sglang.schedule_conservativeness, 1.0)
        self.min_ratio = min(self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.ratio_decay = (self.init_ratio - self.min_ratio) / NEW_TOKEN_RATIO_DECAY_STEPS
        self.new_token_ratio = self.init_ratio
        # A chunk is cut to whole pages, so it must hold one (SGLang's are far larger).
        budget = self.config.max_num_batched_tokens
        self.chunked_prefill_size = max(self.sglang.chunked_prefill_size or budget, self.block_size)
        self.max_prefill_tokens = max(self.sglang.max_prefill_tokens or budget, self.block_size)
        self.chunked: Request | None = None  # at most one request mid-chunk (SCH:4324-4327)
        self.batch_is_full = False
        self._entry: dict[Request, int] = {}  # wait_queue_entry_time, as a queueing count
        self._entries = itertools.count()

    def never_fits(self, request: Request) -> str | None:
        """SGLang admits a request only if `extend + max_new + page < free tokens`
        (strictly), so one that needs the whole pool waits forever: refuse it instead."""
        max_new = min(request.max_tokens, CLIP_MAX_NEW_TOKENS)
        need = request.num_prompt_tokens + max_new + self.block_size
        pool = self.block_pool.num_blocks * self.block_size
        if need >= pool:
            return f"SGLang's admission needs prompt + max_tokens + a page = {need} < {pool} tokens"
        return super().never_fits(request)

    def add_request(self, request: Request) -> None:
        super().add_request(request)
        # SCH:3480-3495: a (re)queued request gets a fresh entry time, so a retracted one
        # goes to the tail of its level.
        self._entry[request] = next(self._entries)

    def _remove_finished(self, finished: list[Request]) -> None:
        super()._remove_finished(finished)
        self._left(finished)

    def finish_request(self, request: Request, state: RequestState) -> None:
        super().finish_request(request, state)
        if self.chunked is request:
            self.chunked = None
        self._left([request])

    def decode_run(self, now: float) -> None:
        """Never: SGLang's loop moves its new-token ratio and may retract every step, so
        each step is decided on its own."""
        return None

    def _left(self, requests: list[Request]) -> None:
        for request in requests:
            self._entry.pop(request, None)
        if requests:
            self.batch_is_full = False  # SCH:3964-3968: the running batch shrank

    # ----------------------------------------------------------------- step
    def schedule(self, now: float = 0.0) -> SchedulerOutput:
        self.settle_saves()
        self._now = now
        self.copy_out.new_step()
        first_record = len(self.records)
        if not self.running and not self.waiting:
            self.new_token_ratio = self.init_ratio  # SCH:5318, idle
        preempted: list[Request] = []
        chunks = self._prefill_batch(preempted)
        if chunks is None:
            chunks = self._decode_batch(preempted)
        return SchedulerOutput(
            chunks,
            preempted,
            self.records[first_record:],
            sum(chunk.num_new_tokens for chunk in chunks),
            self.copy_out.wait_until_s,
        )

    def _decoding(self) -> list[Request]:
        """SGLang's running batch: every running request but the one mid-chunk."""
        return [r for r in self.running if r is not self.chunked]

    def _running_offset(self, request: Request) -> float:
        """SP:785-794: a running request's expected remaining decode tokens."""
        return min(request.max_tokens - request.num_output_tokens, CLIP_MAX_NEW_TOKENS) * self.new_token_ratio

    # ----------------------------------------------------------------- prefill
    def _prefill_batch(self, preempted: list[Request]) -> list[ScheduledChunk] | None:
        # The running batch as this pass sees it: requests admitted now join it next step.
        decoding = self._decoding()
        if self.priority_scheduling or not decoding:
            self.batch_is_full = False  # SCH:4090-4096
        if (self.batch_is_full or not self.waiting) and self.chunked is None:
            return None  # SCH:4098-4101
        budget = _PrefillBudget(self)
        budget.total_offset = sum(self._running_offset(r) for r in decoding)
        rem_input, rem_chunk = self.max_prefill_tokens, self.chunked_prefill_size
        can_run: list[ScheduledChunk] = []

        if self.chunked is not None:  # SP:1140-1222, add_chunked_req
            request = self.chunked
            available = min(rem_chunk, int(budget.remaining_total))
            available = available if available > 0 else rem_chunk
            extend = request.num_tokens - request.num_computed_tokens
            take = min(extend, available, self._fitting_tokens(request))
            if take <= 0 or not self._allocate_for(request, take):
                return None  # no room at all: decode (and retract) first
            can_run.append(ScheduledChunk(request, take))
            truncated = extend > take
            budget.reserve(take, 0 if truncated else min(request.max_tokens, CLIP_MAX_NEW_TOKENS))
            rem_input -= budget.ceil_page(take)
            rem_chunk -= budget.ceil_page(take)
            if not truncated:
                self.chunked = None

        for request in self.waiting:  # a snapshot in queue order: `_admit` takes from it
            if rem_input <= 0 or rem_chunk <= 0:  # budget_state() == OTHER (SP:874-893)
                break
            num_running = len(decoding) - sum(1 for r in decoding if r in preempted)
            if len(can_run) >= self.config.max_num_seqs - num_running:
                self.batch_is_full = True  # SCH:4226-4232
            if self.batch_is_full:
                if not self.priority_scheduling or not self._preempt_to_schedule(
                    request, decoding, budget, preempted
                ):
                    break
            # SP:1395-1412 and 1600-1676, add_one_req without a prefix cache.
            max_new = min(max(request.max_tokens - request.num_output_tokens, 0), CLIP_MAX_NEW_TOKENS)
            extend = request.num_tokens - request.num_computed_tokens
            if not extend + max_new + budget.page < budget.remaining_total:
                self.batch_is_full = bool(can_run) or num_running > 0  # NO_TOKEN
                break
            reserve_new = min(request.max_tokens, CLIP_MAX_NEW_TOKENS)
            chunk_limit = None
            if budget.ceil_page(extend) > rem_chunk:
                chunk_limit = rem_chunk // budget.page * budget.page
                if chunk_limit <= 0:
                    break  # OTHER
                reserve_new = 0
            self._admit(request)  # a saved request's KV is restored here (or falls back)
            extend = request.num_tokens - request.num_computed_tokens
            if chunk_limit is not None and extend > chunk_limit:
                extend = chunk_limit
                self.chunked = request
            if not self._allocate_for(request, extend):
                # Only after a failed restore grew the work beyond what was checked: it
                # stays admitted and continues next pass like a chunked request.
                self.chunked = request
                break
            can_run.append(ScheduledChunk(request, extend))
            budget.reserve(extend, reserve_new)
            rem_input -= budget.ceil_page(extend)
            rem_chunk -= budget.ceil_page(extend)
            if budget.remaining_total <= 0 or budget.remaining_current <= 0:
                break  # budget_state() == NO_TOKEN after the commit
            if self.chunked is request:
                break  # its chunk took the rest of the chunk budget
        return can_run or None

    def _fitting_tokens(self, request: Request) -> int:
        """How many more tokens of `request` the pool can hold now (free and reclaimable
        blocks, and the room left in its last block)."""
        room = len(request.block_ids) * self.block_size - request.num_computed_tokens
        reclaimable = sum(len(r.block_ids) for r in self.paused if r is not request)
        return room + (self.block_pool.num_free + reclaimable) * self.block_size

    def _admit(self, request: Request) -> None:
        """Out of the waiting queue into `running` (the base class's bookkeeping)."""
        self.waiting.discard(request)
        if request.kv_location == "host":
            self.host.restore(request, self._now)
        elif request.kv_location == "device":
            self.paused.remove(request)
        request.kv_location = None
        request.state = RequestState.RUNNING
        request.slice_used_s = 0.0
        self.running.append(request)

    def _preempt_to_schedule(
        self, challenger: Request, decoding: list[Request], budget: _PrefillBudget, preempted: list[Request]
    ) -> bool:
        """SP:1707-1778: free room for `challenger` by preempting running requests of a
        level more than the threshold below it, least important and latest queued first,
        each credited its expected remaining decode tokens."""
        candidates = sorted(
            (r for r in decoding if r not in preempted),
            key=lambda r: (r.sla_level, -self._entry.get(r, 0)),
        )
        need = (
            challenger.num_tokens
            - challenger.num_computed_tokens
            + min(challenger.max_tokens, CLIP_MAX_NEW_TOKENS)
            - budget.remaining_total
        )
        victims: list[Request] = []
        for request in candidates:
            if challenger.sla_level - request.sla_level > self.sglang.priority_preemption_threshold:
                victims.append(request)
                need -= self._running_offset(request)
                if need <= 0:
                    break
            else:
                break
        if not victims or need > 0:
            return False
        all_out = True
        for victim in victims:
            # A save can fail here (SGLang's retract cannot): the victim keeps running
            # and its seat, so the challenger must not take it.
            if self._preempt(victim, "priority", forced=False, challenger=challenger):
                budget.total_offset -= self._running_offset(victim)
                preempted.append(victim)
            else:
                all_out = False
        return all_out

    # ----------------------------------------------------------------- decode
    def _decode_batch(self, preempted: list[Request]) -> list[ScheduledChunk]:
        decoding = self._decoding()
        if not decoding:
            self.batch_is_full = False
            return []
        if not self._decode_fits(decoding):  # SCH:4469, SB:3451-3539
            order = list(decoding)
            first = True
            while first or not self._decode_fits(order):
                if len(order) == 1:
                    break
                first = False
                victim = self.policy.select_victim(order, self._now)
                order.remove(victim)
                self._preempt(victim, "memory", forced=True)
                preempted.append(victim)
            decoding = order
            # NTR:40-49: set (not max-ed) from the kept requests.
            decoded = sum(r.num_output_tokens for r in decoding)
            budgeted = sum(r.max_tokens for r in decoding)
            self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(decoding)) / (budgeted + 1))
            self.batch_is_full = False
        else:
            self.new_token_ratio = max(self.new_token_ratio - self.ratio_decay, self.min_ratio)
        chunks = []
        for request in decoding:
            if not self._allocate_for(request, 1):
                raise RuntimeError("SGLang's decode check passed but a page was not free")
            chunks.append(ScheduledChunk(request, 1))
        return chunks

    def _decode_fits(self, requests: list[Request]) -> bool:
        """SB:3403-3449: one new page for each request whose KV fills its last page."""
        need = sum(
            1
            for r in requests
            if blocks_needed(r.num_computed_tokens + 1, self.block_size) > len(r.block_ids)
        )
        return self.block_pool.num_free >= need
