"""Hand-worked checks of tests/reference_sim.py, the independent model of DESIGN §7.

The reference is what kvflow's simulator is compared against, so it is itself pinned here by
scenarios small enough to follow on paper. They use 4-token blocks: a request of L tokens has
L // 4 full blocks and may hit at most (L - 1) // 4 of them. In the comments the CPU tier and the
device cache are written least recent first, e.g. cpu [2, 1] means 1 is the most recent.
Hash ids >= 100 name partial last blocks, which are never cached.
"""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from reference_sim import COUNTER_KEYS, reference_simulate

from kvflow.simulate.workload import EXAMPLE_WORKLOAD

B = 4
REPO = Path(__file__).resolve().parents[2]
MOONCAKE_TRACE = REPO.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"


def workload(directory: Path, *prompts: tuple[int, list[int]]) -> Path:
    """Write ``(input_length, hash_ids)`` prompts as a Mooncake workload, 10 ms apart."""
    path = directory / "workload.jsonl"
    lines = [
        json.dumps({"timestamp": 10 * i, "input_length": length, "output_length": 1,
                    "hash_ids": ids})
        for i, (length, ids) in enumerate(prompts)
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def expect(**counters: int) -> dict[str, int]:
    """A full result: the given counters, every other one 0."""
    unknown = set(counters) - set(COUNTER_KEYS)
    assert not unknown, unknown
    return {key: counters.get(key, 0) for key in COUNTER_KEYS}


def test_F13_the_reference_hits_one_block_less_at_an_exact_multiple_of_the_block_size(tmp_path: Path) -> None:
    path = workload(tmp_path, (8, [1, 2]), (8, [1, 2]), (9, [1, 2, 100]))
    # 1st (8 tokens): 2 full blocks, nothing to hit; stores 1, 2.
    # 2nd (8 tokens): cap = 7 // 4 = 1, so only block 1 hits (F13); nothing new to store.
    # 3rd (9 tokens): cap = 2, both full blocks hit.
    assert reference_simulate(path, cpu_blocks=10, device_blocks=0, block_tokens=B) == expect(
        requests=3, prompt_tokens=25, hit_tokens=12, cpu_hit_tokens=12,
        stored_blocks=2, loaded_blocks=3,
    )


def test_F14_the_reference_lru_evicts_a_chains_tail_before_its_head(tmp_path: Path) -> None:
    path = workload(
        tmp_path,
        (9, [1, 2, 100]),  # stores 1, 2 -> cpu [1, 2]; end touches 2 then 1 -> [2, 1]
        (5, [3, 101]),  # stores 3 -> [2, 1, 3]
        (5, [4, 102]),  # tier full: evicts 2, the chain's tail, not its head 1 -> [1, 3, 4]
        (9, [1, 2, 103]),  # hits 1 (touched -> [3, 4, 1]); storing 2 evicts 3 -> [4, 1, 2]
        # end touches 2, 1 -> [4, 2, 1]
        (5, [4, 104]),  # hits 4 -> [2, 1, 4]
        (5, [3, 105]),  # 3 was evicted: miss; storing 3 evicts 2 -> [1, 4, 3]
    )
    # Evicting the head 1 at the 3rd request would make the 4th miss; evicting 4 instead of 3 at
    # the 4th would make the 5th miss.
    assert reference_simulate(path, cpu_blocks=3, device_blocks=0, block_tokens=B) == expect(
        requests=6, prompt_tokens=38, hit_tokens=8, cpu_hit_tokens=8,
        stored_blocks=6, loaded_blocks=2, evicted_blocks=3,
    )


def test_F16_the_reference_never_evicts_a_stores_own_chain(tmp_path: Path) -> None:
    path = workload(
        tmp_path,
        (9, [1, 2, 100]),  # cpu [2, 1]
        (5, [3, 101]),  # cpu [2, 1, 3]
        # Hits 1, 2; the load touches 2 then 1 -> [3, 2, 1]. Storing 5 evicts 3; storing 6
        # finds only its own chain (1, 2, 5) left to evict: 6 is rejected -> [2, 1, 5];
        # end touches 5, 2, 1 -> [5, 2, 1].
        (17, [1, 2, 5, 6, 102]),
        # Hits 1 and 2: the chain survived its own store.
        (9, [1, 2, 103]),
    )
    # Before F16 the store of 6 evicted 2, the tail of its own hit, and the 4th request hit 1 only.
    assert reference_simulate(path, cpu_blocks=3, device_blocks=0, block_tokens=B) == expect(
        requests=4, prompt_tokens=40, hit_tokens=16, cpu_hit_tokens=16,
        stored_blocks=4, loaded_blocks=4, evicted_blocks=1,
    )


def test_a_request_larger_than_the_tier_stores_what_fits(tmp_path: Path) -> None:
    path = workload(
        tmp_path,
        # 3 full blocks, 2 slots: 1, 2 take the free slots; for 3 the only entries are this
        # job's own queued blocks, which cannot be evicted, so 3 is rejected. cpu [2, 1].
        (13, [1, 2, 3, 100]),
        # Hits 1, 2 (touched -> [2, 1]); 3 could only take the place of its own chain's 1 or
        # 2 (F16), so it is rejected again and the chain stays whole: [2, 1].
        (13, [1, 2, 3, 101]),
    )
    assert reference_simulate(path, cpu_blocks=2, device_blocks=0, block_tokens=B) == expect(
        requests=2, prompt_tokens=26, hit_tokens=8, cpu_hit_tokens=8,
        stored_blocks=2, loaded_blocks=2, evicted_blocks=0,
    )


def test_device_hit_comes_first_and_the_cpu_continues_it(tmp_path: Path) -> None:
    path = workload(
        tmp_path,
        # Eager stores 1, 2, 3. The device touches 3, 2, 1 and keeps only its most recent, 1.
        (13, [1, 2, 3, 100]),
        # Device hit 1 block, then the CPU hits 2, 3 (cap 3). Nothing new to store.
        (13, [1, 2, 3, 101]),
    )
    assert reference_simulate(path, cpu_blocks=10, device_blocks=1, block_tokens=B) == expect(
        requests=2, prompt_tokens=26, hit_tokens=12, cpu_hit_tokens=8, device_hit_tokens=4,
        stored_blocks=3, loaded_blocks=2,
    )


def test_no_cpu_tier_means_no_jobs_and_no_fault_draws(tmp_path: Path) -> None:
    path = workload(tmp_path, (13, [1, 2, 3, 100]), (13, [1, 2, 3, 101]))
    # The device keeps all 3 blocks; the 2nd request hits them all there. With cpu_blocks=0
    # there is no job to fail, even at fault_rate 1.
    result = reference_simulate(
        path, cpu_blocks=0, device_blocks=10, block_tokens=B, fault_rate=1.0
    )
    assert result == expect(
        requests=2, prompt_tokens=26, hit_tokens=12, device_hit_tokens=12
    )


def test_lazy_stores_only_what_the_device_evicts(tmp_path: Path) -> None:
    path = workload(
        tmp_path,
        (9, [1, 2, 100]),  # device [2, 1]: nothing evicted, nothing stored
        (9, [3, 4, 101]),  # device [2, 1, 4, 3] evicts 2, 1 -> stored, cpu [2, 1]
        # Not on the device any more: the CPU hits 1, 2. The device then evicts 4, 3 -> stored.
        (9, [1, 2, 102]),
    )
    assert reference_simulate(
        path, cpu_blocks=10, device_blocks=2, store="lazy", block_tokens=B
    ) == expect(
        requests=3, prompt_tokens=27, hit_tokens=8, cpu_hit_tokens=8,
        stored_blocks=4, loaded_blocks=2,
    )
    # While the device still holds a request's blocks, lazy has stored none; eager stores them
    # at once.
    (tmp_path / "first").mkdir()
    first_only = workload(tmp_path / "first", (9, [1, 2, 100]))
    lazy = reference_simulate(first_only, 10, 2, store="lazy", block_tokens=B)
    eager = reference_simulate(first_only, 10, 2, store="eager", block_tokens=B)
    assert (lazy["stored_blocks"], eager["stored_blocks"]) == (0, 2)


def test_lazy_without_a_device_cache_stores_everything_head_most_recent(tmp_path: Path) -> None:
    path = workload(
        tmp_path,
        # M = 0: the device touches 2, 1 and evicts both, deepest first; stored in that order,
        # so cpu [2, 1] with the head most recent.
        (9, [1, 2, 100]),
        (5, [3, 101]),  # stores 3, evicting 2 (not the head) -> [1, 3]
        # Hits 1 (-> [3, 1]). The device evicts 2, 1; storing 2 evicts 3 -> [1, 2].
        (9, [1, 2, 102]),
    )
    assert reference_simulate(
        path, cpu_blocks=2, device_blocks=0, store="lazy", block_tokens=B
    ) == expect(
        requests=3, prompt_tokens=23, hit_tokens=4, cpu_hit_tokens=4,
        stored_blocks=4, loaded_blocks=1, evicted_blocks=2,
    )


def test_every_job_fails_at_fault_rate_one(tmp_path: Path) -> None:
    path = workload(tmp_path, (9, [1, 2, 100]), (9, [1, 2, 101]))
    # Each request's store job fails, so nothing ever becomes resident and nothing hits.
    assert reference_simulate(
        path, cpu_blocks=10, device_blocks=0, block_tokens=B, fault_rate=1.0
    ) == expect(requests=2, prompt_tokens=18, failed_jobs=2)


def test_seeded_faults_worked_by_hand(tmp_path: Path) -> None:
    draws = random.Random(0)
    # The draws of seed 0, which fail a job at fault_rate 0.5 when < 0.5:
    assert [round(draws.random(), 3) for _ in range(8)] == [
        0.844, 0.758, 0.421, 0.259, 0.511, 0.405, 0.784, 0.303
    ]
    path = workload(
        tmp_path,
        (9, [1, 2, 100]),  # store [1, 2]: draw 0.844 ok. cpu [2, 1]
        (9, [1, 2, 101]),  # load 2 blocks: 0.758 ok -> hit 8
        (9, [1, 2, 102]),  # load: 0.421 fails -> no hit; 1, 2 stay resident, nothing to store
        (9, [1, 2, 103]),  # load: 0.259 fails
        (9, [1, 2, 104]),  # load: 0.511 ok -> hit 8
        # Store 5, 6 evicts 2 and 1; the job fails (0.405): slots freed, tier empty.
        (9, [5, 6, 105]),
        (9, [5, 6, 106]),  # miss; store 5, 6 into the freed slots, no eviction: 0.784 ok
        (9, [5, 6, 107]),  # load: 0.303 fails
    )
    assert reference_simulate(
        path, cpu_blocks=2, device_blocks=0, block_tokens=B, fault_rate=0.5, seed=0
    ) == expect(
        requests=8, prompt_tokens=72, hit_tokens=16, cpu_hit_tokens=16,
        stored_blocks=4, loaded_blocks=4, evicted_blocks=2, failed_jobs=4,
    )


def test_seeded_fault_run_is_deterministic_and_differs_from_no_faults() -> None:
    def run(fault_rate: float, seed: int) -> dict[str, int]:
        return reference_simulate(EXAMPLE_WORKLOAD, 256, 0, fault_rate=fault_rate, seed=seed)

    faulty = run(0.1, seed=1)
    assert faulty == run(0.1, seed=1)
    assert faulty["failed_jobs"] > 0
    assert faulty != run(0.0, seed=1)
    assert faulty != run(0.1, seed=2)
    assert run(0.0, seed=1) == run(0.0, seed=2)  # no faults: the seed is never drawn from


def ideal_prefix_hits(prompts: list[tuple[int, list[int]]], block_tokens: int) -> int:
    """Hit tokens of an unbounded cache: the longest prefix of full blocks seen before, capped."""
    seen: set[int] = set()
    hit_tokens = 0
    for length, ids in prompts:
        full = ids[: length // block_tokens]
        hit = 0
        while hit < (length - 1) // block_tokens and full[hit] in seen:
            hit += 1
        hit_tokens += hit * block_tokens
        seen.update(full)
    return hit_tokens


def check_unbounded_capacity_matches_ideal(path: Path, block_tokens: int) -> None:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    prompts = [(record["input_length"], record["hash_ids"]) for record in records]
    ideal = ideal_prefix_hits(prompts, block_tokens)
    unbounded = 10**9
    eager = reference_simulate(path, unbounded, 0, "eager", block_tokens)
    lazy = reference_simulate(path, unbounded, 0, "lazy", block_tokens)
    device_only = reference_simulate(path, 0, unbounded, "eager", block_tokens)
    assert eager == lazy
    assert eager["hit_tokens"] == eager["cpu_hit_tokens"] == ideal
    assert eager["loaded_blocks"] * block_tokens == ideal
    assert eager["evicted_blocks"] == eager["failed_jobs"] == 0
    assert device_only["hit_tokens"] == device_only["device_hit_tokens"] == ideal


def test_unbounded_tiers_reach_ideal_prefix_reuse_on_the_example() -> None:
    check_unbounded_capacity_matches_ideal(EXAMPLE_WORKLOAD, 512)


def test_unbounded_tiers_reach_ideal_prefix_reuse_on_the_mooncake_trace() -> None:
    if not MOONCAKE_TRACE.exists():
        pytest.skip(f"{MOONCAKE_TRACE} is absent (../shared beside the checkout)")
    check_unbounded_capacity_matches_ideal(MOONCAKE_TRACE, 512)


_prompt = st.integers(min_value=1, max_value=6 * B).flatmap(
    lambda length: st.tuples(
        st.just(length),
        st.lists(st.integers(0, 7), min_size=-(-length // B), max_size=-(-length // B)),
    )
)


@given(
    prompts=st.lists(_prompt, min_size=1, max_size=12),
    cpu_blocks=st.integers(0, 6),
    device_blocks=st.integers(0, 6),
    store=st.sampled_from(["eager", "lazy"]),
    fault_rate=st.sampled_from([0.0, 0.3]),
)
def test_counters_stay_consistent(
    prompts: list[tuple[int, list[int]]],
    cpu_blocks: int,
    device_blocks: int,
    store: str,
    fault_rate: float,
) -> None:
    with tempfile.TemporaryDirectory() as directory:
        result = reference_simulate(
            workload(Path(directory), *prompts), cpu_blocks, device_blocks, store, B, fault_rate
        )
    assert result["requests"] == len(prompts)
    assert result["prompt_tokens"] == sum(length for length, _ in prompts)
    assert result["hit_tokens"] == result["cpu_hit_tokens"] + result["device_hit_tokens"]
    assert result["hit_tokens"] <= ideal_prefix_hits(prompts, B)
    assert result["cpu_hit_tokens"] == result["loaded_blocks"] * B
    # Resident entries are those stored and not evicted; they never overflow the tier.
    assert result["stored_blocks"] - result["evicted_blocks"] <= cpu_blocks
    if cpu_blocks == 0 or fault_rate == 0.0:
        assert result["failed_jobs"] == 0
    if cpu_blocks == 0:
        assert result["stored_blocks"] == result["loaded_blocks"] == 0
