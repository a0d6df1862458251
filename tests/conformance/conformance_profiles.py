"""Fault profiles: how a connector is made to fail for each of the suite's faults.

The suite drives vLLM through two programs (``conformance_drive.py``): ``local`` (a store fails,
a load fails, vLLM's prefix cache and the connector are reset, memory pressure preempts
requests) and ``remote`` (a remote tier behind a proxy whose replies come late, then stop).
vLLM makes the preemption and the reset itself; a profile says how the connector under test is
made to fail its store and load, and how its remote tier is pointed at the proxy. A fault the
profile cannot produce (not in ``faults``) is reported as not exercised, never passed.

A profile is any object with the attributes of ``FaultProfile``; name one of your own with
``KVFLOW_CONFORMANCE_PROFILE=module:attribute`` (docs/conformance.md).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAULTS = ("failed_store", "failed_load", "late_copy", "stalled_remote", "preemption", "reset")
CONVERSATIONS = 6


@dataclass(frozen=True)
class Plan:
    """What a seed picked: the conversation whose first turn's store fails, the one whose
    second turn's load fails, the one whose remote load comes late and the one whose lookup
    meets the stalled tier."""

    seed: int
    fail_store: int
    fail_load: int
    late: tuple[int, ...]
    stalled: tuple[int, ...]

    @classmethod
    def of(cls, seed: int) -> Plan:
        rng = random.Random(seed)
        fail_store = rng.randrange(CONVERSATIONS)
        fail_load = rng.choice([c for c in range(CONVERSATIONS) if c != fail_store])
        # the remote program's CPU tier keeps the last four conversations' prefixes: the first
        # two conversations' second turns find theirs in the remote tier alone
        late = rng.randrange(2)
        return cls(seed, fail_store, fail_load, (late,), (1 - late,))


class FaultProfile:
    """The interface (and the defaults: no fault of the connector's own, nothing to audit)."""

    connector = ""  # "module:Class"
    faults: frozenset[str] = frozenset({"preemption", "reset"})

    def deadline_s(self, program: str) -> float:
        """The connector's deadline for a copy in ``program``: no request may wait longer."""
        raise NotImplementedError

    def extra_config(self, program: str, plan: Plan, workdir: Path, remote_url: str | None) -> dict[str, Any]:
        """``kv_connector_extra_config`` for ``program``: ``plan``'s faults injected (those in
        ``faults``), the remote tier (``remote`` program) at ``remote_url``."""
        raise NotImplementedError

    def audit(self, connectors: list[Any]) -> list[str]:
        """What the connector still holds (the instances vLLM built): empty when nothing."""
        return []

    def evidence(self, program: str, workdir: Path) -> dict[str, int]:
        """Counts from the connector's own records that the faults happened (the suite checks
        that each exercised fault left some)."""
        return {}


class KvflowProfile(FaultProfile):
    """kvflow's connector: its own fault injection (``fail_job_ids``, kvflow's job ids, which
    the sequential first and second turns number in order), its trace for evidence, its
    manager and workers for the audit."""

    connector = "kvflow.integrations.vllm.connector:KVFlowConnector"
    faults = frozenset(FAULTS)

    def deadline_s(self, program: str) -> float:
        return 2.0 if program == "remote" else 10.0

    def extra_config(self, program: str, plan: Plan, workdir: Path, remote_url: str | None) -> dict[str, Any]:
        trace = str(workdir / f"{program}.jsonl")
        deadline_ms = self.deadline_s(program) * 1000.0
        if program == "local":
            # jobs 1-6: the first turns' stores, conversation by conversation; jobs 7-12: the
            # second turns' loads (a conversation whose store failed stores instead)
            fail = [1 + plan.fail_store, 7 + plan.fail_load]
            return {"cpu_blocks": 64, "trace_path": trace, "job_deadline_ms": deadline_ms, "fail_job_ids": fail}
        from tier_keys import keys_file

        # a CPU tier of four conversations' blocks: the first two are found in the remote tier
        return {"cpu_blocks": 8, "trace_path": trace, "job_deadline_ms": deadline_ms, "remote_url": remote_url,
                "remote_key_file": str(keys_file(workdir))}  # fmt: skip

    def audit(self, connectors: list[Any]) -> list[str]:
        leaks = []
        for connector in connectors:
            scheduler, worker = connector._scheduler, connector._worker
            if scheduler is not None:
                state = scheduler.manager.state
                if state.jobs:
                    leaks.append(f"kvflow holds {len(state.jobs)} jobs: {sorted(state.jobs)}")
                if state.fenced_slots:
                    leaks.append(f"kvflow fences {len(state.fenced_slots)} host slots")
                if state.pin_count:
                    leaks.append(f"kvflow pins {len(state.pin_count)} blocks")
                if state.held:
                    leaks.append(f"kvflow holds device blocks {sorted(state.held)}")
                if scheduler.requests:
                    leaks.append(f"kvflow tracks requests {sorted(scheduler.requests)}")
            if worker is not None and worker._jobs:
                leaks.append(f"a worker waits for copies {sorted(worker._jobs)}")
        return leaks

    def evidence(self, program: str, workdir: Path) -> dict[str, int]:
        from kvflow.core.events import EVENT_TYPES, JobFailed, JobTimedOut, LateResultIgnored
        from kvflow.log.reader import read_trace

        counts: dict[str, int] = {}
        _, records = read_trace(workdir / f"{program}.jsonl")
        for _, record in records:
            if isinstance(record, EVENT_TYPES) and isinstance(record, (JobFailed, JobTimedOut)):
                outcome = "failed" if isinstance(record, JobFailed) else "timed_out"
                key = f"{record.direction}_{outcome}"
                counts[key] = counts.get(key, 0) + 1
            elif isinstance(record, EVENT_TYPES) and isinstance(record, LateResultIgnored):
                counts["late_results"] = counts.get("late_results", 0) + 1
        return counts


KVFLOW = KvflowProfile()
