"""kvflow's side of transformers' continuous batching, without transformers: the engine, the
requests' chained block hashes, the device blocks kvflow holds, and what the run counted.

Device blocks are transformers' (its ``BlockManager`` hands them out and takes them back by
reference count). While a kvflow job names a device block, this side holds one reference on
it, so transformers can neither reuse it nor evict it; the reference goes when a step report
(or the engine's ``held_device_blocks``) says kvflow's hold ended. That is the whole contract
between the two block bookkeepings: no block is freed under a running copy (F15).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvflow.core.config import Config
from kvflow.engine.notices import StepReport
from kvflow.engine.protocols import Executor
from kvflow.engine.sync import SyncEngine

_KEY_BITS = (1 << 63) - 1  # a hash that fits a signed 64-bit integer is its own key (no derivation)


def extend_chain(hashes: list[int], tokens: Sequence[int], block_tokens: int) -> None:
    """Extend ``hashes`` (the chained hashes of a sequence's first full blocks) to every full
    block of ``tokens``: a block's hash covers its tokens and, through its parent's hash, the
    whole prefix, so two sequences share a hash exactly where they share the prefix."""
    parent = hashes[-1].to_bytes(8, "little") if hashes else b""
    for i in range(len(hashes), len(tokens) // block_tokens):
        chunk = array("q", tokens[i * block_tokens : (i + 1) * block_tokens]).tobytes()
        digest = hashlib.blake2b(parent + chunk, digest_size=8).digest()
        hashes.append(int.from_bytes(digest, "little") & _KEY_BITS)
        parent = hashes[-1].to_bytes(8, "little")


class BlockRefs(Protocol):
    """The reference counts of the engine's device blocks (transformers' ``BlockManager``)."""

    def increase_ref_count(self, block_id: int) -> None: ...

    def decrease_ref_count(self, block_id: int) -> None: ...


@dataclass(frozen=True)
class KvflowTier:
    """kvflow behind transformers' continuous batching: its CPU tier (``config.cpu_blocks``
    blocks of ``config.block_tokens`` tokens, which must be the batching's ``block_size``)
    serves prefix hits across requests and turns, and restores preempted requests in place of
    transformers' swap pool.

    ``trace_path`` records the run for ``kvflow replay`` and ``kvflow incidents``;
    ``executor`` builds what performs the copies from the KV tensors (one per layer, K and V
    alternating, block dimension first) and ``config.cpu_blocks`` (default: ``TorchExecutor``);
    ``clock`` is the engine's clock in milliseconds (default: monotonic)."""

    config: Config
    trace_path: str | None = None
    trace_meta: dict[str, Any] | None = None
    executor: Callable[[list[Any], int], Executor] | None = None
    clock: Callable[[], float] | None = None


@dataclass
class TierStats:
    """What one run counted, kvflow on or off (tokens are prompt tokens not computed)."""

    preemptions: int = 0  # requests sent back to waiting for lack of device blocks
    device_hit_tokens: int = 0  # found in transformers' own device prefix cache
    tier_hit_tokens: int = 0  # loaded from kvflow's CPU tier
    swap_restored_tokens: int = 0  # restored from transformers' CPU swap pool (kvflow off)
    loads_failed: int = 0  # kvflow loads that failed or came too late: recomputed
    loads_fenced: int = 0  # of which the copy may have still been running (fresh blocks)
    recomputed_tokens: int = 0  # the tokens of those loads
    offered_blocks: int = 0  # full blocks offered to the tier after the forward pass
    leaks: list[str] = field(default_factory=list)  # what was left behind at close (empty: nothing)


@dataclass
class _Request:
    hashes: list[int] = field(default_factory=list)
    offered: int = 0  # full blocks already offered to the tier


class TierSide:
    """One engine's worth of kvflow for one batch processor; every call comes from the
    generation thread (or after it ended)."""

    def __init__(
        self,
        engine: SyncEngine | None,
        block_tokens: int,
        refs: BlockRefs,
        compute_done: Callable[[], Any] = lambda: None,
    ) -> None:
        self.engine = engine
        self.block_tokens = block_tokens
        self.refs = refs
        self.compute_done = compute_done
        self.stats = TierStats()
        self._requests: dict[str, _Request] = {}
        self._held: set[int] = set()  # device blocks this side holds a reference on
        self._loading: dict[int, int] = {}  # load job -> its blocks, until ``outcome`` takes it
        self._outcomes: dict[int, tuple[bool, bool]] = {}  # load job -> (landed, fenced)

    # -- holds ---------------------------------------------------------------------------

    def held(self) -> set[int]:
        return self._held

    def _sync_holds(self) -> None:
        """One reference on every device block kvflow holds, none on the others."""
        assert self.engine is not None
        now = set(self.engine.held_device_blocks())
        for block in sorted(now - self._held):
            self.refs.increase_ref_count(block)
        for block in sorted(self._held - now):
            self.refs.decrease_ref_count(block)
        self._held = now

    # -- the step ------------------------------------------------------------------------

    def step(self) -> StepReport | None:
        if self.engine is None:
            return None
        report = self.engine.step(compute_done=self.compute_done() if self.engine.manager.state.queued else None)
        self._absorb(report)
        return report

    def _absorb(self, report: StepReport) -> None:
        for _, job in report.loads_finished:
            if job in self._loading:
                self._outcomes[job] = (True, False)
        for failure in report.loads_failed:
            if failure.job_id in self._loading:
                self._outcomes[failure.job_id] = (False, failure.fenced)
        self._sync_holds()

    # -- admission -----------------------------------------------------------------------

    def hits(self, request_id: str, tokens: Sequence[int], device_hit_blocks: int) -> int:
        """Blocks after the device's hits that the tier can load (pinned until ``load`` or
        ``release``)."""
        if self.engine is None:
            return 0
        record = self._requests.setdefault(request_id, _Request())
        extend_chain(record.hashes, tokens, self.block_tokens)
        return self.engine.lookup(request_id, record.hashes, len(tokens), device_hit_blocks)

    def release(self, request_id: str) -> None:
        """The request's hits are not taken now (no device blocks for them)."""
        if self.engine is not None:
            self.engine.accept_hits(request_id, [])

    def start_load(self, request_id: str, device_blocks: list[int]) -> int | None:
        """Load the first ``len(device_blocks)`` hits into them: the load's job, whose outcome
        a later step brings (``outcome``), or None when there is nothing to load (the hits
        are computed)."""
        assert self.engine is not None
        job = self.engine.accept_hits(request_id, device_blocks)
        self._sync_holds()
        if job is not None:
            self._loading[job] = len(device_blocks)
        return job

    def outcome(self, job: int) -> tuple[bool, bool] | None:
        """The load's outcome once a step brought it, (landed, fenced); None while it is
        outstanding. A load that fails or outlives its deadline is reported failed; fenced
        means its copy may still write the blocks, which stay held until it is over."""
        if job not in self._outcomes:
            return None
        landed, fenced = self._outcomes.pop(job)
        tokens = self._loading.pop(job) * self.block_tokens
        if landed:
            self.stats.tier_hit_tokens += tokens
        else:
            self.stats.loads_failed += 1
            self.stats.loads_fenced += fenced
            self.stats.recomputed_tokens += tokens
        return landed, fenced

    def abandon(self, job: int) -> None:
        """The request of this load went (cancelled): its outcome is not waited for (the
        blocks stay held until the copy is over, as for any job)."""
        self._loading.pop(job, None)
        self._outcomes.pop(job, None)

    def mark_offered(self, request_id: str, blocks: int) -> None:
        """The request's first ``blocks`` full blocks need no store (on the device's prefix
        cache or loaded from the tier)."""
        self._requests.setdefault(request_id, _Request()).offered = blocks

    # -- stores --------------------------------------------------------------------------

    def offer(self, request_id: str, computed: int, tokens: Callable[[], Sequence[int]], table: Sequence[int]) -> None:
        """The forward pass wrote KV for the request's first ``computed`` tokens into its
        blocks ``table``: store the full blocks not offered yet. ``tokens`` gives the sequence
        (called only when a block became full). Blocks kvflow still holds for another job are
        left out (the tier has them, or is storing them)."""
        if self.engine is None:
            return
        record = self._requests.setdefault(request_id, _Request())
        full = min(computed // self.block_tokens, len(table))
        if full <= record.offered:
            return
        extend_chain(record.hashes, tokens(), self.block_tokens)
        pairs = [(record.hashes[i], table[i]) for i in range(record.offered, full) if table[i] not in self._held]
        record.offered = full
        if pairs:
            self.engine.blocks_computed(request_id, [h for h, _ in pairs], [b for _, b in pairs])
            self.stats.offered_blocks += len(pairs)
            self._sync_holds()

    # -- the end of a request ------------------------------------------------------------

    def finished(self, request_id: str, preempted: bool) -> None:
        """A finished request is forgotten (its chain touched deepest first); a preempted one
        keeps its hashes: it comes back under the same id and looks its blocks up again."""
        if preempted:
            self.stats.preemptions += 1
            record = self._requests.get(request_id)
            if record is not None:
                record.offered = 0
        else:
            self._requests.pop(request_id, None)
        if self.engine is not None:
            self.engine.finish_request(request_id, preempted=preempted)

    def close(self, timeout_ms: float = 60_000.0) -> list[str]:
        """Wait for every job, give back every hold, close the engine (and its trace). What
        was left behind, in words (empty: nothing)."""
        engine = self.engine
        if engine is None or engine.closed:
            return []
        self._absorb(engine.drain(timeout_ms=timeout_ms))
        leaks = []
        if engine.has_live_jobs():
            leaks.append("jobs still in flight")
        if engine.fences():
            leaks.append(f"{len(engine.fences())} fenced jobs")
        if self._loading:
            leaks.append(f"{len(self._loading)} loads whose outcome no request took")
        if self._held:
            leaks.append(f"{len(self._held)} device blocks held")
        pinned = sum(1 for pins in engine.manager.state.pin_count.values() if pins)
        if pinned:
            leaks.append(f"{pinned} tier blocks pinned")
        if engine.manager.state.requests:
            leaks.append(f"{len(engine.manager.state.requests)} requests not finished")
        engine.close()
        return leaks


def build_engine(tier: KvflowTier, kv_tensors: list[Any]) -> SyncEngine:
    """The engine for ``tier`` over the batching's KV tensors (``TorchExecutor`` unless the
    tier names another)."""
    if tier.executor is not None:
        executor = tier.executor(kv_tensors, tier.config.cpu_blocks)
    else:
        from kvflow.executors.torch.executor import TorchExecutor

        executor = TorchExecutor(kv_tensors, tier.config.cpu_blocks, block_dim=0)
    meta = {"engine": "transformers-continuous-batching", **(tier.trace_meta or {})}
    return SyncEngine(tier.config, executor, trace_path=tier.trace_path, trace_meta=meta, clock=tier.clock)


def check_tier(tier: KvflowTier, block_size: int) -> str | None:
    """Why ``tier`` cannot serve a batching of ``block_size``-token blocks (None: it can)."""
    config: Config = tier.config
    if config.block_tokens != block_size:
        return (
            f"KvflowTier: config.block_tokens={config.block_tokens} but the continuous batching's "
            f"block_size is {block_size}: they must be equal"
        )
    if config.store_mode != "eager":
        return "KvflowTier: config.store_mode must be 'eager' (transformers evicts its device blocks without notice)"
    if config.world_size != 1:
        return "KvflowTier: config.world_size must be 1 (one process, one device)"
    return None
