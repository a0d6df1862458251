"""Ways to move KV blocks between the GPU and pinned host memory, side by side in one run.

    python tools/bench_copy_methods.py [--gib 1] [--step-blocks 128] [--reps 3] [--out FILE]
    python tools/bench_copy_methods.py --quick        # tiny sizes, runs on the CPU device
    python tools/bench_copy_methods.py --variants staged,kernel:8   # kvflow on other paths too

Methods, each driven the way an engine's scheduler drives copies (a step's blocks handed over at
once, at most two steps in flight, the caller spinning until a step is over):

* ``kvflow``: ``TorchExecutor`` with its defaults, a step's blocks as jobs of 32 blocks, the
  caller polling for their results;
* ``cuMemcpyBatchAsync``: one driver call per step and direction holding every page of the
  step (the entry point found through cuda-bindings; a store reads the device in stream order,
  a load reads the host in any order), on a host pool laid out layer by layer;
* ``copy_ loop``: one ``copy_(non_blocking=True)`` per page of every block, same pool;
* ``contiguous``: one copy of the whole run per direction, the link's ceiling.

Geometries: Llama-3-8B's KV in bf16 at 16 tokens a block, as 64 per-layer pages of 32 KiB
(``per-layer``) and as one 2 MiB page per block (``blocks``); blocks and slots are drawn at
random (fixed seed). Directions: store, load, both at once. For each: GB/s (median of
``--reps``), the fraction of the contiguous copy in the same direction, and the slowdown of a
concurrent bf16 decode step (the matmuls of Llama-3-8B's 32 layers for a batch of 64 tokens,
one CUDA graph per step) while the method copies, from interleaved pairs of decode runs without
and with the copies. On the CPU device (``--quick``) the CUDA-only method and the decode
slowdown read ``n/a``.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvflow.core.jobs import LOAD, STORE, TransferJob  # noqa: E402
from kvflow.executors.torch.executor import TorchExecutor  # noqa: E402
from kvflow.executors.torch.host_pool import HostPool  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
JOB_BLOCKS = 32  # blocks per kvflow job (a request's share of a step)
DEPTH = 2  # steps in flight at once
CU_ORDER_STREAM, CU_ORDER_ANY = 1, 3  # CUmemcpySrcAccessOrder


@dataclass(frozen=True)
class Geometry:
    name: str
    regions: int  # pages per block
    page_bytes: int

    @property
    def block_bytes(self) -> int:
        return self.regions * self.page_bytes


@dataclass(frozen=True)
class Step:
    """One step's pairs: stores (device block -> slot) and loads (slot -> device block)."""

    store: tuple[np.ndarray, np.ndarray] | None
    load: tuple[np.ndarray, np.ndarray] | None

    @property
    def blocks(self) -> int:
        return sum(len(p[0]) for p in (self.store, self.load) if p is not None)


@dataclass
class Rig:
    """The device KV, the two host pools and the streams every method uses."""

    geometry: Geometry
    device: torch.device
    kv: list[torch.Tensor]  # per region [num_blocks, page words] bf16
    pool: HostPool  # layer by layer (the other methods' host cache)
    streams: dict[str, Any]  # store / load (None on the CPU device)

    @property
    def cpu_blocks(self) -> int:
        return self.pool.cpu_blocks


def build_rig(geometry: Geometry, blocks: int, device: torch.device) -> Rig:
    words = geometry.page_bytes // 2
    gen = torch.Generator(device=device).manual_seed(0)
    kv = [
        torch.empty((blocks, words), dtype=torch.bfloat16, device=device).normal_(generator=gen)
        for _ in range(geometry.regions)
    ]
    pool = HostPool.create([geometry.page_bytes] * geometry.regions, blocks, device=device)
    cuda = device.type == "cuda"
    streams = {d: torch.cuda.Stream(device=device) if cuda else None for d in (STORE, LOAD)}
    return Rig(geometry, device, kv, pool, streams)


def plan_steps(rig: Rig, run_blocks: int, step_blocks: int, what: str, seed: int) -> list[Step]:
    """``run_blocks`` blocks per direction in steps of ``step_blocks``: stores from one half
    of the device blocks into one half of the slots, loads from the other halves."""
    rng = np.random.default_rng(seed)
    n = rig.cpu_blocks
    dev, slots = rng.permutation(n), rng.permutation(n)
    half = n // 2
    pairs = {
        STORE: (dev[:half][:run_blocks], slots[:half][:run_blocks]),
        LOAD: (slots[half:][:run_blocks], dev[half:][:run_blocks]),  # (slot, device block)
    }
    steps = []
    for a in range(0, run_blocks, step_blocks):
        part = {d: (p[0][a : a + step_blocks], p[1][a : a + step_blocks]) for d, p in pairs.items()}
        steps.append(Step(
            part[STORE] if what in ("store", "both") else None,
            part[LOAD] if what in ("load", "both") else None,
        ))
    return steps


class Method:
    name = ""
    unavailable: str | None = None  # why this method cannot run here
    host: list[torch.Tensor] | None = None  # per region, the host pages the method copies to

    def launch(self, step: Step) -> Any:
        raise NotImplementedError

    def over(self, handle: Any) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _events(rig: Rig, directions: Sequence[str]) -> list[Any]:
    out = []
    for d in directions:
        stream = rig.streams[d]
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
            out.append(event)
    return out


def _done(events: list[Any]) -> bool:
    return all(e.query() for e in events)


class KvflowMethod(Method):
    """``scatter`` and ``programs``: the executor's (``auto`` and 0: its defaults)."""

    def __init__(self, rig: Rig, *, scatter: str = "auto", programs: int = 0) -> None:
        extra = [w for w, on in ((scatter, scatter != "auto"), (f"{programs} programs", programs)) if on]
        self.name = "kvflow" + (f" ({', '.join(extra)})" if extra else "")
        self.ex = TorchExecutor(
            rig.kv, rig.cpu_blocks, block_dim=0, scatter=scatter,  # type: ignore[arg-type]
            copy_programs=programs,
        )
        self.host = [self.ex.pool.region(r, torch.bfloat16) for r in range(rig.geometry.regions)]
        self.next_id = 0
        self.finished: set[int] = set()

    def launch(self, step: Step) -> Any:
        jobs = []
        for direction, pairs in ((STORE, step.store), (LOAD, step.load)):
            if pairs is None:
                continue
            src, dst = pairs
            blocks, slots = (src, dst) if direction == STORE else (dst, src)
            for a in range(0, len(blocks), JOB_BLOCKS):
                self.next_id += 1
                jobs.append(TransferJob(
                    self.next_id, direction,
                    tuple(int(b) for b in blocks[a : a + JOB_BLOCKS]),
                    tuple(int(s) for s in slots[a : a + JOB_BLOCKS]),
                ))
        self.ex.submit(jobs)
        return {j.job_id for j in jobs}

    def over(self, handle: Any) -> bool:
        for r in self.ex.poll():
            if not r.ok:
                raise RuntimeError(f"kvflow job {r.job_id} failed: {r.error}")
            self.finished.add(r.job_id)
        if handle <= self.finished:
            self.finished -= handle
            return True
        return False

    def close(self) -> None:
        self.ex.close()


def _batch_entry() -> tuple[Any, str | None]:
    """The driver's cuMemcpyBatchAsync (12.8 ABI, with failIdx) found through cuda-bindings,
    or (None, why not)."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        return None, f"n/a (no cuda-bindings: {e})"
    err, pfn, _ = driver.cuGetProcAddress(b"cuMemcpyBatchAsync", 12080, 0)
    if err != driver.CUresult.CUDA_SUCCESS or not pfn:
        return None, f"n/a (driver without cuMemcpyBatchAsync: {err})"
    proto = ctypes.CFUNCTYPE(
        ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p,
    )
    return proto(int(pfn)), None


class _Attrs(ctypes.Structure):
    _fields_ = [
        ("order", ctypes.c_uint), ("src_type", ctypes.c_uint), ("src_id", ctypes.c_int),
        ("dst_type", ctypes.c_uint), ("dst_id", ctypes.c_int), ("flags", ctypes.c_uint),
    ]


class BatchMethod(Method):
    name = "cuMemcpyBatchAsync"

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        if rig.device.type != "cuda":
            self.unavailable = "n/a (CUDA only)"
            return
        self.fn, self.unavailable = _batch_entry()
        self.host = [rig.pool.region(r, torch.bfloat16) for r in range(rig.geometry.regions)]
        host = [rig.pool.region(r) for r in range(rig.geometry.regions)]
        self.dev_base = np.array([t.data_ptr() for t in rig.kv], dtype=np.uint64)[:, None]
        self.host_base = np.array([t.data_ptr() for t in host], dtype=np.uint64)[:, None]
        self.dev_stride = np.array([t.stride(0) * t.element_size() for t in rig.kv], dtype=np.uint64)[:, None]
        self.host_stride = np.array([t.stride(0) for t in host], dtype=np.uint64)[:, None]
        self.page = np.uint64(rig.geometry.page_bytes)
        self.attrs = {d: _Attrs(CU_ORDER_STREAM if d == STORE else CU_ORDER_ANY, 0, 0, 0, 0, 0) for d in (STORE, LOAD)}
        self.keep: deque[Any] = deque(maxlen=4 * DEPTH)

    def _call(self, direction: str, pairs: tuple[np.ndarray, np.ndarray]) -> None:
        src, dst = pairs
        if direction == STORE:
            s = self.dev_base + src.astype(np.uint64)[None, :] * self.dev_stride
            d = self.host_base + dst.astype(np.uint64)[None, :] * self.host_stride
        else:
            s = self.host_base + src.astype(np.uint64)[None, :] * self.host_stride
            d = self.dev_base + dst.astype(np.uint64)[None, :] * self.dev_stride
        s, d = s.ravel(), d.ravel()
        sizes = np.full(len(s), self.page, dtype=np.uint64)
        index, failed = ctypes.c_size_t(0), ctypes.c_size_t(0)
        rc = self.fn(
            d.ctypes.data, s.ctypes.data, sizes.ctypes.data, len(s),
            ctypes.byref(self.attrs[direction]), ctypes.byref(index), 1, ctypes.byref(failed),
            self.rig.streams[direction].cuda_stream,
        )
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync returned {rc} at copy {failed.value}")
        self.keep.append((s, d, sizes))

    def launch(self, step: Step) -> Any:
        used = []
        for direction, pairs in ((STORE, step.store), (LOAD, step.load)):
            if pairs is not None:
                self._call(direction, pairs)
                used.append(direction)
        return _events(self.rig, used)

    def over(self, handle: Any) -> bool:
        return _done(handle)


class CopyLoopMethod(Method):
    name = "copy_ loop"

    def __init__(self, rig: Rig) -> None:
        self.rig = rig
        self.host = [rig.pool.region(r, torch.bfloat16) for r in range(rig.geometry.regions)]

    def launch(self, step: Step) -> Any:
        used = []
        for direction, pairs in ((STORE, step.store), (LOAD, step.load)):
            if pairs is None:
                continue
            used.append(direction)
            stream = self.rig.streams[direction]
            with torch.cuda.stream(stream) if stream is not None else _nothing():
                for a, b in zip(pairs[0].tolist(), pairs[1].tolist(), strict=True):
                    for dev, host in zip(self.rig.kv, self.host, strict=True):
                        if direction == STORE:
                            host[b].copy_(dev[a], non_blocking=True)
                        else:
                            dev[b].copy_(host[a], non_blocking=True)
        return _events(self.rig, used)

    def over(self, handle: Any) -> bool:
        return _done(handle)


class ContiguousMethod(Method):
    """One copy of the run's bytes per direction (the plan's pairs are ignored)."""

    name = "contiguous"

    def __init__(self, rig: Rig, nbytes: int) -> None:
        self.rig = rig
        pin = rig.device.type == "cuda"
        self.host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
        self.dev = {d: torch.empty(nbytes, dtype=torch.uint8, device=rig.device) for d in (STORE, LOAD)}

    def launch(self, step: Step) -> Any:
        used = []
        for direction, pairs in ((STORE, step.store), (LOAD, step.load)):
            if pairs is None:
                continue
            used.append(direction)
            stream = self.rig.streams[direction]
            with torch.cuda.stream(stream) if stream is not None else _nothing():
                if direction == STORE:
                    self.host_out.copy_(self.dev[STORE], non_blocking=True)
                else:
                    self.dev[LOAD].copy_(self.host_in, non_blocking=True)
        return _events(self.rig, used)

    def over(self, handle: Any) -> bool:
        return _done(handle)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def drive(method: Method, steps: Sequence[Step]) -> float:
    """Seconds to run ``steps``, at most ``DEPTH`` in flight, the caller spinning."""
    inflight: deque[Any] = deque()
    t0 = time.perf_counter()
    i = 0
    while i < len(steps) or inflight:
        if i < len(steps) and len(inflight) < DEPTH:
            inflight.append(method.launch(steps[i]))
            i += 1
        elif method.over(inflight[0]):
            inflight.popleft()
    return time.perf_counter() - t0


def check(method: Method, rig: Rig, step: Step) -> str:
    """Whether ``step``'s pages landed where they should (after it ran): "yes" or what differs."""
    if method.host is None:
        return "-"
    sync(rig.device)
    for r, (dev, host) in enumerate(zip(rig.kv, method.host, strict=True)):
        for direction, pairs in ((STORE, step.store), (LOAD, step.load)):
            if pairs is None:
                continue
            src, dst = (torch.from_numpy(a.astype(np.int64)) for a in pairs)
            if direction == STORE:
                a, b = host[dst].cpu(), dev[src.to(dev.device)].cpu()
            else:
                a, b = dev[dst.to(dev.device)].cpu(), host[src].cpu()
            # bit for bit: a slot never written holds whatever was there, NaN patterns too
            same = torch.equal(a.view(torch.int16), b.view(torch.int16))
            if not same:
                return f"{direction} pages of region {r} differ"
    return "yes"


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Decode:
    """A bf16 decode step of Llama-3-8B's shape (32 layers: qkv, o, gate+up, down) for a batch
    of 64 tokens, captured once as a CUDA graph; four layers' weights, reused in turn."""

    def __init__(self, device: torch.device, batch: int = 64, layers: int = 32) -> None:
        d, kv, ffn = 4096, 1024, 14336
        gen = torch.Generator(device=device).manual_seed(1)

        def w(rows: int, cols: int) -> torch.Tensor:
            t = torch.empty((rows, cols), dtype=torch.bfloat16, device=device)
            return t.normal_(0.0, rows ** -0.5, generator=gen)

        weights = [(w(d, d + 2 * kv), w(d, d), w(d, 2 * ffn), w(ffn, d)) for _ in range(4)]
        self.x = torch.randn((batch, d), dtype=torch.bfloat16, device=device)
        self.graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._step(weights, layers)  # (warm-up: the kernels' choices)
        torch.cuda.current_stream(device).wait_stream(side)
        with torch.cuda.graph(self.graph):
            self.out = self._step(weights, layers)
        torch.cuda.synchronize(device)
        self.step_s = self.run(20)

    def _step(self, weights: list[tuple[torch.Tensor, ...]], layers: int) -> torch.Tensor:
        h = self.x
        for i in range(layers):
            wqkv, wo, w13, w2 = weights[i % len(weights)]
            a = (h @ wqkv)[:, : h.shape[1]]
            h = h + a @ wo
            gate, up = (h @ w13).chunk(2, dim=-1)
            h = h + (torch.nn.functional.silu(gate) * up) @ w2
            h = h * 0.5  # (keeps the values bounded step after step)
        return h

    def start(self, steps: int) -> tuple[Any, Any]:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(steps):
            self.graph.replay()
        end.record()
        return begin, end

    def run(self, steps: int) -> float:
        begin, end = self.start(steps)
        end.synchronize()
        return begin.elapsed_time(end) / 1e3 / steps


def decode_slowdown(decode: Decode, method: Method, steps: Sequence[Step], pairs: int, seconds: float) -> tuple[float, float, float]:
    """(median, min, max) over ``pairs`` of the decode's slowdown while ``method`` copies
    without pause, each pair a decode run alone then one with the copies (alternating which
    goes first)."""
    n = max(10, int(seconds / decode.step_s))
    ratios = []
    for k in range(pairs):
        alone = with_copies = 0.0
        for loaded in ((False, True) if k % 2 == 0 else (True, False)):
            begin, end = decode.start(n)
            if loaded:
                while not end.query():
                    drive(method, steps)
            end.synchronize()
            spent = begin.elapsed_time(end) / 1e3
            if loaded:
                with_copies = spent
            else:
                alone = spent
        ratios.append(with_copies / alone - 1)
        sync(decode.x.device)
    return statistics.median(ratios), min(ratios), max(ratios)


@dataclass
class Row:
    geometry: str
    what: str
    method: str
    gbps: float | None
    fraction: float | None
    slowdown: tuple[float, float, float] | None
    checked: str = "-"
    note: str = ""


def measure(
    device: torch.device, geometries: Sequence[Geometry], run_bytes: int, step_blocks: int,
    reps: int, decode_pairs: int, decode_s: float, say: Callable[[str], None],
    variants: Sequence[tuple[str, int]] = (),
) -> list[Row]:
    rows: list[Row] = []
    decode = Decode(device) if device.type == "cuda" else None
    if decode is not None:
        say(f"decode step alone: {decode.step_s * 1e3:.2f} ms")
    for geo in geometries:
        run_blocks = max(1, run_bytes // geo.block_bytes)
        rig = build_rig(geo, 2 * run_blocks, device)
        methods: list[Method] = [
            ContiguousMethod(rig, run_blocks * geo.block_bytes),
            KvflowMethod(rig),
            *(KvflowMethod(rig, scatter=scatter, programs=programs) for scatter, programs in variants),
            BatchMethod(rig), CopyLoopMethod(rig),
        ]
        ceiling: dict[str, float] = {}
        for what in ("store", "load", "both"):
            steps = plan_steps(rig, run_blocks, step_blocks, what, seed=7)
            moved = sum(s.blocks for s in steps) * geo.block_bytes
            every = (np.arange(run_blocks), np.arange(run_blocks))
            whole = Step(every if what != "load" else None, every if what != "store" else None)
            for method in methods:
                if method.unavailable is not None:
                    rows.append(Row(geo.name, what, method.name, None, None, None, "-", method.unavailable))
                    say(format_row(rows[-1]))
                    continue
                plan = [whole] if isinstance(method, ContiguousMethod) else steps
                drive(method, plan)  # warm-up
                checked = check(method, rig, plan[-1])
                times = []
                for _ in range(reps):
                    sync(device)
                    times.append(drive(method, plan))
                gbps = moved / statistics.median(times) / 1e9
                if isinstance(method, ContiguousMethod):
                    ceiling[what] = gbps
                slow = None
                if decode is not None:
                    slow = decode_slowdown(decode, method, plan, decode_pairs, decode_s)
                row = Row(geo.name, what, method.name, gbps, gbps / ceiling[what], slow, checked)
                rows.append(row)
                say(format_row(row))
        for method in methods:
            method.close()
        rig.pool.close()
        del rig, methods
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def format_row(row: Row) -> str:
    gbps = "n/a" if row.gbps is None else f"{row.gbps:.1f}" if row.gbps >= 1 else f"{row.gbps:.2g}"
    frac = "n/a" if row.fraction is None else (
        f"{row.fraction:.2f}" if row.fraction >= 0.1 else f"{row.fraction:.2g}"
    )
    if row.slowdown is None:
        slow = "n/a"
    else:
        med, lo, hi = row.slowdown
        slow = f"{med * 100:+.1f}% ({lo * 100:+.1f} to {hi * 100:+.1f})"
    note = f" {row.note}" if row.note else ""
    return (f"| {row.geometry} | {row.what} | {row.method}{note} | {gbps} | {frac} | {slow} | "
            f"{row.checked} |")


def variant_list(text: str) -> list[tuple[str, int]]:
    """``staged,kernel:8`` -> [("staged", 0), ("kernel", 8)]."""
    out = []
    for part in text.split(","):
        scatter, _, programs = part.strip().partition(":")
        if scatter not in ("runs", "host", "uva", "kernel", "batch", "staged"):
            raise argparse.ArgumentTypeError(f"unknown scatter {scatter!r} in {part!r}")
        if programs and not programs.isdigit():
            raise argparse.ArgumentTypeError(f"programs must be a count, not {programs!r}")
        out.append((scatter, int(programs or 0)))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny sizes on the CPU device")
    ap.add_argument("--device", default=None)
    ap.add_argument("--gib", type=float, default=1.0, help="GiB per direction per run")
    ap.add_argument("--step-blocks", type=int, default=128, help="blocks per step and direction")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-pairs", type=int, default=5)
    ap.add_argument("--decode-s", type=float, default=0.3, help="seconds of decode per run")
    ap.add_argument("--variants", type=variant_list, default=(), metavar="SCATTER[:PROGRAMS],...",
                    help="also kvflow with these scatter modes and page-kernel programs, "
                         "e.g. staged,kernel:8")
    ap.add_argument("--out", default=None, help="also write the table here (markdown)")
    args = ap.parse_args(argv)
    device = torch.device(args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda"))
    if args.quick:
        geometries = [Geometry("per-layer 1 KiB", 8, 1 * KiB), Geometry("blocks 8 KiB", 1, 8 * KiB)]
        run_bytes, step_blocks = 256 * KiB, 8
    else:
        geometries = [Geometry("per-layer 32 KiB", 64, 32 * KiB), Geometry("blocks 2 MiB", 1, 2 * MiB)]
        run_bytes, step_blocks = int(args.gib * GiB), args.step_blocks
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    say(f"device {name}, torch {torch.__version__}; {run_bytes / GiB:.3g} GiB per direction per run, "
        f"steps of {step_blocks} blocks, {DEPTH} in flight")
    say("| geometry | direction | method | GB/s | of contiguous | decode slowdown, median (min to max) "
        "| pages checked |")
    say("|---|---|---|---:|---:|---|---|")
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)  # (a pool of threads per small copy times the pool, not the copy)
    try:
        measure(device, geometries, run_bytes, step_blocks, args.reps, args.decode_pairs,
                args.decode_s, say, args.variants)
    finally:
        torch.set_num_threads(threads)
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
