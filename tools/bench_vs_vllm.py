"""kvflow beside vLLM's CPU-offload bookkeeping, on the same work, in one run.

Runs the operation sequence of ``../shared/anchors/vllm_manager/`` (the Mooncake synthetic
trace, one request at a time, every transfer terminal before the next call) through vLLM's
``CPUOffloadingManager`` and through kvflow's ``SyncEngine`` + ``SimulatedExecutor``,
interleaved repetition by repetition (vLLM, kvflow, kvflow recording a trace, vLLM, ...), and
prints the medians in µs per full block and the ratios kvflow / vLLM (of the medians, which
the targets are; and, to show the machine's noise, the median and range of each repetition's own
ratio). Timings on these machines drift by 2x between runs; ratios taken inside one run less so.

kvflow's side, per request (keys = its full 512-token blocks in prefix order, as 64-bit ints:
the first 8 bytes, big-endian, of vLLM's 32-byte key digest):

1. ``lookup`` (at most ``(L-1)//512`` blocks can hit, DESIGN §7);
2. if hits: ``accept_hits`` (which touches the hits it loads deepest first), run the load to
   its end;
3. ``blocks_computed`` for the rest, run the store to its end;
4. ``finish_request`` (which touches the request's chain deepest first, ``reuse=False``: DESIGN
   §7's recency is kvflow's own rule, ``Config.chain_recency``, so the engine calls no
   ``touch``);
5. drain the KV events.

"Run to its end" is one ``step()`` that submits, the simulated copy finishing on the virtual
clock, and one ``step()`` that collects. The decision counts (hit / stored / evicted blocks) are
checked in every repetition against the figures in the anchor's README.

vLLM is imported from an unpacked 0.33.0 source tree (``--vllm-src`` or ``$VLLM_SRC``; the
anchor's README says how to get one); the anchor harness itself is imported from ``--anchor``.

``--baseline TREE`` compares two kvflow trees side by side in one run (this checkout and
another one, e.g. ``git worktree add ../kvflow-old <commit>``): each runs in a worker process
of its own that imports kvflow from its tree, and the repetitions interleave vLLM, this tree and
the baseline (the trees taking turns at going first), with and without the trace. It prints
both trees' figures, their decisions (which must be equal) and this tree's time over the
baseline's; the exit status is 1 if this tree is more than ``--tolerance`` slower than the
baseline (median of the per-repetition ratios).

Usage: python tools/bench_vs_vllm.py [--repeat 11] [--policy both] [--vllm-src DIR] [--baseline TREE]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from kvflow.core.config import Config
from kvflow.engine.sync import SyncEngine
from kvflow.executors.simulated import SimulatedExecutor, VirtualClock
from kvflow.integrations.vllm.kv_events import BlockRemoved, BlockStored, KVEventPublisher

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ANCHOR = ROOT.parent / "shared" / "anchors" / "vllm_manager" / "bench_vllm_manager.py"
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl"

BLOCK_TOKENS = 512
CAPACITY = 10_000
# The anchor README's decision counts: (hit blocks, stored, evicted) at 10,000 blocks.
EXPECTED = {
    ("vllm", "lru"): (52_952, 64_936, 54_936),
    ("vllm", "arc"): (53_882, 63_960, 53_960),
    ("kvflow", "lru"): (52_952, 64_936, 54_936),
    ("kvflow", "arc"): (53_347, 64_541, 54_541),
}


def load_anchor(path: Path) -> ModuleType:
    if not path.is_file():
        raise SystemExit(f"{path}: the vLLM anchor harness is not there (pass --anchor)")
    spec = importlib.util.spec_from_file_location("bench_vllm_manager", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def block_key(hash_id: int) -> int:
    """The 64-bit kvflow hash of a Mooncake block id: the first 8 bytes of vLLM's key digest."""
    return int.from_bytes(hashlib.sha256(b"mooncake-block-%d" % hash_id).digest()[:8], "big")


def kvflow_requests(trace: list[tuple[int, list[int]]]) -> list[tuple[str, int, tuple, tuple]]:
    """Untimed setup: per request its id, token count, keys and device block ids (the
    simulated engine never reuses one), like an engine's own bookkeeping."""
    keys: dict[int, int] = {}
    out = []
    next_device = 0
    for i, (n_tokens, ids) in enumerate(trace):
        ks = tuple(keys.get(h) or keys.setdefault(h, block_key(h)) for h in ids)
        device = tuple(range(next_device, next_device + len(ks)))
        next_device += len(ks)
        out.append((f"req-{i}", n_tokens, ks, device))
    return out


def run_kvflow(policy: str, reqs: list, trace_path: str | None) -> tuple[int, tuple[int, int, int], int]:
    """One timed pass of kvflow over the requests: (wall ns, (hit, stored, evicted), CPU ns)."""
    clock = VirtualClock()
    executor = SimulatedExecutor(clock)
    config = Config(cpu_blocks=CAPACITY, block_tokens=BLOCK_TOKENS, policy=policy)
    engine = SyncEngine(config, executor, clock=clock, trace_path=trace_path)
    publisher = KVEventPublisher(BLOCK_TOKENS)
    engine.manager.subscribe(publisher)
    lookup, accept_hits, blocks_computed = engine.lookup, engine.accept_hits, engine.blocks_computed
    finish, step, take = engine.finish_request, engine.step, publisher.take
    advance, next_done = clock.advance_to, executor.next_completion_ms
    removed = 0
    c0, t0 = time.process_time_ns(), time.perf_counter_ns()
    for rid, n_tokens, keys, device in reqs:
        hits = lookup(rid, keys, n_tokens)
        if hits:
            accept_hits(rid, device[:hits])
            step()
            advance(next_done())
            step()
        if hits < len(keys):
            blocks_computed(rid, keys[hits:], device[hits:])
            step()
            advance(next_done())
            step()
        finish(rid)
        for kv in take():
            if type(kv) is BlockRemoved:
                removed += len(kv.block_hashes)
    engine.close()
    t1, c1 = time.perf_counter_ns(), time.process_time_ns()
    c = engine.counters
    if c.blocks_evicted != removed:
        raise SystemExit(f"kvflow {policy}: {removed} blocks removed in KV events, {c.blocks_evicted} evicted")
    return t1 - t0, (c.blocks_loaded, c.blocks_stored, c.blocks_evicted), c1 - c0


def per_request_kvflow(policy: str, reqs: list) -> list[tuple[int, int, int]]:
    """Untimed: (hit, stored, evicted) per request, to compare with vLLM request by request."""
    clock = VirtualClock()
    executor = SimulatedExecutor(clock)
    engine = SyncEngine(Config(cpu_blocks=CAPACITY, block_tokens=BLOCK_TOKENS, policy=policy), executor, clock=clock)
    publisher = KVEventPublisher(BLOCK_TOKENS)
    engine.manager.subscribe(publisher)
    records = []
    for rid, n_tokens, keys, device in reqs:
        hits = engine.lookup(rid, keys, n_tokens)
        if hits:
            engine.accept_hits(rid, device[:hits])
            engine.step()
            clock.advance_to(executor.next_completion_ms())
            engine.step()
        stored = evicted = 0
        if hits < len(keys):
            engine.blocks_computed(rid, keys[hits:], device[hits:])
            engine.step()
            clock.advance_to(executor.next_completion_ms())
            engine.step()
        engine.finish_request(rid)
        for kv in publisher.take():
            if type(kv) is BlockStored:
                stored += len(kv.block_hashes)
            elif type(kv) is BlockRemoved:
                evicted += len(kv.block_hashes)
        records.append((hits, stored, evicted))
    engine.close()
    return records


def median(values: list[float]) -> float:
    return statistics.median(values)


def kvflow_once(policy: str, trace: list, trace_path: str | None) -> tuple[int, tuple[int, int, int], int]:
    """One timed pass of kvflow (its setup untimed, the collector frozen out of the way)."""
    gc.unfreeze()
    reqs = kvflow_requests(trace)
    gc.collect()
    gc.freeze()
    try:
        ns, counts, cpu_ns = run_kvflow(policy, reqs, trace_path)
    finally:
        gc.unfreeze()
    if trace_path is not None:
        os.unlink(trace_path)
    return ns, counts, cpu_ns


def worker(args: argparse.Namespace) -> int:
    """``--worker``: run kvflow passes for a parent on stdin/stdout, one JSON line each way
    (``{"policy", "traced"}`` -> ``{"ns", "counts"}``; ``{"policy", "decisions": true}`` ->
    ``{"records"}``), with the kvflow this process imports (its ``PYTHONPATH``)."""
    import kvflow

    anchor = load_anchor(args.anchor)
    trace = anchor.load_trace(args.trace, BLOCK_TOKENS, args.limit)
    print(json.dumps({"kvflow": os.path.dirname(kvflow.__file__)}), flush=True)
    for line in sys.stdin:
        ask = json.loads(line)
        if ask.get("decisions"):
            reply: dict[str, Any] = {"records": per_request_kvflow(ask["policy"], kvflow_requests(trace))}
        else:
            path = os.path.join(args.tmp, f"{ask['policy']}.jsonl") if ask["traced"] else None
            ns, counts, cpu_ns = kvflow_once(ask["policy"], trace, path)
            reply = {"ns": ns, "counts": counts, "cpu_ns": cpu_ns}
        print(json.dumps(reply), flush=True)
    return 0


class Worker:
    """A ``--worker`` process importing kvflow from ``tree``."""

    def __init__(self, tree: Path, args: argparse.Namespace, tmp: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", "--anchor", str(args.anchor),
               "--trace", str(args.trace), "--tmp", tmp]
        if args.limit:
            cmd += ["--limit", str(args.limit)]
        self.process = subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        imported = Path(self._read()["kvflow"]).resolve()
        if imported.parent != tree.resolve():
            raise SystemExit(f"the worker for {tree} imported kvflow from {imported}")

    def _read(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"a kvflow worker stopped (exit status {self.process.wait()})")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def ask(self, **request: Any) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return self._read()

    def run(self, policy: str, traced: bool) -> tuple[int, tuple[int, int, int], int]:
        reply = self.ask(policy=policy, traced=traced)
        return reply["ns"], tuple(reply["counts"]), reply["cpu_ns"]  # type: ignore[return-value]

    def decisions(self, policy: str) -> list[tuple[int, int, int]]:
        return [tuple(r) for r in self.ask(policy=policy, decisions=True)["records"]]  # type: ignore[misc]

    def close(self) -> None:
        assert self.process.stdin is not None
        self.process.stdin.close()
        self.process.wait()


def bench_policy(policy: str, args: argparse.Namespace, anchor: ModuleType, base: Any, manager_mod: Any,
                 trace: list, tmp: str, workers: dict[str, Worker]) -> dict[str, Any]:
    """The interleaved repetitions of one policy. ``workers``: kvflow trees by name, each in
    a process of its own (empty: this process's kvflow, named "kvflow")."""
    HIT = base.LookupResult.HIT
    full_blocks = sum(len(ids) for _, ids in trace)

    def vllm_once() -> tuple[int, tuple[int, int, int], list]:
        gc.unfreeze()
        reqs = anchor.build_requests(trace, BLOCK_TOKENS, True, base)
        gc.collect()
        gc.freeze()
        mgr = manager_mod.CPUOffloadingManager(num_chunks=CAPACITY, cache_policy=policy, enable_events=True)
        ns, records, _ = anchor.run_clean(mgr, reqs, False, True, HIT)
        counts = tuple(sum(r[k] for r in records) for k in range(3))
        return ns, counts, records  # type: ignore[return-value]

    def here(traced: bool) -> tuple[int, tuple[int, int, int], int]:
        return kvflow_once(policy, trace, os.path.join(tmp, f"{policy}.jsonl") if traced else None)

    def in_worker(w: Worker, traced: bool) -> Any:
        return lambda: w.run(policy, traced)

    # untimed checks: both sides make the decisions the anchor README lists (every tree the same)
    _, vllm_counts, vllm_records = vllm_once()
    sides: dict[str, list[tuple[int, int, int]]] = {}
    if workers:
        for name, w in workers.items():
            sides[name] = w.decisions(policy)
    else:
        sides["kvflow"] = per_request_kvflow(policy, kvflow_requests(trace))
    kv_records = next(iter(sides.values()))
    for name, records in sides.items():
        if records != kv_records:
            raise SystemExit(f"{name} {policy}: decisions differ from {next(iter(sides))}'s")
    kv_counts = tuple(sum(r[k] for r in kv_records) for k in range(3))
    same_requests = sum(1 for a, b in zip(vllm_records, kv_records) if tuple(a) == b)
    for side, counts in (("vllm", vllm_counts), ("kvflow", kv_counts)):
        if counts != EXPECTED[(side, policy)] and not args.limit:
            raise SystemExit(f"{side} {policy}: decisions {counts} != expected {EXPECTED[(side, policy)]}")

    def schedule(repetition: int) -> list[tuple[str, Any]]:
        """The runs of one repetition: vLLM, then each kvflow tree, then each with the trace;
        the trees take turns at going first (whichever runs right after another may pay for
        what that one left behind: caches, the collector, the clock)."""
        runs: list[tuple[str, Any]] = [("vllm", vllm_once)]
        names = list(workers) if repetition % 2 == 0 else list(reversed(workers))
        for traced in (False, True):
            suffix = "+trace" if traced else ""
            if workers:
                runs += [(name + suffix, in_worker(workers[name], traced)) for name in names]
            else:
                runs.append(("kvflow" + suffix, lambda traced=traced: here(traced)))
        return runs

    times: dict[str, list[float]] = {name: [] for name, _ in schedule(0)}
    cpu: dict[str, list[float]] = {name: [] for name in times if name != "vllm"}
    try:
        for repetition in range(args.repeat):
            for name, run in schedule(repetition):
                ns, counts, extra = run()
                expected = vllm_counts if name == "vllm" else kv_counts
                if counts != expected:
                    raise SystemExit(f"{name} {policy}: decisions {counts} changed from {expected}")
                times[name].append(ns / 1e3 / full_blocks)
                if name != "vllm":
                    cpu[name].append(extra / 1e3 / full_blocks)
    finally:
        gc.unfreeze()
    return {
        "policy": policy,
        "vllm_counts": vllm_counts,
        "kvflow_counts": kv_counts,
        "same_requests": same_requests,
        "requests": len(trace),
        "times": times,
        "cpu": cpu,
        "us_per_block": {k: median(v) for k, v in times.items()},
        "spread": {k: (min(v), max(v)) for k, v in times.items()},
    }


def paired(a: list[float], b: list[float]) -> list[float]:
    """Each repetition's ``a / b``, sorted: its runs came one after the other, so the machine's
    slower drift (another tenant, the clock) cancels in each; their spread shows how much of
    the medians' movement between runs is the machine's."""
    return sorted(x / y for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--anchor", type=Path, default=DEFAULT_ANCHOR, help="bench_vllm_manager.py of the anchor")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE, help="Mooncake workload trace")
    p.add_argument("--vllm-src", default=os.environ.get("VLLM_SRC"), help="vLLM 0.33.0 source tree ($VLLM_SRC)")
    p.add_argument("--policy", choices=["lru", "arc", "both"], default="both")
    p.add_argument("--repeat", type=int, default=11, help="interleaved repetitions (medians)")
    p.add_argument("--limit", type=int, default=None, help="first N requests only (counts unchecked)")
    p.add_argument("--baseline", type=Path, default=None,
                   help="another kvflow tree to run side by side with this one (each in a worker process)")
    p.add_argument("--tolerance", type=float, default=0.10,
                   help="with --baseline: how much slower than the baseline this tree may be (0.10: 10%%)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tmp", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    anchor = load_anchor(args.anchor)
    if not args.vllm_src:
        raise SystemExit("pass --vllm-src DIR (or set VLLM_SRC): an unpacked vLLM 0.33.0 sdist")
    if args.baseline is not None and not (args.baseline / "kvflow" / "__init__.py").is_file():
        raise SystemExit(f"--baseline {args.baseline}: not a kvflow tree (no kvflow/__init__.py)")
    vllm, base, manager_mod = anchor.import_vllm(args.vllm_src, shim=True)
    trace = anchor.load_trace(args.trace, BLOCK_TOKENS, args.limit)
    print(f"vLLM {vllm.__version__} CPUOffloadingManager vs kvflow SyncEngine + SimulatedExecutor; "
          f"python {sys.version.split()[0]}, {os.cpu_count()} cpus")
    print(f"trace {args.trace.name}: {len(trace)} requests, {sum(len(i) for _, i in trace):,} full blocks, "
          f"tier {CAPACITY:,} blocks; {args.repeat} interleaved repetitions, medians")
    ok = True
    policies = ["lru", "arc"] if args.policy == "both" else [args.policy]
    # the trace goes to memory-backed storage where there is one: disk writeback would add
    # noise to whichever run comes next
    shm = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(dir=shm) as tmp:
        workers: dict[str, Worker] = {}
        if args.baseline is not None:
            print(f"kvflow: this tree {ROOT}; baseline {args.baseline.resolve()}")
            for name, tree in (("kvflow", ROOT), ("baseline", args.baseline)):
                os.makedirs(os.path.join(tmp, name))
                workers[name] = Worker(tree, args, os.path.join(tmp, name))
        try:
            for policy in policies:
                r = bench_policy(policy, args, anchor, base, manager_mod, trace, tmp, workers)
                ok &= report(r, args)
        finally:
            for w in workers.values():
                w.close()
    return 0 if ok else 1


def report(r: dict[str, Any], args: argparse.Namespace) -> bool:
    """Print one policy's figures; False if this tree is slower than the baseline allows."""
    us, times = r["us_per_block"], r["times"]
    print(f"\n== {r['policy']}: decisions (hit / stored / evicted blocks) vLLM {r['vllm_counts']}, "
          f"kvflow {r['kvflow_counts']}{' (both trees)' if args.baseline else ''}; "
          f"requests decided alike: {r['same_requests']}/{r['requests']}")
    for name in times:
        lo, hi = r["spread"][name]
        line = f"  {name:<15} {us[name]:6.2f} µs per full block  (min {lo:.2f}, max {hi:.2f})"
        if name != "vllm":
            ratios = paired(times[name], times["vllm"])
            line += (f"   / vLLM {us[name] / us['vllm']:.2f}x  (per repetition {median(ratios):.2f}x, "
                     f"{ratios[0]:.2f}-{ratios[-1]:.2f})")
        print(line)
    ok = True
    if args.baseline is not None:
        cpu = r["cpu"]
        for suffix in ("", "+trace"):
            new, old = "kvflow" + suffix, "baseline" + suffix
            ratios = paired(times[new], times[old])
            cpu_ratios = paired(cpu[new], cpu[old])
            within = median(ratios) <= 1 + args.tolerance
            ok &= within
            print(f"  this tree / baseline{suffix:<7} {us[new] / us[old]:.3f}x of the medians; per repetition "
                  f"{median(ratios):.3f}x ({ratios[0]:.3f}-{ratios[-1]:.3f}): "
                  f"{'within' if within else 'MORE than'} {args.tolerance:.0%}")
            print(f"    (CPU time: {median(cpu[new]):.2f} / {median(cpu[old]):.2f} µs per full block, "
                  f"{median(cpu[new]) / median(cpu[old]):.3f}x; per repetition {median(cpu_ratios):.3f}x, "
                  f"{cpu_ratios[0]:.3f}-{cpu_ratios[-1]:.3f})")
    return ok


if __name__ == "__main__":
    sys.exit(main())
