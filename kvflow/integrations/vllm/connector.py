"""kvflow as a vLLM KV connector: the CPU tier behind vLLM's scheduler and workers.

Configured the vLLM way::

    --kv-transfer-config '{"kv_connector": "KVFlowConnector",
                           "kv_connector_module_path": "kvflow.integrations.vllm.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"cpu_gb": 8, "policy": "lru",
                                                         "trace_path": "kvflow.jsonl"}}'

Scheduler side (``SchedulerSide``): ``get_num_new_matched_tokens`` is kvflow's lookup after
vLLM's own prefix hits (with the n-1 cap), loaded asynchronously; ``update_state_after_alloc``
accepts the hits vLLM allocated blocks for (or releases them); ``build_connector_meta`` stores
the blocks that become full this step and hands the step's jobs to the workers;
``request_finished`` finishes the request in kvflow (which touches its chain deepest first)
and keeps the blocks until their stores are over; preempted requests finish as preempted and may come back under their id.
Worker side (``WorkerSide``): loads start before the forward pass, stores after it
(``wait_for_save``: the compute is done), results go back to the scheduler side each step,
failed loads are named to vLLM (``get_block_ids_with_load_errors``) so that
``kv_load_failure_policy="recompute"`` recomputes exactly those blocks.
Ranks: every worker reports under its rank (vLLM's ``parallel_config.rank``) and the scheduler
side counts vLLM's ``parallel_config.world_size`` ranks, so a job is over once every worker's
copy is, and a copy that fails on one worker fails the job (vLLM recomputes its blocks).
Remote tier: each worker's tier holds its own shard; the scheduler side's lookups send the blocks
to ask it about with the next step's metadata (``StepPlan.probes``), the workers answer with
their results (``KVFlowWorkerMetadata.probes``), and a block is found when every rank found it.

This module imports without vLLM; the connector class needs it (``pip install vllm``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from kvflow.core.commands import JobResult, TierRefused
from kvflow.core.names import BlockName
from kvflow.integrations.vllm.kv_events import BlockRemoved, BlockStored
from kvflow.integrations.vllm.sides import (
    SHARED_TIERS,
    ConnectorConfig,
    SchedulerSide,
    StepPlan,
    WorkerSide,
    check_shared_hashes,
)

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorMetadata,
        KVConnectorRole,
        KVConnectorWorkerMetadata,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )

    HAVE_VLLM = True
except ImportError:  # vLLM is optional: the sides above work (and are tested) without it
    HAVE_VLLM = False


def _kv_block_bytes(kv_cache_config: Any) -> int:
    """Bytes of one block, every layer (what one host slot holds)."""
    return sum(
        group.kv_cache_spec.page_size_bytes * len(group.layer_names) for group in kv_cache_config.kv_cache_groups
    )


if HAVE_VLLM:

    @dataclass
    class KVFlowConnectorMetadata(KVConnectorMetadata):
        plan: StepPlan = field(default_factory=StepPlan)

    @dataclass
    class KVFlowWorkerMetadata(KVConnectorWorkerMetadata):
        """The workers' results of a step (vLLM aggregates every worker's, in rank order)."""

        results: list[JobResult] = field(default_factory=list)
        # rank -> what its disk tier held when it opened (sent once, a warm restart)
        disk_entries: dict[int, list[tuple[int, BlockName]]] = field(default_factory=dict)
        # the entries the workers' shared tiers refused (recorded by the scheduler side)
        refused: list[TierRefused] = field(default_factory=list)
        # rank -> its remote tier's probe answers: (keys asked and over, keys found)
        probes: dict[int, tuple[list[int], list[int]]] = field(default_factory=dict)

        def aggregate(self, other: KVFlowWorkerMetadata) -> KVFlowWorkerMetadata:
            return KVFlowWorkerMetadata(
                results=[*self.results, *other.results],
                disk_entries={**self.disk_entries, **other.disk_entries},
                refused=[*self.refused, *other.refused],
                probes={**self.probes, **other.probes},
            )

    @dataclass
    class KVFlowStats(KVConnectorStats):
        """The workers' transfers since vLLM last logged: jobs, blocks and bytes by direction
        and outcome (sums: ``aggregate`` adds workers and steps up)."""

        def reset(self) -> None:
            self.data: dict[str, Any] = {}

        def aggregate(self, other: Any) -> KVFlowStats:
            merged = dict(self.data)
            for key, value in (other.data or {}).items():
                merged[key] = merged.get(key, 0) + value
            return KVFlowStats(data=merged)

        def reduce(self) -> dict[str, int | float]:
            return dict(sorted(self.data.items()))

        def is_empty(self) -> bool:
            return not self.data

    class KVFlowPromMetrics(KVConnectorPromMetrics):
        """kvflow's transfers in vLLM's own Prometheus registry (per engine)."""

        _COUNTERS = (
            ("store_ok_blocks", "kvflow_stored_blocks", "Blocks kvflow stored to its CPU tier"),
            ("load_ok_blocks", "kvflow_loaded_blocks", "Blocks kvflow loaded from its CPU tier"),
            ("store_bytes", "kvflow_stored_bytes", "Bytes kvflow stored to its CPU tier"),
            ("load_bytes", "kvflow_loaded_bytes", "Bytes kvflow loaded from its CPU tier"),
            ("store_failed_jobs", "kvflow_failed_store_jobs", "kvflow store jobs that failed"),
            ("load_failed_jobs", "kvflow_failed_load_jobs", "kvflow load jobs that failed"),
            ("disk_store_ok_blocks", "kvflow_disk_stored_blocks", "Blocks kvflow stored to its disk tier"),
            ("disk_load_ok_blocks", "kvflow_disk_loaded_blocks", "Blocks kvflow loaded from its disk tier"),
            ("disk_store_bytes", "kvflow_disk_stored_bytes", "Bytes kvflow stored to its disk tier"),
            ("disk_load_bytes", "kvflow_disk_loaded_bytes", "Bytes kvflow loaded from its disk tier"),
            ("disk_store_failed_jobs", "kvflow_failed_disk_store_jobs", "kvflow disk store jobs that failed"),
            ("disk_load_failed_jobs", "kvflow_failed_disk_load_jobs", "kvflow disk load jobs that failed"),
            ("remote_store_ok_blocks", "kvflow_remote_stored_blocks", "Blocks kvflow stored to its remote tier"),
            ("remote_load_ok_blocks", "kvflow_remote_loaded_blocks", "Blocks kvflow loaded from its remote tier"),
            ("remote_store_bytes", "kvflow_remote_stored_bytes", "Bytes kvflow stored to its remote tier"),
            ("remote_load_bytes", "kvflow_remote_loaded_bytes", "Bytes kvflow loaded from its remote tier"),
            ("remote_store_failed_jobs", "kvflow_failed_remote_store_jobs", "kvflow remote store jobs that failed"),
            ("remote_load_failed_jobs", "kvflow_failed_remote_load_jobs", "kvflow remote load jobs that failed"),
        )

        def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any) -> None:
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._counters = {
                key: {
                    engine: self._counter_cls(name=name, documentation=doc, labelnames=labelnames).labels(*values)
                    for engine, values in per_engine_labelvalues.items()
                }
                for key, name, doc in self._COUNTERS
            }
            # the shared tiers' refusals by reason (the workers' stats say "<tier>_rejected:<reason>")
            self._rejected = {
                tier: self._counter_cls(
                    name=f"kvflow_{tier}_rejected",
                    documentation=f"Values kvflow's {tier} tier refused to serve, by reason",
                    labelnames=[*labelnames, "reason"],
                )
                for tier in SHARED_TIERS
            }

        def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
            for key, per_engine in self._counters.items():
                value = transfer_stats_data.get(key, 0)
                if value:
                    per_engine[engine_idx].inc(value)
            values = self.per_engine_labelvalues[engine_idx]
            for key, value in transfer_stats_data.items():
                tier, _, reason = key.partition("_rejected:")
                if reason and tier in self._rejected and value:
                    self._rejected[tier].labels(*values, reason).inc(value)

    class KVFlowConnector(KVConnectorBase_V1):
        """kvflow's CPU tier as a vLLM v1 KV connector (see the module docstring)."""

        @property
        def requires_kv_delivery(self) -> bool:
            return False  # a best-effort cache: a store that fails is a later miss

        def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
            super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
            transfer = vllm_config.kv_transfer_config
            self._config = ConnectorConfig.from_extra(transfer.kv_connector_extra_config)
            check_shared_hashes(self._config, str(vllm_config.cache_config.prefix_caching_hash_algo), os.environ)
            self._block_tokens = int(vllm_config.cache_config.block_size)
            self._scheduler: SchedulerSide | None = None
            self._worker: WorkerSide | None = None
            # vLLM's world (tensor x pipeline x prefill-context parallel) has one worker per
            # rank, each reporting its own results: a job is over when all of them reported
            parallel = vllm_config.parallel_config
            if role == KVConnectorRole.SCHEDULER:
                self._scheduler = SchedulerSide(
                    self._config, self._block_tokens, _kv_block_bytes(kv_cache_config), world_size=parallel.world_size
                )
            else:
                model = vllm_config.model_config
                self._worker = WorkerSide(
                    self._config,
                    rank=parallel.rank,
                    world_size=parallel.world_size,
                    model=f"{model.model}:{model.dtype}",
                    block_tokens=self._block_tokens,
                )

        # -- scheduler side ------------------------------------------------------------

        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
            assert self._scheduler is not None
            tokens = self._scheduler.matched_tokens(
                request.request_id,
                request.block_hashes,
                request.num_tokens,
                num_computed_tokens,
                getattr(request, "cache_salt", None),
                getattr(request, "all_token_ids", ()),
            )
            return tokens, tokens is not None and tokens > 0

        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
            assert self._scheduler is not None
            block_ids = blocks.get_block_ids()[0] if blocks is not None else []
            self._scheduler.allocated(request.request_id, block_ids, num_external_tokens)

        def build_connector_meta(self, scheduler_output: Any) -> KVFlowConnectorMetadata:
            assert self._scheduler is not None
            counts = scheduler_output.num_scheduled_tokens
            scheduled: list[tuple[str, int, Any, bool]] = []
            for new in scheduler_output.scheduled_new_reqs:
                ids = new.block_ids[0] if new.block_ids else []
                scheduled.append((new.req_id, new.num_computed_tokens + counts.get(new.req_id, 0), ids, True))
            cached = scheduler_output.scheduled_cached_reqs
            resumed: set[str] = set(cached.resumed_req_ids)
            for i, req_id in enumerate(cached.req_ids):
                new_ids = cached.new_block_ids[i]
                ids = None if new_ids is None else new_ids[0]
                scheduled.append((req_id, cached.num_computed_tokens[i] + counts.get(req_id, 0), ids, req_id in resumed))
            preempted = sorted(scheduler_output.preempted_req_ids or ())
            return KVFlowConnectorMetadata(plan=self._scheduler.step(scheduled, preempted))

        def update_connector_output(self, connector_output: Any) -> None:
            assert self._scheduler is not None
            meta = connector_output.kv_connector_worker_meta  # (None: no worker reported anything)
            if meta is not None and meta.disk_entries:
                self._scheduler.disk_entries(meta.disk_entries)
            if meta is None:
                self._scheduler.results([])
            else:
                self._scheduler.results(meta.results, refusals=meta.refused, probes=meta.probes)

        def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
            assert self._scheduler is not None
            return self._scheduler.finished(request.request_id), None

        def take_events(self) -> list[Any]:
            """kvflow's tiers' KV events as vLLM's own (medium ``CPU``, ``DISK``, ``REMOTE``), for
            vLLM's publisher, naming blocks (and a stored run's parent) as vLLM's own events do
            (``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), with the stored blocks' token ids."""
            if self._scheduler is None:
                return []
            from vllm.distributed import kv_events as vk
            from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

            def vllm_form(hashes: list[Any]) -> list[Any]:
                # as vLLM names blocks in its own events (bytes, or their last 8 bytes as an int)
                return [maybe_convert_block_hash(h) if isinstance(h, bytes) else h for h in hashes]

            out: list[Any] = []
            for event in self._scheduler.take_kv_events():
                if isinstance(event, BlockStored):
                    parent = event.parent_block_hash
                    out.append(
                        vk.BlockStored(
                            block_hashes=vllm_form(event.block_hashes),
                            parent_block_hash=None if parent is None else vllm_form([parent])[0],
                            token_ids=event.token_ids,
                            block_size=event.block_size,
                            lora_id=None,
                            medium=event.medium,
                            lora_name=None,
                        )
                    )
                elif isinstance(event, BlockRemoved):
                    out.append(vk.BlockRemoved(block_hashes=vllm_form(event.block_hashes), medium=event.medium))
                else:
                    out.append(vk.AllBlocksCleared())
            return out

        def reset_cache(self) -> bool:
            if self._scheduler is not None:
                self._scheduler.manager.reset()
            return True

        # -- worker side ---------------------------------------------------------------

        def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
            assert self._worker is not None
            self._worker.register(kv_caches)

        def bind_connector_metadata(self, connector_metadata: Any) -> None:
            super().bind_connector_metadata(connector_metadata)
            if self._worker is not None:
                self._worker.bind(connector_metadata.plan)

        def handle_preemptions(self, kv_connector_metadata: Any) -> None:
            return None  # (bind waits for the copies of preempted requests)

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
            assert self._worker is not None
            self._worker.start_loads()

        def wait_for_layer_load(self, layer_name: str) -> None:
            return None  # loads are asynchronous: vLLM schedules a request once its load is over

        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
            return None  # whole blocks are stored after the forward pass (wait_for_save)

        def wait_for_save(self) -> None:
            assert self._worker is not None
            self._worker.start_stores()

        def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
            assert self._worker is not None
            sending, recving = self._worker.finished()
            return (sending or None), (recving or None)

        def get_kv_connector_stats(self) -> KVFlowStats | None:
            if self._worker is None:
                return None
            stats = self._worker.take_stats()
            return KVFlowStats(data=stats) if stats else None

        @classmethod
        def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVFlowStats:
            return KVFlowStats(data=dict(data or {}))

        @classmethod
        def build_prom_metrics(
            cls, vllm_config: Any, metric_types: Any, labelnames: Any, per_engine_labelvalues: Any
        ) -> KVFlowPromMetrics:
            return KVFlowPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

        def get_block_ids_with_load_errors(self) -> set[int]:
            return self._worker.take_load_errors() if self._worker is not None else set()

        def build_connector_worker_meta(self) -> KVFlowWorkerMetadata | None:
            if self._worker is None:
                return None
            results = self._worker.take_results()
            disk = self._worker.take_disk_entries()
            refused = self._worker.take_refused()
            probed = self._worker.take_probed()
            if not results and disk is None and not refused and probed is None:
                return None
            rank = self._worker.rank
            return KVFlowWorkerMetadata(
                results=results,
                disk_entries={} if disk is None else {rank: disk},
                refused=refused,
                probes={} if probed is None else {rank: probed},
            )

        def shutdown(self) -> None:
            if self._worker is not None:
                self._worker.close()
            if self._scheduler is not None:
                self._scheduler.close()

    __all__ = ["KVFlowConnector", "KVFlowConnectorMetadata", "KVFlowWorkerMetadata", "KVFlowStats", "KVFlowPromMetrics"]
