"""kvflow in a model's real loop on the GPU (tools/ref_engine.py): time to first token with a
16k-token prefix loaded from the CPU tier vs recomputed (the pass over the new tokens waiting
for the whole load, and overlapped with it layer by layer), decode throughput with kvflow on vs
off, the transfer rate inside the loop.

    python tools/bench_ref_engine.py [--prefix 16384] [--decode 128] [--repeat 3] [--decode-repeat 4]
                                     [--load-groups 32] [--copy-programs 0] [--out FILE]

The load inside the loop: from accepting the hits to knowing the load's outcome (host clock),
and the copies' own span on the load stream (GPU clock, timing events recorded before the hits
are accepted and after the copies are enqueued), each as a fraction of one contiguous copy.

Decode overhead: ``--decode-repeat`` runs of ``--decode`` tokens after a 1k-token prompt, the
engine with kvflow and the one without taking turns token by token (which goes first alternates
every token), so that the drift of clocks and of the host between runs cancels within each pair
of tokens; each token is timed between device synchronizations. Reported: the overhead over all
token pairs, the median, quartiles and range over windows of 16 token pairs (each holds one
block's store), and kvflow's own host time per token (inside ``step``/``blocks_computed``).
``--decode-repeat 0`` skips it.

Llama-3-8B's dimensions in bf16 with random weights from a fixed seed (32 layers, 8 KV heads
of 128: a 16-token block is 32 KiB per layer page, 2 MiB over all 64 pages). Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import ref_engine as ref  # noqa: E402

from kvflow.core.config import Config  # noqa: E402
from kvflow.engine.sync import SyncEngine  # noqa: E402
from kvflow.executors.torch.executor import TorchExecutor  # noqa: E402

B = 16


def link_gbps(nbytes: int = 1 << 30) -> float:
    """One contiguous pinned H2D copy: the link every rate is a fraction of."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - t0) / 1e9


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefix", type=int, default=16384)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode-repeat", type=int, default=4)
    ap.add_argument("--load-groups", type=int, default=None,
                    help="groups a load is enqueued in (default: one per layer)")
    ap.add_argument("--copy-programs", type=int, default=0,
                    help="the page kernel's programs (0: the executor's default)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    model = ref.random_llama(ref.LLAMA3_8B, device="cuda", dtype=torch.bfloat16, seed=0)
    prefix_blocks = args.prefix // B
    kv = ref.PagedKV(model.dims, num_blocks=2 * prefix_blocks + 64, block_tokens=B, device=model.device, dtype=model.dtype)
    groups = args.load_groups or model.dims.layers
    ex = TorchExecutor(kv.tensors(), prefix_blocks + 64, block_dim=0, load_groups=groups,
                       copy_programs=args.copy_programs)
    kvflow = SyncEngine(Config(cpu_blocks=prefix_blocks + 64, block_tokens=B, job_deadline_ms=60_000.0), ex)
    on = ref.RefEngine(model, kv, kvflow)
    gbps = link_gbps()
    say(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; one contiguous pinned H2D copy {gbps:.1f} GB/s; "
        f"loads in {groups} groups, copy programs {args.copy_programs or 'default'}")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.dims.vocab, (args.prefix + B // 2,), generator=g).tolist()

    expected_blocks = min(len(prompt) // B, (len(prompt) - 1) // B)  # (at most n-1 tokens hit)
    # time to first token: recomputed (the tier empty, the device cache forgotten) vs loaded,
    # the pass over the new tokens after the whole load (overlap off) or layer by layer behind it
    ttft: dict[str, list[float]] = {"recomputed": [], "serial": [], "overlapped": []}
    load_s: dict[str, list[float]] = {"serial": [], "overlapped": []}
    suffix_s: dict[str, list[float]] = {"serial": [], "overlapped": []}
    copies_s: list[float] = []  # overlapped: the copies' span on the load stream (GPU clock)
    before_s: list[float] = []  # the request's host work before the hits are handed over
    identical, bitwise = True, True
    for rep in range(args.repeat + 1):  # (the first pass warms up kernels and the pool)
        for mode in ("serial", "overlapped") if rep % 2 else ("overlapped", "serial"):
            on.overlap = mode == "overlapped"
            first, st1 = on.generate(prompt, 2)
            kvflow.drain(timeout_ms=60_000)
            table = on.last_table[:prefix_blocks]
            index = torch.tensor(table, device="cuda")
            snapshot = [t.index_select(0, index) for t in kv.tensors()]
            on.forget_device_cache()
            second, st2 = on.generate(prompt, 2)
            kvflow.drain(timeout_ms=60_000)
            loaded = torch.tensor(on.last_table[:prefix_blocks], device="cuda")
            same = all(torch.equal(a, t.index_select(0, loaded)) for a, t in zip(snapshot, kv.tensors()))
            del snapshot
            on.forget_device_cache()
            kvflow.manager.evict(len(kvflow.manager.state.policy))  # next round recomputes again
            if rep == 0:
                continue
            ttft["recomputed"].append(st1.ttft_s)
            ttft[mode].append(st2.ttft_s)
            load_s[mode].append(st2.load_s)
            before_s.append(st2.before_load_s)
            if st2.load_marks is not None:
                st2.load_marks[1].synchronize()
                copies_s.append(st2.load_marks[0].elapsed_time(st2.load_marks[1]) / 1e3)
            suffix_s[mode].append(st2.prefill_s)
            identical &= first == second
            bitwise &= same and st2.loaded_blocks == expected_blocks
    on.overlap = True
    nbytes = expected_blocks * ex.layout.block_bytes
    med = {k: statistics.median(v) for k, v in ttft.items()}
    tc = med["recomputed"]
    say(f"TTFT, {args.prefix}-token prefix (+{B // 2} new tokens), medians of {args.repeat} (recomputed: {2 * args.repeat}):")
    say(f"  recomputed                    {tc * 1e3:8.1f} ms")
    for mode, what in (("serial", "load, then the pass"), ("overlapped", "pass layer by layer behind the load")):
        ls = statistics.median(load_s[mode])
        say(f"  loaded, {what:<36} {med[mode] * 1e3:8.1f} ms   ratio {med[mode] / tc:.3f}x (goal <= 0.1x)")
        say(f"    load submitted -> outcome known {ls * 1e3:6.1f} ms for {nbytes / 2**30:.2f} GiB: "
            f"{nbytes / ls / 1e9:.1f} GB/s = {nbytes / ls / 1e9 / gbps:.2f} of the link; "
            f"pass over the {len(prompt) - expected_blocks * B} new tokens {statistics.median(suffix_s[mode]) * 1e3:.1f} ms (host time)")
    if copies_s:
        cs = statistics.median(copies_s)
        say(f"    overlapped, on the load stream from before the hits were accepted to the last copy "
            f"{cs * 1e3:.1f} ms: {nbytes / cs / 1e9 / gbps:.2f} of the link (outcome known "
            f"{(statistics.median(load_s['overlapped']) - cs) * 1e3:+.1f} ms later)")
    say(f"  before the load: the request's host work (hashes, device cache, lookup) "
        f"{statistics.median(before_s) * 1e3:.1f} ms")
    say(f"  first tokens identical: {identical}; loaded KV bitwise equal to the computed KV: {bitwise}")
    if args.decode_repeat < 1:
        kvflow.close()
        if args.out:
            Path(args.out).write_text("\n".join(lines) + "\n")
        return 0

    # decode, kvflow on vs off, token by token: the two engines take turns (which one goes first
    # alternates every token), each token timed between device synchronizations (a store's copy
    # is charged to kvflow's token rather than overlapping the other engine's); a window is
    # B tokens of each, so every window holds one block's store
    off_kv = ref.PagedKV(model.dims, num_blocks=160, block_tokens=B, device=model.device, dtype=model.dtype)
    off = ref.RefEngine(model, off_kv, None)
    short = prompt[: 1024 + 3]
    engines = {"on": on, "off": off}
    spent: dict[str, list[float]] = {"off": [], "on": []}
    windows: list[float] = []
    outs: dict[str, list[int]] = {}
    kv_host_s = 0.0
    for rep in range(args.decode_repeat + 1):  # (the first run warms up)
        for engine in engines.values():
            engine.forget_device_cache()
        kvflow.drain(timeout_ms=60_000)
        turns = {name: engine.turn(short, args.decode) for name, engine in engines.items()}
        for turn in turns.values():
            next(turn)  # the prompt and the first token (not timed)
        times: dict[str, list[float]] = {"off": [], "on": []}
        host = 0.0
        for k in range(args.decode - 1):
            for name in ("off", "on") if k % 2 else ("on", "off"):
                torch.cuda.synchronize()
                before = on.kvflow_s
                t0 = time.perf_counter()
                outs[name] = next(turns[name])[0]
                torch.cuda.synchronize()
                times[name].append(time.perf_counter() - t0)
                host += on.kvflow_s - before
        for turn in turns.values():
            for _ in turn:  # (ends the requests)
                pass
        if rep == 0:
            continue
        kv_host_s += host
        for name in spent:
            spent[name] += times[name]
        for a in range(0, len(times["on"]) - B + 1, B):
            windows.append(sum(times["on"][a : a + B]) / sum(times["off"][a : a + B]) - 1)
    if not windows:
        say("decode: too few tokens for one window of a block's tokens")
    else:
        overall = sum(spent["on"]) / sum(spent["off"]) - 1
        windows.sort()
        med = statistics.median(windows)
        q1, _, q3 = statistics.quantiles(windows, n=4) if len(windows) > 1 else (med,) * 3
        tokens = len(spent["on"])
        say(f"decode, {args.decode} tokens after a 1k prompt, {args.decode_repeat} runs, kvflow on and off "
            f"taking turns token by token: off {tokens / sum(spent['off']):.2f} tok/s, on "
            f"{tokens / sum(spent['on']):.2f} tok/s; overhead {overall * 100:.2f}% over all {tokens} token pairs, "
            f"median of {len(windows)} windows of {B} token pairs {med * 100:.2f}% (quartiles "
            f"{q1 * 100:.2f}% to {q3 * 100:.2f}%, windows from {windows[0] * 100:.2f}% to "
            f"{windows[-1] * 100:.2f}%; goal <= 2%); outputs identical: {outs['on'] == outs['off']}")
        say(f"  kvflow's host time inside the decode loop: {kv_host_s / sum(spent['on']) * 100:.2f}% of it "
            f"({kv_host_s / tokens * 1e6:.0f} us per token)")
    kvflow.close()
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
