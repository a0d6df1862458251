"""kvflow behind transformers' continuous batching, head to head with transformers' own CPU
offload: one run, three arms over the same multi-turn workload.

    python tools/bench_transformers.py TRACE.jsonl                 # Llama-3-8B geometry, bf16, CUDA
    python tools/bench_transformers.py TRACE.jsonl --tiny          # a tiny model on the CPU (seconds)

The workload is drawn from a Mooncake-format trace (one JSON line per request: ``timestamp``,
``input_length``, ``output_length``, ``hash_ids``): requests whose first hash id is the same
form a conversation, its turns in file order. Each hash id becomes a fixed run of
``--tokens-per-id`` token ids (the same id, the same tokens, in every request), so turns that
share hash ids share a prefix. A conversation's turns run one after another (a turn is sent when
the previous one finished), the conversations side by side.

The model has Llama-3-8B's geometry (32 layers, hidden 4096, 32 heads, 8 KV heads, intermediate
14336) in bf16 with random weights from ``--seed``; nothing is downloaded. Blocks are 16 tokens;
the device cache holds about ``--cache-fraction`` of the conversations' blocks, so prefixes fall
out of it and requests are preempted.

Arms: ``none`` (preempted requests recompute: transformers' soft reset), ``transformers``
(transformers' pinned CPU swap pool, as many bytes as kvflow's tier), ``kvflow`` (kvflow's CPU
tier: prefix hits across requests and turns, and preempted requests' blocks). Printed: TTFT p50
and p99, generated tokens/s, preemptions, prompt tokens served by each tier, and whether every
turn's greedy output is token-exact against the first arm.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

BLOCK = 16
VOCAB = {True: 512, False: 128256}  # --tiny's, Llama-3's


@dataclass(frozen=True)
class Turn:
    prompt: list[int]
    max_new: int


@dataclass
class ArmResult:
    arm: str
    wall_s: float
    ttft_p50_ms: float
    ttft_p99_ms: float
    tokens_per_s: float  # generated tokens a second
    io_tokens_per_s: float  # prompt and generated tokens a second
    preemptions: int
    device_hit_tokens: int
    swap_restored_tokens: int
    tier_hit_tokens: int
    loads_failed: int
    leaks: list[str]
    outputs: dict[str, list[int]] = field(repr=False)


def tokens_of(hash_id: int, n: int, vocab: int) -> list[int]:
    """The fixed token ids of one hash id (ids 0..15 are left out: no special tokens)."""
    return [(hash_id * 1_000_003 + j * 7_919 + (hash_id * j) % 97) % (vocab - 16) + 16 for j in range(n)]


def read_conversations(
    path: str, conversations: int, turns: int, tokens_per_id: int, max_new: int, vocab: int
) -> list[list[Turn]]:
    """The first ``conversations`` multi-turn conversations of the trace (at most ``turns``
    turns each), hash ids mapped to token ids; the whole trace scaled by ``tokens_per_id / 512``
    (prompts and outputs alike, outputs capped at ``max_new``)."""
    from kvflow.core.errors import KvflowError
    from kvflow.simulate.workload import MOONCAKE_BLOCK_TOKENS, read_workload

    groups: dict[int, list[Any]] = defaultdict(list)
    try:
        for request in read_workload(path):
            if request.hash_ids:
                groups[request.hash_ids[0]].append(request)
    except KvflowError as exc:
        raise SystemExit(str(exc)) from None
    chosen = [requests[:turns] for requests in groups.values() if len(requests) >= 2][:conversations]
    if not chosen:
        raise SystemExit(f"{path}: no conversation (two requests sharing their first hash id)")
    scale = tokens_per_id / MOONCAKE_BLOCK_TOKENS
    return [
        [
            Turn(
                [t for h in r.hash_ids for t in tokens_of(h, tokens_per_id, vocab)][: max(1, math.ceil(r.input_length * scale))],
                max(1, min(math.ceil(r.output_length * scale), max_new)),
            )
            for r in requests
        ]
        for requests in chosen
    ]


def run_conversations(
    manager: Any, conversations: list[list[Turn]], *, history: bool = False, timeout_s: float = 600.0
) -> dict[str, Any]:
    """Each conversation's turns in order, the conversations side by side: the results by
    request id (``c{conversation}t{turn}``). With ``history`` a turn's prompt is the previous
    turn's prompt and output followed by its own tokens (a chat), else its own tokens alone."""
    results: dict[str, Any] = {}
    total = sum(len(c) for c in conversations)
    sent: dict[tuple[int, int], list[int]] = {}

    def send(c: int, t: int) -> None:
        turn = conversations[c][t]
        prompt = turn.prompt
        if history and t:
            before = results[f"c{c}t{t - 1}"]
            prompt = sent[c, t - 1] + list(before.generated_tokens) + prompt
        sent[c, t] = prompt
        manager.add_request(prompt, request_id=f"c{c}t{t}", max_new_tokens=turn.max_new, record_timestamps=True)

    for c in range(len(conversations)):
        send(c, 0)
    deadline = time.monotonic() + timeout_s
    while len(results) < total:
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running() or time.monotonic() > deadline:
                raise RuntimeError(f"the generation loop stopped with {total - len(results)} turns left")
            continue
        if not result.is_finished():
            continue
        if result.error is not None:
            raise RuntimeError(f"{result.request_id} failed: {result.error}")
        results[result.request_id] = result
        c, t = (int(x) for x in result.request_id[1:].split("t"))
        if t + 1 < len(conversations[c]):
            send(c, t + 1)
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


def build_model(tiny: bool, seed: int, device: str, dtype: torch.dtype) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        config = LlamaConfig(
            vocab_size=VOCAB[True], hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
        )
    else:  # Llama-3-8B's geometry
        config = LlamaConfig(
            vocab_size=VOCAB[False], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
        )
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def run_arm(
    model: Any, conversations: list[list[Turn]], arm: str, num_blocks: int, cpu_blocks: int,
    max_batch_tokens: int, trace_path: str | None,
) -> ArmResult:
    from transformers import ContinuousBatchingConfig, GenerationConfig

    from kvflow.core.config import Config
    from kvflow.integrations.transformers.batching import init_continuous_batching
    from kvflow.integrations.transformers.tier import KvflowTier

    cache = model.config
    block_bytes = 2 * cache.num_hidden_layers * BLOCK * cache.num_key_value_heads * (
        cache.hidden_size // cache.num_attention_heads
    ) * model.dtype.itemsize
    swap_gib = cpu_blocks * block_bytes / 2**30 if arm == "transformers" else 0.0
    cb = ContinuousBatchingConfig(
        block_size=BLOCK, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens, use_cuda_graph=False,
        cpu_offload_space=swap_gib, cpu_offload_space_safety_threshold=1.0, max_blocks_per_request=0,
    )
    tier = None
    if arm == "kvflow":
        tier = KvflowTier(Config(cpu_blocks=cpu_blocks, block_tokens=BLOCK), trace_path=trace_path)
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0, max_new_tokens=16)
    manager = init_continuous_batching(model, tier=tier, generation_config=generation, continuous_batching_config=cb)
    manager.warmup()  # builds the cache and the CPU pools (pinning them takes seconds) before the clock starts
    manager.start()
    start = time.perf_counter()
    try:
        results = run_conversations(manager, conversations)
    finally:
        wall = time.perf_counter() - start
        manager.stop(block=True)
        manager.destroy()
    stats = manager.stats
    ttft = [(r.timestamps[0] - r.created_time) * 1000.0 for r in results.values()]
    generated = sum(len(r.generated_tokens) for r in results.values())
    prompts = sum(len(t.prompt) for c in conversations for t in c)
    return ArmResult(
        arm=arm, wall_s=wall, ttft_p50_ms=percentile(ttft, 50), ttft_p99_ms=percentile(ttft, 99),
        tokens_per_s=generated / wall, io_tokens_per_s=(generated + prompts) / wall, preemptions=stats.preemptions, device_hit_tokens=stats.device_hit_tokens,
        swap_restored_tokens=stats.swap_restored_tokens, tier_hit_tokens=stats.tier_hit_tokens,
        loads_failed=stats.loads_failed, leaks=list(stats.leaks),
        outputs={rid: list(r.generated_tokens) for rid, r in results.items()},
    )


def table(results: list[ArmResult]) -> str:
    head = ("arm", "TTFT p50 ms", "TTFT p99 ms", "out tok/s", "in+out tok/s", "preempt", "device hit", "swap hit", "kvflow hit", "exact")
    base = results[0].outputs
    rows = []
    for r in results:
        same = sum(r.outputs[k] == v for k, v in base.items())
        rows.append((
            r.arm, f"{r.ttft_p50_ms:.1f}", f"{r.ttft_p99_ms:.1f}", f"{r.tokens_per_s:.1f}", f"{r.io_tokens_per_s:.0f}", str(r.preemptions),
            str(r.device_hit_tokens), str(r.swap_restored_tokens), str(r.tier_hit_tokens), f"{same}/{len(base)}",
        ))
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths)) for row in [head, *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a Mooncake-format JSONL workload")
    parser.add_argument("--tiny", action="store_true", help="a tiny float32 model on the CPU (a few seconds)")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens-per-id", type=int, default=32, help="tokens per hash id (Mooncake's are 512)")
    parser.add_argument("--max-new", type=int, default=32, help="cap on each turn's output length")
    parser.add_argument("--cache-fraction", type=float, default=0.25, help="of the conversations' blocks")
    parser.add_argument("--cpu-blocks", type=int, default=0, help="kvflow's tier = the swap pool (default: all)")
    parser.add_argument("--max-batch-tokens", type=int, default=0)
    parser.add_argument("--arms", default="none,transformers,kvflow")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default=None, help="default: bf16 (float32 --tiny)")
    parser.add_argument("--exact", action="store_true", help="exit 1 unless every arm's outputs are token-exact")
    parser.add_argument("--trace-out", default=None, help="record the kvflow arm's trace here")
    parser.add_argument("--json", default=None, help="write the figures (and every turn's output) here")
    args = parser.parse_args(argv)
    arms = args.arms.split(",")
    if not set(arms) <= {"none", "transformers", "kvflow"} or not arms:
        parser.error(f"--arms: choose from none, transformers, kvflow, not {args.arms!r}")
    if not Path(args.trace).is_file():
        parser.error(f"{args.trace}: no such file")
    device = "cpu" if args.tiny else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: use --tiny on the CPU")
    if device == "cpu" and "transformers" in arms:  # torch pins host memory only beside an accelerator
        print("transformers: skipped (its swap pool is pinned host memory, which needs CUDA)")
        arms.remove("transformers")
    conversations = read_conversations(
        args.trace, args.conversations, args.turns, args.tokens_per_id, args.max_new, VOCAB[args.tiny]
    )
    if args.tiny:
        torch.set_num_threads(1)  # (a tiny model's matrices: threads only contend)
    dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    model = build_model(args.tiny, args.seed, device, dtype)
    need = [max(math.ceil((len(t.prompt) + t.max_new) / BLOCK) for t in c) for c in conversations]
    num_blocks = max(math.ceil(args.cache_fraction * sum(need)), 2 * max(need) + 2)
    cpu_blocks = args.cpu_blocks or sum(
        math.ceil((len(t.prompt) + t.max_new) / BLOCK) for c in conversations for t in c
    )
    max_batch_tokens = args.max_batch_tokens or (64 if args.tiny else 2048)
    turns = sum(len(c) for c in conversations)
    print(
        f"{len(conversations)} conversations, {turns} turns, {sum(len(t.prompt) for c in conversations for t in c)} "
        f"prompt tokens; device cache {num_blocks} blocks ({sum(need)} for all conversations), "
        f"CPU {cpu_blocks} blocks; {device}, {model.dtype}",
        flush=True,
    )
    # one untimed turn first, so that the first arm does not pay for the device's first kernels
    run_arm(model, [conversations[0][:1]], "none", num_blocks, cpu_blocks, max_batch_tokens, None)
    results = []
    for arm in arms:
        results.append(run_arm(model, conversations, arm, num_blocks, cpu_blocks, max_batch_tokens, args.trace_out))
        print(f"  {arm}: {results[-1].wall_s:.1f} s", flush=True)
    print(table(results))
    leaks = [f"{r.arm}: {', '.join(r.leaks)}" for r in results if r.leaks]
    exact = all(r.outputs == results[0].outputs for r in results)
    print("token-exact across arms" if exact else "outputs differ between arms")
    if leaks:
        print("left behind: " + "; ".join(leaks))
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in results]))
    return 0 if (exact or not args.exact) and not leaks else 1


if __name__ == "__main__":
    sys.exit(main())
