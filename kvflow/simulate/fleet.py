"""``kvflow simulate --instances N``: a Mooncake workload routed across N kvflow instances, each
with its own device cache and CPU tier, run twice: once with a remote tier all instances share,
once with per-instance tiers only. Every instance is the sequential simulation of docs/simulate.md
(the real decision code); the shared tier is ``kvflow.tiers.simulated_remote``, reached through
the same remote-tier lifecycle as the Redis tier (probe, remote load, write-through).

Routing: ``round-robin`` (request i to instance i mod N) or ``session`` (session-affine: a
request goes where its first block's chain went; Mooncake traces carry no session id, and a
shared first block is what a session shares).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kvflow.core.errors import ConfigError
from kvflow.core.values import is_int
from kvflow.executors.simulated import SimulatedExecutor
from kvflow.simulate.run import SimOptions, Simulation
from kvflow.simulate.workload import WorkloadRequest, read_workload
from kvflow.tiers.simulated_remote import SimulatedRemoteExecutor, SimulatedRemoteStore

ROUTINGS = ("round-robin", "session")
MAX_INSTANCES = 1024


def instance_seed(seed: int, index: int) -> int:
    """The seed of instance ``index``'s fault draws (``--seed`` for the first, so a fleet of
    one is the plain simulation): each instance draws faults of its own, where one seed for
    all would fail the same jobs of every instance."""
    return seed + (index << 32)


class FleetInstance(Simulation):
    """One instance of the fleet: the sequential simulation, its executor beside the shared
    remote tier (when there is one)."""

    def __init__(self, options: SimOptions, remote: SimulatedRemoteStore | None) -> None:
        self.remote = remote
        super().__init__(options)

    def _wrap(self, executor: SimulatedExecutor) -> Any:
        self.copies = executor
        return executor if self.remote is None else SimulatedRemoteExecutor(executor, self.remote, self.clock)

    def faults_injected(self) -> int:
        """The faults its simulated executor drew (``--fault-rate``)."""
        return self.copies.stats.faults_injected

    def _before_lookup(self, rid: str, full: tuple[int, ...], L: int, d: int) -> int:
        """A first lookup probes the remote tier for what the CPU tier lacks, a second
        queues the remote load of what it found; both run to their end. Returns how many
        more blocks the CPU tier offers now than before."""
        if not self.config.remote:
            return 0
        engine = self.engine
        before = engine.lookup(rid, full, L, d)
        engine.accept_hits(rid, [])
        engine.step()  # the probe's answer is recorded
        engine.lookup(rid, full, L, d)
        engine.accept_hits(rid, [])
        self._run_until_idle()
        after = engine.lookup(rid, full, L, d)
        engine.accept_hits(rid, [])
        return after - before


def route(routing: str, instances: int) -> Callable[[int, WorkloadRequest], int]:
    """The instance index of the ``i``-th request."""
    if routing == "round-robin":
        return lambda i, req: i % instances
    # ints hash to themselves: the same first block goes to the same instance in every run
    return lambda i, req: (hash(req.hash_ids[0]) if req.hash_ids else i) % instances


def run_fleet(
    path: str, options: SimOptions, instances: int, routing: str, remote_blocks: int
) -> dict[str, Any]:
    """One run over ``instances``; a shared remote tier of ``remote_blocks`` (0: none)."""
    shared = SimulatedRemoteStore(remote_blocks) if remote_blocks else None
    per = replace(options, remote_blocks=remote_blocks, record=None)
    sims = [FleetInstance(replace(per, seed=instance_seed(options.seed, i)), shared) for i in range(instances)]
    pick = route(routing, instances)
    try:
        for i, req in enumerate(read_workload(path, options.block_tokens)):
            sims[pick(i, req)]._sequential_request(req)
    finally:
        for sim in sims:
            sim.engine.close()
    totals = {key: sum(getattr(s.totals, key) for s in sims) for key in (
        "requests", "prompt_tokens", "hit_tokens", "cpu_hit_tokens", "device_hit_tokens", "remote_hit_tokens"
    )}  # fmt: skip
    counters = [s.engine.counters for s in sims]
    bpb = options.bytes_per_block
    out: dict[str, Any] = {
        **totals,
        "hit_rate": totals["hit_tokens"] / totals["prompt_tokens"] if totals["prompt_tokens"] else 0.0,
        "cpu_bytes_stored": sum(c.bytes_stored for c in counters),
        "cpu_bytes_loaded": sum(c.bytes_loaded for c in counters),
        "remote_bytes_stored": sum(c.remote_bytes_stored for c in counters),
        "remote_bytes_loaded": sum(c.remote_bytes_loaded for c in counters),
        "cpu_bytes_held": sum(s.engine.manager.state.num_resident() for s in sims) * bpb,
        "remote_bytes_held": len(shared) * bpb if shared is not None else 0,
        # every instance's failed and timed-out jobs (its CPU tier's and its remote tier's)
        "jobs": sum(c.jobs_submitted for c in counters),
        "failed_jobs": sum(c.jobs_failed + c.jobs_timed_out for c in counters),
        "timed_out_jobs": sum(c.jobs_timed_out for c in counters),
        "faults_injected": sum(s.faults_injected() for s in sims),
        "per_instance_hit_rate": [
            s.totals.hit_tokens / s.totals.prompt_tokens if s.totals.prompt_tokens else 0.0 for s in sims
        ],
    }
    return out


def simulate_fleet(path: str, options: SimOptions, instances: int, routing: str, remote_blocks: int) -> dict[str, Any]:
    """Both runs, side by side: ``shared`` (the remote tier) and ``local`` (CPU tiers only)."""
    options.validate()
    if not is_int(instances) or not 1 <= instances <= MAX_INSTANCES:
        raise ConfigError(f"--instances must be a whole number within 1..{MAX_INSTANCES}, got {instances!r}")
    if routing not in ROUTINGS:
        raise ConfigError(f"--routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    if not is_int(remote_blocks) or remote_blocks <= 0:
        raise ConfigError(f"--remote-blocks must be a whole number > 0 with --instances, got {remote_blocks!r}")
    if options.mode != "sequential" or options.record is not None:
        raise ConfigError("--instances runs the sequential mode and records no trace (no --mode timed, --record)")
    replace(options, remote_blocks=remote_blocks).config()  # F11: bad sizes fail before any work
    return {
        "workload": str(path),
        "instances": instances,
        "routing": routing,
        "remote_blocks": remote_blocks,
        "remote_store_mode": options.remote_store_mode,
        "config": options.described(),  # (its CPU tier is each instance's)
        "shared": run_fleet(path, options, instances, routing, remote_blocks),
        "local": run_fleet(path, options, instances, routing, 0),
    }
