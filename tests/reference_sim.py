"""An independent, deliberately simple implementation of the simulation model (DESIGN §7).

kvflow's simulator runs the real decision code (events, state, policies); this module runs the
same rules with plain dicts so that the tests can check kvflow's numbers against a second,
obviously-readable implementation. It must therefore import nothing from kvflow (only the
standard library) and stay simple rather than fast. Sequential mode, LRU policy only.

The rules, as refined for kvflow (B = block_tokens, L = input_length):

* A request has ``L // B`` full blocks, ``hash_ids[:L // B]``; at most ``cap = (L - 1) // B``
  blocks may hit (F13: at least one token is always computed).
* Device hit ``d``: the longest prefix of the full blocks in the device LRU cache (capacity M),
  at most ``cap``. Looking up does not change recency.
* CPU hit ``c``: from index ``d``, the longest run of blocks RESIDENT on the CPU tier, with
  ``d + c <= cap``. If ``c > 0`` one load job moves them; they are touched at once deepest first
  (the shallowest ends most recent). They are pinned until the load is terminal, but in
  sequential mode that is before anything could evict, so pins never change an outcome here.
* Faults: each job, load then store within a request, draws ``rng.random()`` once when
  ``fault_rate > 0`` and fails if the draw is ``< fault_rate``. A failed load counts its blocks
  as computed (they stay resident); a failed store frees its slots and stores nothing.
* Eager store, after the load: every full block not already on the tier (resident or queued in
  this job), in prefix order, takes a slot: a free one while the tier holds fewer than
  ``cpu_blocks`` entries (queued ones included), else by evicting the least recent resident
  entry that is not a block of the store itself (F16: its own chain, hits included, since the
  eager store names all the request's full blocks); when no such entry is left this block and
  every later one are rejected. Admitted blocks form one store job; on success they become
  resident, most recent, in queue order.
* End of request: the request's resident full blocks are touched deepest first; then the device
  cache touches all its full blocks deepest first and evicts its least recent blocks beyond M.
* Lazy store: nothing at step 3; the blocks the device evicted at the end of the request, in
  eviction order, are stored with the same slot rules.
* ``cpu_blocks == 0`` disables the tier: no loads, no stores, no jobs, no fault draws.
"""

from __future__ import annotations

import gzip
import json
import os
import random
from collections import OrderedDict
from collections.abc import Iterator

COUNTER_KEYS = (
    "requests",
    "prompt_tokens",
    "hit_tokens",
    "cpu_hit_tokens",
    "device_hit_tokens",
    "stored_blocks",
    "loaded_blocks",
    "evicted_blocks",
    "failed_jobs",
)


def read_prompts(path: str | os.PathLike[str]) -> Iterator[tuple[int, list[int]]]:
    """Yield ``(input_length, hash_ids)`` per non-blank line; no validation beyond json's."""
    opener = gzip.open if os.fspath(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as lines:
        for line in lines:
            if line.strip():
                record = json.loads(line)
                yield record["input_length"], record["hash_ids"]


def reference_simulate(
    path: str | os.PathLike[str],
    cpu_blocks: int,
    device_blocks: int,
    store: str = "eager",
    block_tokens: int = 512,
    fault_rate: float = 0.0,
    seed: int = 0,
) -> dict[str, int]:
    """Run the workload at ``path`` through the §7 rules and return kvflow's summary counters."""
    if store not in ("eager", "lazy"):
        raise ValueError(f"store must be 'eager' or 'lazy', got {store!r}")
    if cpu_blocks < 0 or device_blocks < 0 or block_tokens <= 0:
        raise ValueError("capacities must be >= 0 and block_tokens > 0")
    if not 0.0 <= fault_rate <= 1.0:
        raise ValueError(f"fault_rate must be in [0, 1], got {fault_rate}")

    rng = random.Random(seed)
    # Both caches: hash -> None, least recent first. The CPU dict holds RESIDENT entries only;
    # entries queued in a store job live in that job's list until it completes.
    cpu: OrderedDict[int, None] = OrderedDict()
    device: OrderedDict[int, None] = OrderedDict()
    counts = dict.fromkeys(COUNTER_KEYS, 0)
    tier_enabled = cpu_blocks > 0

    def job_fails() -> bool:
        failed = fault_rate > 0 and rng.random() < fault_rate
        if failed:
            counts["failed_jobs"] += 1
        return failed

    def store_job(hashes: list[int]) -> None:
        own = set(hashes)  # F16: a store never evicts a block of its own chain
        queued: list[int] = []
        for block in hashes:
            if block in cpu or block in queued:
                continue
            if len(cpu) + len(queued) >= cpu_blocks:
                victim = next((b for b in cpu if b not in own), None)
                if victim is None:
                    break  # only this store's own blocks are left: reject the rest
                del cpu[victim]
                counts["evicted_blocks"] += 1
            queued.append(block)
        if not queued or job_fails():
            return
        for block in queued:
            cpu[block] = None
        counts["stored_blocks"] += len(queued)

    for input_length, hash_ids in read_prompts(path):
        full = list(hash_ids[: input_length // block_tokens])
        cap = (input_length - 1) // block_tokens
        counts["requests"] += 1
        counts["prompt_tokens"] += input_length

        # 1. Device hit.
        device_hit = 0
        while device_hit < cap and full[device_hit] in device:
            device_hit += 1

        # 2. CPU hit and its load job.
        cpu_hit = 0
        if tier_enabled:
            while device_hit + cpu_hit < cap and full[device_hit + cpu_hit] in cpu:
                cpu_hit += 1
        if cpu_hit:
            for block in reversed(full[device_hit : device_hit + cpu_hit]):
                cpu.move_to_end(block)
            if job_fails():
                cpu_hit = 0
            else:
                counts["loaded_blocks"] += cpu_hit
        counts["device_hit_tokens"] += device_hit * block_tokens
        counts["cpu_hit_tokens"] += cpu_hit * block_tokens
        counts["hit_tokens"] += (device_hit + cpu_hit) * block_tokens

        # 3. Eager store.
        if tier_enabled and store == "eager":
            store_job(full)

        # 4. Recency, CPU tier then device cache.
        for block in reversed(full):
            if block in cpu:
                cpu.move_to_end(block)
        for block in reversed(full):
            device[block] = None
            device.move_to_end(block)
        device_evicted: list[int] = []
        while len(device) > device_blocks:
            device_evicted.append(device.popitem(last=False)[0])

        # 5. Lazy store.
        if tier_enabled and store == "lazy":
            store_job(device_evicted)

    return counts
