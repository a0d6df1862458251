"""vLLM (CPU build) with kvflow as its KV connector vs without, on a multi-turn conversation
workload whose prefixes vLLM's own KV cache cannot keep: tokens per second and hit counts,
measured side by side in one run (interleaved repetitions, medians).

    .venv-vllm/bin/python tools/bench_vllm.py [--conversations 24] [--turns 3] [--repeat 3]

Run it in the venv ``.ci/run`` builds (vLLM's CPU build and glassllm); the model is glassllm's,
converted by tools/glassllm_model.py (nothing is downloaded).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

import glassllm_model  # noqa: E402

BLOCK = 32


def workload(conversations: int, turns: int) -> list[list[list[int]]]:
    """Per turn, every conversation's prompt: its own 64-token system prompt, then a turn of
    20 tokens per turn so far (the model's context is 128 tokens)."""
    out = []
    for turn in range(turns):
        out.append(
            [
                [(37 * c + k) % 1000 + 10 for k in range(2 * BLOCK)] + [200 + (c + t) % 700 for t in range(10 * (turn + 1))]
                for c in range(conversations)
            ]
        )
    return out


def run(model_dir: Path, with_kvflow: bool, prompts: list[list[list[int]]], gpu_blocks: int) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    kwargs: dict[str, Any] = dict(
        model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=128, block_size=BLOCK,
        enable_prefix_caching=True, num_gpu_blocks_override=gpu_blocks, max_num_seqs=8,
        max_num_batched_tokens=512, seed=0, enforce_eager=True,
    )
    if with_kvflow:
        kwargs["kv_transfer_config"] = {
            "kv_connector": "KVFlowConnector", "kv_connector_module_path": "kvflow.integrations.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"cpu_blocks": 4096},
        }
    llm = LLM(**kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    start = time.perf_counter()
    generated = cached = prompt_tokens = 0
    outputs = []
    for turn in prompts:
        for r in llm.generate([TokensPrompt(prompt_token_ids=p) for p in turn], params, use_tqdm=False):
            generated += len(r.outputs[0].token_ids)
            cached += int(r.num_cached_tokens or 0)
            prompt_tokens += len(r.prompt_token_ids)
            outputs.append(list(r.outputs[0].token_ids))
    seconds = time.perf_counter() - start
    connector = llm.llm_engine.engine_core.engine_core.scheduler.connector
    loads = connector._scheduler.loads_landed if connector is not None else 0
    if connector is not None:
        connector.shutdown()
    del llm
    return {"seconds": seconds, "tokens": generated + prompt_tokens - cached, "generated": generated,
            "cached": cached, "prompt": prompt_tokens, "loads": loads, "outputs": outputs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gpu-blocks", type=int, default=32, help="vLLM's own KV cache, in blocks of 32 tokens")
    args = ap.parse_args()
    prompts = workload(args.conversations, args.turns)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = glassllm_model.write_model(Path(tmp) / "glass")
        runs: dict[bool, list[dict[str, Any]]] = {False: [], True: []}
        for _ in range(args.repeat):
            for side in (False, True):  # interleaved
                runs[side].append(run(model_dir, side, prompts, args.gpu_blocks))
    same = all(r["outputs"] == runs[False][0]["outputs"] for rs in runs.values() for r in rs)
    print(f"vLLM CPU + glassllm: {args.conversations} conversations x {args.turns} turns, vLLM cache {args.gpu_blocks} blocks; "
          f"{args.repeat} interleaved repetitions, medians; outputs identical: {same}")
    med = {}
    for side, name in ((False, "vLLM alone"), (True, "vLLM + kvflow")):
        r = runs[side]
        tps = statistics.median(x["generated"] / x["seconds"] for x in r)
        med[side] = tps
        print(f"  {name:14s} {tps:8.1f} generated tokens/s  prompt tokens {r[0]['prompt']}, "
              f"cached {r[0]['cached']} ({r[0]['cached'] / r[0]['prompt']:.0%}), kvflow loads {r[0]['loads']}")
    print(f"  kvflow / alone: {med[True] / med[False]:.2f}x generated tokens/s")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
