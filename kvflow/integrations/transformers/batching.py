"""kvflow behind transformers' continuous batching (``generate_batch``, the
``ContinuousBatchingManager``): one argument, ``tier=KvflowTier(...)``, turns it on.

How it is hooked (transformers' own classes, subclassed; nothing of transformers is patched):

* the manager (``KvflowBatchingManager``) builds its batch processor as transformers does,
  with a scheduler of the configured type that knows kvflow and a processor that steps it;
* admission: after transformers' device prefix cache matched what it holds, the scheduler asks
  kvflow for the blocks after them, allocates device blocks for the hits and starts their load;
  the request stays out of every batch while the loop schedules and computes the others. Each
  step polls kvflow first: a request whose load is over joins the batching, admitted. Landed:
  it starts after the loaded blocks, which join transformers' prefix cache. Failed or late: it
  computes them (into fresh blocks when the copy may still be writing, F15);
* after each forward pass, every block that became full is stored (eager), and a request that
  finishes offers its last full blocks before transformers frees them;
* preemption: a request transformers sends back to waiting is soft reset (the swap pool is
  off) and, when it is scheduled again, loads its blocks from kvflow's tier;
* while a kvflow job names a device block, kvflow holds a reference on it in transformers'
  block manager (``tier.TierSide``), so the block is neither reused nor evicted under a copy.

The batching runs synchronously (``use_async_batching=False``): a step's KV is on the device
when the step's update runs. These are transformers' internals of one release; another
release is refused in one line at import.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import transformers

from kvflow.core.errors import ConfigError
from kvflow.executors.torch.streams import record_event
from kvflow.integrations.transformers.tier import (
    KvflowTier,
    TierSide,
    TierStats,
    build_engine,
    check_tier,
)

SUPPORTED_TRANSFORMERS = "5.17.0"
if transformers.__version__ != SUPPORTED_TRANSFORMERS:
    raise ImportError(
        f"kvflow.integrations.transformers needs transformers=={SUPPORTED_TRANSFORMERS}, "
        f"not {transformers.__version__}: pip install 'kvflow[transformers]'"
    )

from transformers import ContinuousBatchingConfig, GenerationConfig  # noqa: E402
from transformers.generation.continuous_batching.cache import (  # noqa: E402
    PagedAttentionCache,
    group_layers_by_attn_type,
)
from transformers.generation.continuous_batching.continuous_api import (  # noqa: E402
    BackgroundThreadStatus,
    ContinuousBatchingManager,
    ContinuousBatchProcessor,
)
from transformers.generation.continuous_batching.initialization import (  # noqa: E402
    update_cb_config_after_cache_creation,
)
from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs  # noqa: E402
from transformers.generation.continuous_batching.requests import (  # noqa: E402
    FutureRequestState,
    GenerationOutput,
    RequestState,
    RequestStatus,
)
from transformers.generation.continuous_batching.scheduler import (  # noqa: E402
    SCHEDULER_MAPPING,
    FIFOScheduler,
    Scheduler,
)
from transformers.generation.continuous_batching.utils import WorkloadHints  # noqa: E402


def _sequence(state: RequestState) -> list[int]:
    return list(state.initial_tokens) + list(state.generated_tokens)


@dataclass(frozen=True)
class _Load:
    """A request whose tier hits are loading: out of every batch until the outcome."""

    state: RequestState
    job: int
    device: int  # its blocks found on the device before the hits
    hits: int  # the hits loading, into its next device blocks
    allocated: int  # device blocks transformers allocated for them


class _TierScheduling(Scheduler):
    """Mixed in before transformers' scheduler class of the configured type."""

    side: TierSide

    def reset(self) -> None:
        super().reset()
        # requests transformers just finished: preempted if they come back to waiting at once
        self._ending: set[str] = set()
        self._loads: dict[str, _Load] = {}  # by request id, in the order the loads started

    # -- admission -----------------------------------------------------------------------

    def _infer_request_tokens(self, state: RequestState, request_ids_to_remove_from_waiting: set[str]) -> list[int]:
        admitting = state.status == RequestStatus.PENDING and not state.is_cpu_offloaded
        before = state.position_offset
        tokens: list[int] = super()._infer_request_tokens(state, request_ids_to_remove_from_waiting)
        if not admitting:
            return tokens
        self.side.stats.device_hit_tokens += state.position_offset - before
        if self.side.engine is None:
            return tokens
        return self._admit(state)

    def _admit(self, state: RequestState) -> list[int]:
        """Start loading from kvflow's tier the blocks after the device's prefix hits; the
        request waits for the outcome out of the batches (``take_loads``)."""
        side, cache = self.side, self.cache
        rid = state.request_id
        table = cache.group_cache_managers[0].block_table.get(rid, [])
        device = len(table)
        hits = side.hits(rid, state.initial_tokens, device)
        if hits and state.position_offset == device * cache.block_size:
            allocated = cache.allocate_blocks(hits, rid, state.allocated_blocks)
        else:
            allocated = None
        side.mark_offered(rid, device)
        if not allocated:
            if hits:
                side.release(rid)
            return list(state.remaining_prefill_tokens)
        state.allocated_blocks += allocated
        blocks = cache.group_cache_managers[0].block_table[rid][device : device + hits]
        job = side.start_load(rid, blocks)
        if job is not None:
            self._loads[rid] = _Load(state, job, device, hits, allocated)
        # (no job: nothing writes the blocks, the request computes them in place)
        return list(state.remaining_prefill_tokens)

    def _allocate_blocks_if_needed(self, state: RequestState, len_next_tokens: int) -> bool:
        if state.request_id in self._loads:  # its load started in this pass: not in this batch
            return False
        allocated: bool = super()._allocate_blocks_if_needed(state, len_next_tokens)
        return allocated

    def _process_candidates(
        self,
        candidates: list[RequestState],
        token_budget: int,
        cache_budget: int,
        request_ids_to_remove_from_waiting: set[str],
    ) -> tuple[list[FutureRequestState], bool, bool, int, int]:
        """transformers' pass over the candidates, less the requests whose loads are out."""
        ready = [state for state in candidates if state.request_id not in self._loads]
        batch, failed, fast, q_tokens, kv_read = super()._process_candidates(
            ready, token_budget, cache_budget, request_ids_to_remove_from_waiting
        )
        if not batch and failed and self.waits_for_kvflow():
            # No room for anyone while loads are out or kvflow holds device blocks: those come
            # back when the copies are over, so the batch is empty (the loop waits for them)
            # rather than failed (transformers would offload; it never offloads its last
            # active request, and may have no other)
            failed = False
        return batch, failed, fast, q_tokens, kv_read

    def waits_for_kvflow(self) -> bool:
        """Whether a request waits for its load, or kvflow holds device blocks (a copy
        running or fenced): what a later step gives back."""
        return bool(self._loads or self.side.held())

    def take_loads(self) -> None:
        """Requests whose loads a step reported join the batching, admitted: landed, they start
        after the loaded blocks, which join the device prefix cache; failed or late, they
        compute them (into fresh blocks when the copy may still be writing, F15)."""
        side, cache = self.side, self.cache
        for rid, load in list(self._loads.items()):
            outcome = side.outcome(load.job)
            if outcome is None:
                continue
            del self._loads[rid]
            landed, fenced = outcome
            state = load.state
            table = cache.group_cache_managers[0].block_table[rid]
            blocks = table[load.device : load.device + load.hits]
            if landed:
                n = load.hits * cache.block_size
                state.position_offset += n
                state.remaining_prefill_tokens = state.remaining_prefill_tokens[n:]
                if not side.held().intersection(blocks):  # (a held block cannot give way to a twin)
                    cache.mark_shareable_blocks_as_complete(state, load.hits)  # they join the device prefix cache
                side.mark_offered(rid, load.device + load.hits)
            elif fenced:
                # F15: the late copy may still write these blocks: the request computes into
                # fresh ones; kvflow's reference keeps them from reuse until the copy is over
                del table[load.device :]
                state.allocated_blocks -= load.allocated
                cache._block_manager.free_blocks(blocks, shareable=True)
            # (failed, not fenced: nothing writes them any more, computed in place)
            if state.status == RequestStatus.PENDING:  # as transformers does on a device prefix hit
                self.active_requests[rid] = state
                state.status = RequestStatus.PREFILLING
                self.waiting_requests.pop(rid, None)
                self._cleanup_waiting_queue({rid})

    def _forget_load(self, request_id: str) -> None:
        load = self._loads.pop(request_id, None)
        if load is not None:
            self.side.abandon(load.job)

    # -- the end of a request ------------------------------------------------------------

    def _offer_before_free(self, request_id: str) -> None:
        state = self.active_requests.get(request_id)
        table = self.cache.group_cache_managers[0].block_table.get(request_id)
        if state is not None and table is not None:
            self.side.offer(request_id, state.position_offset, lambda: _sequence(state), table)

    def finish_request(self, request_id: str) -> None:
        self._offer_before_free(request_id)
        self._forget_load(request_id)
        super().finish_request(request_id)
        self._ending.add(request_id)

    def clear_cancelled_requests(self) -> list[RequestState]:
        with self._cancellation_lock:  # (cancellations arrive from other threads)
            cancelling = sorted(self._requests_to_cancel)
        for request_id in cancelling:
            self._offer_before_free(request_id)
            self._forget_load(request_id)
        cancelled: list[RequestState] = super().clear_cancelled_requests()
        self._ending.update(state.request_id for state in cancelled)
        return cancelled

    def add_waiting_request(self, state: RequestState) -> None:
        if state.request_id in self._ending:  # preempted: it will look its blocks up again
            self._ending.discard(state.request_id)
            self.side.finished(state.request_id, preempted=True)
        super().add_waiting_request(state)

    def settle(self) -> None:
        """Requests that finished and did not come back are over."""
        for request_id in sorted(self._ending):
            self.side.finished(request_id, preempted=False)
        self._ending.clear()


@functools.cache
def _tier_scheduler(base: type[Scheduler]) -> Any:
    """transformers' scheduler class ``base`` with kvflow's admission and ends mixed in."""
    return type(f"Kvflow{base.__name__}", (_TierScheduling, base), {})


class _TierProcessor(ContinuousBatchProcessor):
    """Steps kvflow once per batch, stores what each forward pass completed."""

    side: TierSide
    scheduler: _TierScheduling

    def prepare_next_batch(self) -> bool:
        """Each step polls kvflow first: requests whose loads it reported join this batch.
        When nothing can run until kvflow gives something back (a load out, device blocks
        held by a copy), it polls here until then (transformers' loop would sleep a tenth of a
        second before it asks again)."""
        while True:
            self.scheduler.settle()
            self.side.step()  # (also while idle: the loop comes here every wait)
            self.scheduler.take_loads()
            swapped = {
                rid: state.position_offset
                for rid, state in self.scheduler.waiting_requests.items()
                if state.is_cpu_offloaded
            }
            ready: bool = super().prepare_next_batch()
            for rid, tokens in swapped.items():
                state = self.scheduler.active_requests.get(rid)
                if state is not None and not state.is_cpu_offloaded:
                    self.side.stats.swap_restored_tokens += tokens
            hard_stop = self.background_thread_status.tp_status == BackgroundThreadStatus.HARD_STOP
            if ready or hard_stop or not self.scheduler.has_pending_requests() or not self.scheduler.waits_for_kvflow():
                return ready
            time.sleep(0.0002)  # (the executor's completion thread needs the interpreter)

    def update_batch(self) -> None:
        io = self.inputs_and_outputs
        assert isinstance(io, ContinuousBatchingIOs)  # (synchronous batching: see the manager)
        batch = [future.state for future in io.requests_in_batch]
        super().update_batch()
        tables = self.cache.group_cache_managers[0].block_table
        for state in batch:
            table = tables.get(state.request_id)
            if table is not None and state.status != RequestStatus.FINISHED:
                self.side.offer(state.request_id, state.position_offset, functools.partial(_sequence, state), table)
        self.scheduler.settle()
        self.side.step()  # the stores start now


class KvflowBatchingManager(ContinuousBatchingManager):
    """transformers' ``ContinuousBatchingManager`` with kvflow's CPU tier behind it
    (``tier``), or without it (``tier=None``: transformers' own behaviour, counted the same
    way). ``stats`` counts the run; after ``stop()`` its ``leaks`` says what was left behind."""

    def __init__(
        self,
        model: Any,
        generation_config: GenerationConfig,
        continuous_batching_config: ContinuousBatchingConfig,
        workload_hints: WorkloadHints | None = None,
        *,
        tier: KvflowTier | None = None,
    ) -> None:
        cb = continuous_batching_config
        if cb.use_async_batching:
            raise ConfigError("use_async_batching=True: kvflow's transformers integration runs the batching synchronously")
        cb.use_async_batching = False
        if tier is not None:
            problem = check_tier(tier, cb.block_size)
            if problem is None and cb.cpu_offload_space != 0:
                problem = "cpu_offload_space must be 0 with a KvflowTier: kvflow's tier takes the place of the swap pool"
            if problem is None and not cb.allow_block_sharing:
                problem = "allow_block_sharing=False: kvflow's tier needs transformers' block references"
            if problem is None and group_layers_by_attn_type(model.config.get_text_config())[1] != ["full_attention"]:
                problem = "kvflow's transformers integration needs a model whose layers all use full attention"
            if problem is not None:
                raise ConfigError(problem)
        self.tier = tier
        self.stats = TierStats()
        self._side: TierSide | None = None
        self._cache: PagedAttentionCache | None = None
        super().__init__(model, generation_config, cb, workload_hints)

    def _create_batch_processor(self) -> ContinuousBatchProcessor:
        """As transformers builds it, with kvflow's scheduler and processor."""
        existing = getattr(self, "batch_processor", None)
        if isinstance(existing, ContinuousBatchProcessor):
            existing.reset()
            return existing
        cb = self.continuous_batching_config
        cache = PagedAttentionCache(
            config=self.model.config.get_text_config(),
            continuous_batching_config=cb,
            device=self.model.device,
            distributed_helper=self.distributed_helper,
            tp_plan=getattr(self.model, "tp_plan", {}),
            dtype=self.model.dtype,
        )
        self._use_prefix_sharing = cache.use_prefix_sharing
        update_cb_config_after_cache_creation(
            cb_config=cb,
            num_blocks=cache.num_blocks,
            max_batch_tokens=cache.max_batch_tokens,
            use_prefix_sharing=self._use_prefix_sharing,
        )
        if cache.num_sliding_attention_groups > 0:
            cb.max_blocks_per_request = 0
        scheduler: _TierScheduling = _tier_scheduler(SCHEDULER_MAPPING.get(cb.scheduler_type, FIFOScheduler))(
            cache=cache, safety_margin=cb.safety_margin, max_requests_per_batch=cb.max_requests_per_batch
        )
        processor = _TierProcessor(
            cache=cache,
            config=self.model.config.get_text_config(),
            generation_config=self.generation_config,
            continuous_batching_config=cb,
            logit_processor=self.logit_processor,
            input_queue=self.input_queue if self.is_tp_driver else None,
            cancel_queue=self.cancel_queue if self.is_tp_driver else None,
            output_router=self.output_router,
            background_thread_status=self.background_thread_status,
            model_device=self.model.device,
            model_dtype=self.model.dtype,
            scheduler=scheduler,
            distributed_helper=self.distributed_helper,
        )
        engine = None
        if self.tier is not None:
            shape = (cache.num_blocks + 2, cache.block_size, cache.num_key_value_heads, cache.head_dim)
            tensors = [t.view(shape) for pair in zip(cache.key_cache, cache.value_cache) for t in pair]
            engine = build_engine(self.tier, tensors)

        device = cache.key_cache[0].device  # (a torch.device, whatever form cache.device has)
        # the stores read what the step's forward pass wrote on transformers' compute stream
        side = TierSide(
            engine,
            cache.block_size,
            cache._block_manager,
            lambda: record_event(processor.inputs_and_outputs.compute_stream, device),
        )
        scheduler.side = processor.side = side
        self._side, self._cache, self.stats = side, cache, side.stats
        return processor

    def stop(
        self,
        block: bool = True,
        timeout: float | None = None,
        keep_for_next_session: bool = False,
        hard_stop: bool = False,
    ) -> None:
        """transformers' stop; then (the generation thread over, the manager not kept)
        every kvflow job is waited for, every hold given back and the trace closed."""
        super().stop(block=block, timeout=timeout, keep_for_next_session=keep_for_next_session, hard_stop=hard_stop)
        if keep_for_next_session or self.is_running() or self._side is None:
            return
        leaks = self._side.close()
        cache = self._cache
        if cache is not None and cache.get_num_free_blocks() != cache.num_blocks:
            leaks.append(f"{cache.num_blocks - cache.get_num_free_blocks()} device blocks not free")
        self.stats.leaks = leaks
        self._side = None


def init_continuous_batching(
    model: Any,
    *,
    tier: KvflowTier | None,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    workload_hints: WorkloadHints | None = None,
) -> KvflowBatchingManager:
    """A manager for ``model`` (as ``model.init_continuous_batching``), with kvflow's tier
    behind it when ``tier`` is given. Start it, add requests, read results, stop it."""
    config = generation_config if generation_config is not None else model.generation_config
    if config.eos_token_id is None:
        config.eos_token_id = -1
    return KvflowBatchingManager(
        model,
        config,
        continuous_batching_config if continuous_batching_config is not None else ContinuousBatchingConfig(),
        workload_hints,
        tier=tier,
    )


def generate_batch(
    model: Any,
    inputs: Sequence[Sequence[int]],
    *,
    tier: KvflowTier | None,
    generation_config: GenerationConfig | None = None,
    continuous_batching_config: ContinuousBatchingConfig | None = None,
    max_new_tokens: int | None = None,
    record_timestamps: bool = False,
    warmup: bool = False,
) -> tuple[dict[str, GenerationOutput], TierStats]:
    """``model.generate_batch(inputs, ...)`` with kvflow's tier behind it (``tier``): the
    outputs by request id, in the order of ``inputs``, and what the run counted."""
    manager = init_continuous_batching(
        model, tier=tier, generation_config=generation_config, continuous_batching_config=continuous_batching_config
    )
    if warmup:
        manager.warmup()
    manager.start()
    results: dict[str, GenerationOutput] = {}
    try:
        ids = manager.add_requests([list(x) for x in inputs], max_new_tokens=max_new_tokens, record_timestamps=record_timestamps)
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result
            elif result is None and not manager.is_running():
                raise RuntimeError("the generation thread stopped before every request finished")
    finally:
        manager.stop(block=True)
        manager.destroy()
    return {rid: results[rid] for rid in ids}, manager.stats
