#!/usr/bin/env python3
"""Link speed on a churned tier: kvflow's TorchExecutor replays the slot and device-block
patterns of a recorded long simulation, against one contiguous pinned copy measured in the
same run.

A tier that is full and churning hands jobs scattered slots (evictions free slots all over the
pool): that, not the contiguous case, decides how fast kvflow moves real traffic. So:

    # 1. record a long simulation whose tier fills and churns, keep its copy patterns (small)
    kvflow simulate ../shared/traces/mooncake_synthetic_trace.jsonl \\
        --cpu-blocks 4000 --device-blocks 1000 --record /tmp/mooncake.jsonl
    python tools/bench_churn.py extract /tmp/mooncake.jsonl /tmp/churn.npz
    # 2. replay them on the GPU (or --quick anywhere: small, CPU)
    python tools/bench_churn.py run /tmp/churn.npz [--modes kernel,uva,host,runs] [--out FILE]

``extract`` keeps, for every submit of the simulation (one ``jobs_submitted`` record), its
store and load jobs' device blocks and slots, and where the tier first evicted (the replay
starts there: the tier is full from then on). ``run`` replays windows of those submits, about
``--gib`` GiB per direction, through ``TorchExecutor`` for several KV geometries: stores only,
loads only, and the recorded sequence with both directions overlapped. Every submit goes in
back to back, each waiting on one start event, and the figure is the bytes moved over the device
time from that event to the last copy's end. That event fires behind a gate (``Clock.gate``: the
device sleeps until every submit is enqueued), so the figure is the copy rate of the device; an
engine submits once per step, and a step lasts far longer than a submit. The rate with the host
submitting while the device copies (no gate: the host's submit time then shows) and the median
CPU time of one submit are reported beside it. The simulator numbers
device blocks without reuse, so the replay maps them onto its device cache through a fixed
random permutation (device pages are scattered in a real engine too). Each mode's data path is
checked once on one of the trace's own jobs (store, then load into other blocks, compare).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_transfer import Clock, Row, bench_link, gbps, make_kv, render  # noqa: E402

from kvflow.core.events import BlocksEvicted, JobsSubmitted, LoadQueued, StoreQueued
from kvflow.core.jobs import STORE, TransferJob  # noqa: E402
from kvflow.executors.torch.executor import TorchExecutor  # noqa: E402
from kvflow.executors.torch.transfer_plan import slot_runs  # noqa: E402
from kvflow.log.reader import TraceReader  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_ids = itertools.count(1)


# --- extract ---------------------------------------------------------------------------------


def extract(trace: str, out: str) -> dict[str, float]:
    """Write the copy patterns of ``trace`` to ``out`` (npz); return their fragmentation."""
    queued: dict[int, tuple[int, tuple[int, ...], tuple[int, ...]]] = {}
    steps: list[list[int]] = []
    first_evicted_step = -1
    with TraceReader(trace) as reader:
        cpu_blocks = reader.config.cpu_blocks
        for _, rec in reader.records():
            if isinstance(rec, (StoreQueued, LoadQueued)):
                direction = 0 if isinstance(rec, StoreQueued) else 1
                queued[rec.job_id] = (direction, rec.device_blocks, rec.slots)
            elif isinstance(rec, JobsSubmitted):
                steps.append([j for j in rec.job_ids if j in queued])
            elif isinstance(rec, BlocksEvicted) and first_evicted_step < 0:
                first_evicted_step = len(steps)
    if not steps:
        raise ValueError(f"{trace}: no jobs_submitted records: record a simulation with --record")
    step_off, job_dir, job_off, devs, slots = [0], [], [0], [], []
    for jobs in steps:
        for j in jobs:
            direction, dev, sl = queued[j]
            job_dir.append(direction)
            devs.extend(dev)
            slots.extend(sl)
            job_off.append(len(slots))
        step_off.append(len(job_dir))
    np.savez_compressed(
        out,
        step_off=np.asarray(step_off, np.int64),
        job_dir=np.asarray(job_dir, np.int8),
        job_off=np.asarray(job_off, np.int64),
        device_blocks=np.asarray(devs, np.int64),
        slots=np.asarray(slots, np.int64),
        cpu_blocks=np.int64(cpu_blocks),
        first_full_step=np.int64(max(first_evicted_step, 0)),
    )
    return fragmentation(np.load(out))


def fragmentation(p: dict[str, np.ndarray] | np.lib.npyio.NpzFile) -> dict[str, float]:
    """Slots per contiguous run of load jobs (sorted, as the executor merges them), and the
    share of loaded blocks in jobs of more than 16 runs, after the tier is full."""
    job_off, job_dir = p["job_off"], p["job_dir"]
    first_job = int(p["step_off"][int(p["first_full_step"])])
    runs = blocks = many = 0
    for j in range(first_job, len(job_dir)):
        if job_dir[j] != 1:
            continue
        sl = np.sort(p["slots"][job_off[j] : job_off[j + 1]])
        r = len(slot_runs(sl))
        runs += r
        blocks += len(sl)
        many += len(sl) if r > 16 else 0
    return {
        "steps": float(len(p["step_off"]) - 1),
        "first_full_step": float(p["first_full_step"]),
        "slots_per_run": blocks / max(1, runs),
        "share_in_jobs_over_16_runs": many / max(1, blocks),
    }


# --- replay ----------------------------------------------------------------------------------


Steps = list[list[tuple[int, np.ndarray, np.ndarray]]]  # submits of (direction, dev, slots)


class Patterns:
    """The extracted submits, mapped onto a device cache of ``num_blocks`` blocks."""

    def __init__(self, path: str, num_blocks: int, seed: int = 0) -> None:
        p = np.load(path)
        self.step_off, self.job_dir, self.job_off = p["step_off"], p["job_dir"], p["job_off"]
        perm = np.random.default_rng(seed).permutation(num_blocks)
        self.device_blocks = perm[p["device_blocks"] % num_blocks]
        self.slots = p["slots"]
        self.cpu_blocks = int(p["cpu_blocks"])
        self.first = int(p["first_full_step"])

    def steps(self, directions: tuple[int, ...], max_bytes: int, block_bytes: int) -> Steps:
        """Consecutive submits from the first full-tier one, keeping jobs of ``directions``,
        until about ``max_bytes`` per direction moved: each submit a list of (dir, dev, slots)."""
        out: Steps = []
        moved = dict.fromkeys(directions, 0)
        for s in range(self.first, len(self.step_off) - 1):
            jobs = []
            taken: dict[int, set[int]] = {0: set(), 1: set()}
            for j in range(self.step_off[s], self.step_off[s + 1]):
                d = int(self.job_dir[j])
                if d not in directions:
                    continue
                a, b = self.job_off[j], self.job_off[j + 1]
                dev, sl = self.device_blocks[a:b], self.slots[a:b]
                # the permutation can map two blocks of one submit onto one: drop the repeat
                key = sl if d == 0 else dev
                keep = np.array([k not in taken[d] for k in key.tolist()], dtype=bool)
                keep &= ~_repeats(key)
                taken[d].update(key[keep].tolist())
                if keep.any():
                    jobs.append((d, dev[keep], sl[keep]))
                    moved[d] += int(keep.sum()) * block_bytes
            if jobs:
                out.append(jobs)
            if all(v >= max_bytes for v in moved.values()):
                break
        return out


def interleave(stores: Steps, loads: Steps) -> Steps:
    """The store and the load windows merged by bytes moved, so both lanes stay busy (the
    trace stores about four times what it loads: its own sequence leaves the load lane idle)."""
    out: Steps = []
    done = [0, 0]
    total = [max(1, sum(len(j[1]) for s in w for j in s)) for w in (stores, loads)]
    i = k = 0
    while i < len(stores) or k < len(loads):
        take_store = k >= len(loads) or (
            i < len(stores) and done[0] / total[0] <= done[1] / total[1]
        )
        step = stores[i] if take_store else loads[k]
        done[0 if take_store else 1] += sum(len(j[1]) for j in step)
        i, k = (i + 1, k) if take_store else (i, k + 1)
        out.append(step)
    return out


def _repeats(a: np.ndarray) -> np.ndarray:
    """True at each element equal to an earlier one."""
    seen: set[int] = set()
    out = np.zeros(len(a), dtype=bool)
    for i, v in enumerate(a.tolist()):
        out[i] = v in seen
        seen.add(v)
    return out


def replay(
    ex: TorchExecutor, steps: Steps, clock: Clock, gate_ms: float = 0.0
) -> tuple[float, int, float, float]:
    """(device ms, bytes, median submit CPU ms, whole submit loop ms) of all ``steps`` submitted
    back to back. With ``gate_ms``, the start event fires only after the device slept that long
    (``Clock.gate``): every submit is enqueued by then, and the figure is the device's copy time
    alone (an engine submits once per step, each step far longer than one submit)."""
    batches = [  # built before the clock starts: what is timed is the executor
        [
            TransferJob(next(_ids), "store" if d == 0 else "load", tuple(dev.tolist()), tuple(sl.tolist()))
            for d, dev, sl in jobs
        ]
        for jobs in steps
    ]
    clock.sync()
    clock.gate(gate_ms)
    start = clock.event()
    submitted: list[TransferJob] = []
    cpu: list[float] = []
    t0 = time.perf_counter()
    for batch in batches:
        t = time.perf_counter()
        ex.submit(batch, compute_done=start)
        cpu.append((time.perf_counter() - t) * 1e3)
        submitted += batch
    loop_ms = (time.perf_counter() - t0) * 1e3
    ends = [clock.event(ex.stream(d)) for d in ("store", "load")]
    for job in submitted:
        r = ex.wait(job.job_id, timeout_s=300)
        if not r.ok:
            raise RuntimeError(f"job {job.job_id} failed: {r.error}")
    moved = sum(len(j.slots) for j in submitted) * ex.layout.block_bytes
    if start is None:
        return (time.perf_counter() - t0) * 1e3, moved, statistics.median(cpu), loop_ms
    ms = max(start.elapsed_time(e) for e in ends)  # type: ignore[attr-defined]
    if gate_ms and loop_ms > gate_ms:
        raise RuntimeError(f"the gate ({gate_ms:.1f} ms) opened before the submits were in "
                           f"({loop_ms:.1f} ms): the figure would include host time")
    return ms, moved, statistics.median(cpu), loop_ms


def check(ex: TorchExecutor, pat: Patterns, steps: Steps) -> bool:
    """Store one of the trace's load jobs' slots from other blocks, load them back, compare."""
    d, dev, sl = max((j for s in steps for j in s if j[0] == 1), key=lambda j: len(j[1]))
    others = np.setdiff1d(np.arange(ex.layout.num_blocks), dev)[: len(dev)]
    for job in (TransferJob(next(_ids), STORE, tuple(others.tolist()), tuple(sl.tolist())),
                TransferJob(next(_ids), "load", tuple(dev.tolist()), tuple(sl.tolist()))):
        ex.submit([job])
        if not ex.wait(job.job_id, timeout_s=300).ok:
            return False
    a, b = torch.from_numpy(others).to(ex.device), torch.from_numpy(dev).to(ex.device)
    return all(torch.equal(r.pages.index_select(0, a), r.pages.index_select(0, b)) for r in ex.layout.regions)


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    quick = args.quick
    reps = args.reps or (1 if quick else 3)
    nbytes = int((args.gib or (0.03 if quick else 1.0)) * GiB) // MiB * MiB
    layers = 4 if quick else 32
    clock = Clock(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    header = (
        f"device: {device} ({name}); torch {torch.__version__}; python {platform.python_version()}; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; patterns {args.patterns}; "
        f"{nbytes / GiB:.2f} GiB per direction per measurement, median of {reps}"
    )
    print(header, flush=True)
    frag = fragmentation(np.load(args.patterns))
    print(f"  patterns: {frag['steps']:.0f} submits, tier full from submit {frag['first_full_step']:.0f}; "
          f"load jobs: {frag['slots_per_run']:.1f} slots per run, "
          f"{frag['share_in_jobs_over_16_runs']:.0%} of loaded blocks in jobs of > 16 runs", flush=True)
    link = bench_link(device, min(nbytes, GiB), max(reps, 5), clock)
    print(f"  link: D2H {link['d2h']:.1f}  H2D {link['h2d']:.1f}  both {link['both']:.1f} GB/s", flush=True)
    rows = [
        Row("link: one contiguous pinned copy D2H", link["d2h"], ref=link["d2h"]),
        Row("link: one contiguous pinned copy H2D", link["h2d"], ref=link["h2d"]),
        Row("link: both directions at once", link["both"], ref=link["both"]),
    ]
    pages = [4 * KiB, 16 * KiB] if quick else [16 * KiB, 32 * KiB, 64 * KiB]
    configs = [(f"{p // KiB} KiB x {layers} layers", layers, p) for p in pages]
    configs.append(("256 KiB cross-layer" if quick else "2 MiB cross-layer", 1, 256 * KiB if quick else 2 * MiB))
    if args.pages:
        wanted = args.pages.split(",")
        configs = [c for c in configs if (str(c[2] // KiB) if c[1] > 1 else "cross") in wanted]
    modes = [m for m in args.modes.split(",") if m]
    if device.type != "cuda":
        modes = [m for m in modes if m not in ("uva",) and not (m.startswith("kernel") and not _interpreting())]
    for label, nl, page in configs:
        num_blocks = 2048 if not quick else 256
        kv = make_kv(device, nl, page, num_blocks, stacked=False)
        pat = Patterns(args.patterns, num_blocks)
        block = nl * page
        windows = {
            "store": pat.steps((0,), nbytes, block),
            "load": pat.steps((1,), nbytes, block),
        }
        windows["both"] = interleave(windows["store"], windows["load"])
        small = page <= 16 * KiB and nl > 1
        for mode in modes:
            scatter, _, option = mode.partition(":")
            kwargs = {"max_runs": 16} if scatter == "runs" else {}
            if scatter == "kernel" and option.split(":")[0]:
                kwargs["copy_programs"] = int(option.split(":")[0])
            try:
                if scatter == "torch-staged":  # the NPU's staged path (no page kernel), on CUDA
                    ex = TorchExecutor(kv, pat.cpu_blocks, scatter="staged")
                    if ex._stage is not None:
                        ex._tables = None
                        ex._stage = dataclasses.replace(ex._stage, tables=None)
                else:
                    ex = TorchExecutor(kv, pat.cpu_blocks, scatter=scatter, **kwargs)  # type: ignore[arg-type]
            except Exception as e:  # noqa: BLE001 - one mode missing must not cost the run
                print(f"  {label:<22} {mode:<10} unavailable: {e}", flush=True)
                continue
            try:
                ok = check(ex, pat, windows["load"])
                for what, steps in windows.items():
                    replay(ex, steps[:2], clock)  # warm-up (kernel compile, pinned staging)
                    live = [replay(ex, steps, clock) for _ in range(reps)]  # host and device racing
                    gate = 2 * max(r[3] for r in live) + 5
                    results = [replay(ex, steps, clock, gate) for _ in range(reps)]
                    ms = statistics.median(r[0] for r in results)
                    moved = results[0][1]
                    value = gbps(moved, ms)
                    live_value = gbps(moved, statistics.median(r[0] for r in live))
                    ref = link["both"] if what == "both" else link["d2h" if what == "store" else "h2d"]
                    target = 0.85 if what == "both" or small else 0.90
                    rows.append(Row(
                        f"churned {what} {label} ({mode})", value, ref=ref, target=target,
                        note=f"{len(steps)} submits, {moved / GiB:.2f} GiB, submit CPU median "
                             f"{statistics.median(r[2] for r in results):.3f} ms; submitted while copying "
                             f"{live_value / ref:.2f}; data check {'ok' if ok else 'FAILED'}",
                    ))
                    print(f"  {label:<22} {mode:<10} {what:<5} {value:6.1f} GB/s = {value / ref:.2f} of link "
                          f"(submitted while copying {live_value / ref:.2f}; {len(steps)} submits; "
                          f"data {'ok' if ok else 'FAILED'})", flush=True)
            except Exception as e:  # noqa: BLE001
                print(f"  {label:<22} {mode:<10} FAILED: {type(e).__name__}: {e}", flush=True)
            finally:
                ex.close()
        del kv
        if device.type == "cuda":
            torch.cuda.empty_cache()
    table = render(rows)
    print()
    print(header)
    print(table)
    if args.out:
        Path(args.out).write_text(
            f"# Churned-tier benchmark results\n\n{header}\n\nCommand: `{' '.join(sys.argv)}`\n\n{table}\n"
        )
    return 0


def _interpreting() -> bool:
    from kvflow.executors.torch.page_kernel import interpreting

    return interpreting()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="verb", required=True)
    ex = sub.add_parser("extract", help="keep a recorded trace's copy patterns in a small .npz")
    ex.add_argument("trace")
    ex.add_argument("out")
    rp = sub.add_parser("run", help="replay the patterns through TorchExecutor")
    rp.add_argument("patterns")
    rp.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    rp.add_argument("--quick", action="store_true", help="small sizes (runs on the CPU)")
    rp.add_argument("--reps", type=int, default=None)
    rp.add_argument("--gib", type=float, default=None, help="GiB per direction per measurement (1)")
    rp.add_argument("--pages", default=None, help="KiB per layer page to run, e.g. 16,32 (and "
                    "'cross' for 2 MiB cross-layer blocks); default all")
    rp.add_argument("--modes", default="kernel,uva,host,runs",
                    help="executor scatter modes to compare (torch-staged: the staged path "
                         "without the page kernel, as on an NPU); kernel:N sets the kernel's programs "
                         "(0: one per multiprocessor)")
    rp.add_argument("--out", default=None, help="also write the table as markdown here")
    args = ap.parse_args(argv)
    if args.verb == "extract":
        try:
            frag = extract(args.trace, args.out)
        except Exception as e:  # noqa: BLE001 - a bad trace is one line, not a traceback
            print(f"bench_churn extract: {e}", file=sys.stderr)
            return 1
        print(f"{args.out}: {frag['steps']:.0f} submits, tier full from submit {frag['first_full_step']:.0f}; "
              f"load jobs {frag['slots_per_run']:.1f} slots per run, "
              f"{frag['share_in_jobs_over_16_runs']:.0%} of loaded blocks in jobs of > 16 runs")
        return 0
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
