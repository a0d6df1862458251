"""Capacity in the user's terms through the Python API: the model table, the geometry a
simulation uses, GB to blocks, and the sweep (kvflow.simulate.capacity, SimOptions, sweep)."""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

import pytest

from kvflow.core.errors import ConfigError
from kvflow.simulate.capacity import (
    DEFAULT_BYTES_PER_TOKEN,
    KV_DTYPES,
    MODELS,
    KvGeometry,
    blocks_for_gb,
    kv_geometry,
)
from kvflow.simulate.run import SUMMARY_KEYS, SimOptions, simulate, sweep
from kvflow.simulate.workload import EXAMPLE_WORKLOAD

# (num_hidden_layers, num_key_value_heads, head_dim) as each model's config.json gives them
PUBLISHED = {
    "llama3-8b": (32, 8, 128),
    "llama3-70b": (80, 8, 128),
    "qwen2.5-7b": (28, 4, 128),
    "qwen2.5-72b": (80, 8, 128),
    "mistral-7b": (32, 8, 128),
}


def test_the_model_table_holds_the_published_shapes() -> None:
    assert {name: (m.layers, m.kv_heads, m.head_dim) for name, m in MODELS.items()} == PUBLISHED


@pytest.mark.parametrize("name", sorted(PUBLISHED))
@pytest.mark.parametrize("dtype", sorted(KV_DTYPES))
def test_bytes_per_token_is_k_and_v_of_every_layer_and_head(name: str, dtype: str) -> None:
    layers, heads, dim = PUBLISHED[name]
    geometry = kv_geometry(name, dtype)
    assert geometry == KvGeometry(2 * layers * heads * dim * KV_DTYPES[dtype], name, dtype)
    assert geometry.bytes_per_block(512) == 512 * geometry.bytes_per_token


def test_llama3_8b_in_bfloat16_is_128_kib_a_token() -> None:
    assert kv_geometry("llama3-8b").bytes_per_token == 128 * 1024  # bf16 unless told
    assert kv_geometry("llama3-8b", "fp8").bytes_per_token == 64 * 1024
    assert kv_geometry("llama3-70b").bytes_per_token == 320 * 1024
    assert kv_geometry("qwen2.5-7b").bytes_per_token == 56 * 1024


def test_a_number_or_the_default() -> None:
    assert kv_geometry(kv_bytes_per_token=1000) == KvGeometry(1000)
    assert kv_geometry() == KvGeometry(DEFAULT_BYTES_PER_TOKEN, default=True)
    assert kv_geometry().as_dict()["source"] == "default"
    assert kv_geometry(kv_bytes_per_token=1000).as_dict() == {
        "source": "kv_bytes_per_token", "model": None, "kv_dtype": None, "bytes_per_token": 1000,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"model": "llama3-8b", "kv_bytes_per_token": 4096}, "not both"),
        ({"kv_dtype": "fp8"}, "--kv-dtype applies to --model"),
        ({"kv_dtype": "fp8", "kv_bytes_per_token": 4096}, "--kv-dtype applies to --model"),
        ({"model": "Llama3-8B"}, "'Llama3-8B'"),  # the API takes the table's names as they are
        ({"model": "llama3-8b", "kv_dtype": "int4"}, "'int4'"),
        ({"kv_bytes_per_token": 0}, "> 0"),
        ({"kv_bytes_per_token": True}, "True"),
        ({"kv_bytes_per_token": 4096.0}, "4096.0"),
    ],
)
def test_a_bad_geometry_is_refused(kwargs: dict[str, object], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        kv_geometry(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("gb", [0.3, 1.25, 16, 7.5, 123.456])
@pytest.mark.parametrize("bytes_per_block", [2**21, 10**8, 3 * 10**6 + 1])
def test_gb_is_whole_blocks_rounded_down(gb: float, bytes_per_block: int) -> None:
    exact = int(Fraction(str(gb)) * 10**9 // bytes_per_block)
    if exact == 0:
        with pytest.raises(ConfigError, match="less than one block"):
            blocks_for_gb(gb, bytes_per_block)
    else:
        assert blocks_for_gb(gb, bytes_per_block) == exact


def test_sim_options_size_the_tier_in_gb_of_the_model() -> None:
    options = SimOptions(cpu_gb=16, model="llama3-8b")
    assert options.bytes_per_block == 512 * 128 * 1024
    assert options.capacity_blocks() == 16 * 10**9 // (512 * 128 * 1024) == 238
    assert options.config().cpu_blocks == 238
    described = options.described()
    assert described["cpu_blocks"] == 238 and described["cpu_gb"] == 16
    assert described["cpu_bytes"] == 238 * options.bytes_per_block
    assert described["kv"] == kv_geometry("llama3-8b").as_dict()
    assert SimOptions().capacity_blocks() == 2000  # neither given: the documented default
    assert SimOptions(cpu_blocks=7).capacity_blocks() == 7
    with pytest.raises(ConfigError, match="--cpu-blocks or --cpu-gb, not both"):
        SimOptions(cpu_blocks=7, cpu_gb=1).validate()
    with pytest.raises(ConfigError, match="--block-tokens"):
        SimOptions(block_tokens=0).validate()


def test_a_geometry_changes_bytes_not_sequential_decisions() -> None:
    """One request at a time, the same block count gives the same counters whatever a block
    weighs; the bytes moved grow with it, and in timed mode so does the transfer time."""
    small_o, large_o = SimOptions(cpu_blocks=64), SimOptions(cpu_blocks=64, model="llama3-70b")
    small, large = simulate(str(EXAMPLE_WORKLOAD), small_o), simulate(str(EXAMPLE_WORKLOAD), large_o)
    assert {k: small[k] for k in SUMMARY_KEYS} == {k: large[k] for k in SUMMARY_KEYS}
    assert large["bytes_stored"] == small["bytes_stored"] * 80
    timed = [simulate(str(EXAMPLE_WORKLOAD), replace(o, mode="timed")) for o in (small_o, large_o)]
    assert timed[1]["load_p50_ms"] > timed[0]["load_p50_ms"]


def test_sweep_in_gb_is_each_capacity_run_alone() -> None:
    base = SimOptions(model="qwen2.5-7b")
    seen: list[tuple[str, float]] = []
    result = sweep(str(EXAMPLE_WORKLOAD), base, cpu_gb=[2, 8], on_run=lambda p, c, s: seen.append((p, c)))
    assert seen == [("lru", 2), ("lru", 8), ("arc", 2), ("arc", 8)]
    assert (result["unit"], result["capacities"], list(result["results"])) == ("GB", [2, 8], ["lru", "arc"])
    for policy in ("lru", "arc"):
        for gb, summary in zip([2, 8], result["results"][policy]):
            assert summary == simulate(str(EXAMPLE_WORKLOAD), replace(base, cpu_gb=gb, policy=policy))


def test_sweep_checks_every_run_before_the_first(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvflow.simulate.run as sim

    runs: list[object] = []
    monkeypatch.setattr(sim, "simulate", lambda *a, **k: runs.append(a))
    with pytest.raises(ConfigError, match="less than one block"):
        sweep(str(EXAMPLE_WORKLOAD), SimOptions(model="llama3-70b"), cpu_gb=[8, 0.1])
    with pytest.raises(ConfigError):
        sweep(str(EXAMPLE_WORKLOAD), SimOptions(), cpu_blocks=[8, -1])
    with pytest.raises(ConfigError, match="one kind"):
        sweep(str(EXAMPLE_WORKLOAD), SimOptions(), cpu_blocks=[8], cpu_gb=[1])
    with pytest.raises(ConfigError, match="one kind"):
        sweep(str(EXAMPLE_WORKLOAD), SimOptions())
    assert runs == []
    sweep(str(EXAMPLE_WORKLOAD), SimOptions(), cpu_blocks=[8], policies=["arc"])
    assert len(runs) == 1  # positive control: the spy sees a run
