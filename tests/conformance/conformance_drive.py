"""One vLLM run of the conformance suite: ``python conformance_drive.py SPEC.json OUT.json``.

vLLM (its CPU build, scheduler and worker in this process) with glassllm's pretrained model,
greedy, its own KV cache too small to keep the conversations' prefixes, runs one program, in
phases, with the connector under test observed (``conformance_observe``) or without a connector
(the reference outputs). It writes what happened as JSON: each phase's requests (conversation,
request id, tokens, vLLM's cached-token count), the connector's observed calls, vLLM's blocks
left in use, the profile's audit and evidence.

Programs (``conformance_profiles`` says which faults each holds):

* ``local``: every conversation's first turn (a store fails), second turn (a load fails);
  vLLM's prefix cache and the connector reset; the first turns again (nothing may come from
  before the reset); all six at once, decoding long enough that vLLM preempts.
* ``remote``: the first turns (stored in the remote tier, through ``StallProxy``); a second
  turn whose remote load is answered late; with the tier stalled, a second turn the CPU tier
  holds and one whose prefix only the stalled tier holds; the tier recovers; shutdown with the
  tier stalled again.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

BLOCK = 32
PREFIX = 2 * BLOCK


def conversations(user_tokens: int = 20) -> list[list[int]]:
    """Six conversations: a 64-token system prompt of each one's own, then a user turn."""
    return [[(37 * i + k) % 1000 + 10 for k in range(PREFIX)] + [200 + i] * user_tokens for i in range(6)]


def main() -> int:
    spec = json.loads(Path(sys.argv[1]).read_text())
    out_path = Path(sys.argv[2])
    program, connector = spec["program"], spec.get("connector")
    workdir = Path(spec["workdir"])
    from conformance_profiles import Plan
    from stall_proxy import StallProxy
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    plan = Plan.of(int(spec["seed"]))
    profile: Any = None
    proxy: StallProxy | None = None
    kwargs: dict[str, Any] = dict(
        model=spec["model"], skip_tokenizer_init=True, dtype="float32", max_model_len=128, block_size=BLOCK,
        enable_prefix_caching=True, num_gpu_blocks_override=8, max_num_seqs=2, max_num_batched_tokens=128,
        seed=0, enforce_eager=True,
    )  # fmt: skip
    if connector is not None:
        os.environ["KVFLOW_CONFORMANCE_CONNECTOR"] = connector
        profile = _load(spec["profile"])
        deadline = profile.deadline_s(program)
        if program == "remote":
            proxy = StallProxy(spec["redis_host"], spec["redis_port"], late_s=deadline + 4.0)
        extra = profile.extra_config(program, plan, workdir, proxy.url if proxy else None)
        kwargs["kv_transfer_config"] = {
            "kv_connector": "ObservedConnector", "kv_connector_module_path": "conformance_observe",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra,
        }  # fmt: skip
    llm = LLM(**kwargs)
    convs = conversations()
    phases: list[dict[str, Any]] = []

    def generate(name: str, which: list[int], max_tokens: int = 8, batch: bool = False) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        started = time.monotonic()
        prompts = [TokensPrompt(prompt_token_ids=convs[c]) for c in which]
        if batch:
            results = llm.generate(prompts, params, use_tqdm=False)
        else:
            results = [llm.generate([p], params, use_tqdm=False)[0] for p in prompts]
        phases.append({
            "name": name, "started": started, "ended": time.monotonic(),
            "requests": [{"conv": c, "id": r.request_id, "tokens": list(r.outputs[0].token_ids),
                          "cached": int(r.num_cached_tokens or 0)} for c, r in zip(which, results)],
        })  # fmt: skip

    everyone = list(range(6))
    if program == "local":
        generate("first_turns", everyone)
        generate("second_turns", everyone)
        phases.append({"name": "reset", "started": time.monotonic(), "requests": [],
                       "answer": llm.reset_prefix_cache(reset_connector=connector is not None)})  # fmt: skip
        generate("after_reset", everyone)
        generate("pressure", everyone, max_tokens=40, batch=True)
    else:
        generate("first_turns", everyone)
        if proxy is not None:
            proxy.set_mode("late")
        generate("late", list(plan.late))
        if proxy is not None:
            proxy.set_mode("stall")
        generate("stalled", [5, *plan.stalled])
        if proxy is not None:
            proxy.set_mode("pass")
    result: dict[str, Any] = {"phases": phases}
    if connector is not None:
        import conformance_observe

        engine = llm.llm_engine.engine_core.engine_core
        pool = engine.scheduler.kv_cache_manager.block_pool
        # the engine steps on (requests shorter than a block: nothing to store) until the
        # connector lets every block go, for a few deadlines at most
        until = time.monotonic() + 3 * deadline + 5.0
        tiny = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
        while True:
            leaks = profile.audit(conformance_observe.INSTANCES)
            in_use = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
            if (not leaks and not in_use and not engine.scheduler.requests) or time.monotonic() > until:
                break
            llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], tiny, use_tqdm=False)
            time.sleep(0.05)
        result["leaks"] = leaks
        result["vllm_blocks_in_use"] = in_use
        result["vllm_requests_left"] = sorted(engine.scheduler.requests)
        if proxy is not None:
            proxy.set_mode("stall")  # shutdown must not hang on a tier that answers nothing
            result["held_late"] = proxy.held_late
        started = time.monotonic()
        llm.llm_engine.engine_core.shutdown()
        result["shutdown_s"] = time.monotonic() - started
        result["calls"] = conformance_observe.CALLS
        result["evidence"] = profile.evidence(program, workdir)
        result["deadline_s"] = deadline
        result["plan"] = plan.__dict__
        if proxy is not None:
            proxy.close()
    out_path.write_text(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)  # (vLLM's leftover threads must not keep the run alive)


def _load(spec: str) -> Any:
    import importlib

    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


if __name__ == "__main__":
    sys.exit(main())
