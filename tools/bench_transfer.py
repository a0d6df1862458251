#!/usr/bin/env python3
"""Transfer benchmark: kvflow's executor against the link limit and a naive per-page loop.

One run prints, for ~1 GiB per measurement (median of ``--reps``):

* the link limit: one contiguous pinned copy D2H, H2D, and both directions at once;
* a naive loop of one ``copy_`` per page (what kvflow must never do);
* kvflow's ``TorchExecutor``: stores, loads and both overlapped, for per-layer pages of 16, 32 and
  64 KiB across 32 layers and for 2 MiB cross-layer blocks; slots contiguous (the fast path) and
  scattered (``host`` staging, and ``uva`` kernels on CUDA);
* the CPU time of ``submit`` for one step of 1,000 blocks × 32 layers (and × 64 regions).

Device throughput is timed with timing events: a start event recorded on the current stream is
passed as the executor's ``compute_done``; end events are recorded on the executor's streams.
"wall" is submit-to-result on the host (what the engine sees). On the CPU device (``--quick``
here) everything is wall time. The table at the end gives each figure and its ratio to the link.

    PYTHONPATH=. python3 tools/bench_transfer.py            # on the GPU
    PYTHONPATH=. python3 tools/bench_transfer.py --quick    # small, anywhere (CPU here)
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvflow.core.errors import ConfigError
from kvflow.core.jobs import TransferJob
from kvflow.executors.torch import batch_copy
from kvflow.executors.torch.executor import TorchExecutor

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_ids = itertools.count(1)


@dataclass
class Row:
    name: str
    value: float  # GB/s, or ms for CPU time rows
    unit: str = "GB/s"
    ref: float | None = None  # the link figure the ratio is taken against
    target: float | None = None  # minimum ratio (GB/s rows) or maximum ms (time rows)
    note: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.ref is None else self.value / self.ref

    @property
    def status(self) -> str:
        if self.target is None:
            return ""
        if self.unit == "ms":
            return "ok" if self.value <= self.target else "MISS"
        r = self.ratio
        return "" if r is None else ("ok" if r >= self.target else "MISS")


class Clock:
    """Device-time measurement through timing events (host clock on the CPU device)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.events = device.type != "cpu"
        self._cycles_per_ms: float | None = None

    def sync(self) -> None:
        if self.events:
            torch.accelerator.synchronize()

    def gate(self, ms: float) -> None:
        """Hold the current stream for about ``ms`` (CUDA): an event recorded after this fires
        only once the host has had that long to enqueue the work that waits on it, so the time
        from that event to the copies' end is the device's copy time, not the host's submit
        time (which the tables report on their own)."""
        if self.device.type != "cuda" or ms <= 0:
            return
        if self._cycles_per_ms is None:  # calibrate the sleep kernel once
            torch.cuda._sleep(1_000_000)
            start = self.event()
            torch.cuda._sleep(20_000_000)
            end = self.event()
            end.synchronize()  # type: ignore[union-attr]
            self._cycles_per_ms = 20_000_000 / start.elapsed_time(end)  # type: ignore[union-attr]
        torch.cuda._sleep(int(ms * self._cycles_per_ms))

    def event(self, stream: object | None = None) -> object | None:
        if not self.events:
            return None
        e = torch.Event(device=self.device, enable_timing=True)
        e.record(stream if stream is not None else torch.accelerator.current_stream())
        return e

    def time_ms(self, fn: Callable[[], None]) -> float:
        self.sync()
        if not self.events:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start = self.event()
        fn()
        end = self.event()
        end.synchronize()  # type: ignore[union-attr]
        return start.elapsed_time(end)  # type: ignore[union-attr]


def gbps(nbytes: int, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def pinned(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type != "cpu")


def random_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.randint(-(2**62), 2**62, (nbytes // 8,), dtype=torch.int64, device=device).view(
        torch.uint8
    )


# --- the link and the naive loop -----------------------------------------------------------


def bench_link(device: torch.device, nbytes: int, reps: int, clock: Clock) -> dict[str, float]:
    dev_a, dev_b = random_bytes(nbytes, device), random_bytes(nbytes, device)
    host_a, host_b = pinned(nbytes, device), pinned(nbytes, device)
    host_b.copy_(dev_b.cpu() if device.type != "cpu" else dev_b)
    streams = None
    if device.type != "cpu":
        streams = (torch.Stream(device=device), torch.Stream(device=device))

    def d2h() -> None:
        host_a.copy_(dev_a, non_blocking=True)

    def h2d() -> None:
        dev_b.copy_(host_b, non_blocking=True)

    def both() -> None:
        if streams is None:
            d2h()
            h2d()
            return
        cur = torch.accelerator.current_stream()
        for s, fn in zip(streams, (d2h, h2d), strict=True):
            s.wait_stream(cur)
            with s:
                fn()
        for s in streams:
            cur.wait_stream(s)

    out = {}
    for name, fn, moved in (("d2h", d2h, nbytes), ("h2d", h2d, nbytes), ("both", both, 2 * nbytes)):
        fn()
        out[name] = gbps(moved, median([clock.time_ms(fn) for _ in range(reps)]))
    assert torch.equal(host_a[:4096], dev_a[:4096].cpu()), "link copy check failed"
    return out


def bench_naive(
    device: torch.device, page: int, nbytes: int, reps: int, clock: Clock
) -> dict[str, float]:
    n = nbytes // page
    dev = random_bytes(n * page, device).view(n, page)
    host = pinned(n * page, device).view(n, page)
    rows_dev, rows_host = list(dev.unbind(0)), list(host.unbind(0))

    def d2h() -> None:
        for h, d in zip(rows_host, rows_dev, strict=True):
            h.copy_(d, non_blocking=True)

    def h2d() -> None:
        for h, d in zip(rows_host, rows_dev, strict=True):
            d.copy_(h, non_blocking=True)

    out = {
        name: gbps(n * page, median([clock.time_ms(fn) for _ in range(reps)]))
        for name, fn in (("d2h", d2h), ("h2d", h2d))
    }
    return out


# --- kvflow ----------------------------------------------------------------------------------


def make_kv(
    device: torch.device, layers: int, page: int, num_blocks: int, stacked: bool
) -> list[torch.Tensor]:
    """Per-layer KV tensors of random bf16 data: ``[N, page]`` or stacked ``[2, N, page/2]``."""
    elems = page // 2
    shape = (2, num_blocks, 16, elems // 32) if stacked else (num_blocks, 16, elems // 16)
    return [torch.randn(shape, device=device, dtype=torch.bfloat16) for _ in range(layers)]


def timed_submit(
    ex: TorchExecutor, jobs: list[TransferJob], clock: Clock
) -> tuple[float, float, float]:
    """(device ms, wall ms, submit CPU ms) of one submit, all results checked ok."""
    clock.sync()
    start = clock.event()
    t0 = time.perf_counter()
    ex.submit(jobs, compute_done=start)
    t_submit = time.perf_counter() - t0
    ends = [clock.event(ex.stream(d)) for d in sorted({j.direction for j in jobs})]
    for j in jobs:
        r = ex.wait(j.job_id, timeout_s=120)
        if not r.ok:
            raise RuntimeError(f"job {j.job_id} failed: {r.error}")
    wall = (time.perf_counter() - t0) * 1e3
    if start is None:
        return wall, wall, t_submit * 1e3
    dev = max(start.elapsed_time(e) for e in ends)  # type: ignore[union-attr]
    return dev, wall, t_submit * 1e3


def same_pages(ex: TorchExecutor, a: np.ndarray, b: np.ndarray) -> bool:
    ia = torch.from_numpy(a).to(ex.device)
    ib = torch.from_numpy(b).to(ex.device)
    return all(
        torch.equal(r.pages.index_select(0, ia), r.pages.index_select(0, ib))
        for r in ex.layout.regions
    )


def bench_kvflow(
    device: torch.device,
    label: str,
    layers: int,
    page: int,
    nbytes: int,
    reps: int,
    clock: Clock,
    scatter_modes: list[str],
    rng: np.random.Generator,
) -> dict[str, tuple[float, float]]:
    """GB/s (device-timed, wall) per mode for one layout; every mode's data is verified once."""
    block = layers * page
    n = max(1, nbytes // block)
    num_blocks = 3 * n + 8
    kv = make_kv(device, layers, page, num_blocks, stacked=False)
    results: dict[str, tuple[float, float]] = {}
    ex = TorchExecutor(kv, 2 * n)
    try:

        def one(
            mode: str,
            make_jobs: Callable[[], tuple[list[TransferJob], Callable[[], bool]]],
            moved: int,
        ) -> None:
            devs, walls = [], []
            try:
                for rep in range(reps + 1):  # the first run warms up and is verified
                    jobs, check = make_jobs()
                    d, w, _ = timed_submit(ex, jobs, clock)
                    if rep == 0:
                        if not check():
                            raise RuntimeError(
                                "data check failed: loaded pages differ from stored ones"
                            )
                        continue
                    devs.append(d)
                    walls.append(w)
            except Exception as e:  # one broken mode must not cost the rest of a GPU run
                print(f"  {label:<26} {mode:<16} FAILED: {type(e).__name__}: {e}", flush=True)
                results[mode] = (float("nan"), float("nan"))
                return
            results[mode] = (gbps(moved, median(devs)), gbps(moved, median(walls)))
            print(
                f"  {label:<26} {mode:<16} {results[mode][0]:7.1f} GB/s "
                f"(wall {results[mode][1]:6.1f})",
                flush=True,
            )

        contiguous = np.arange(n, dtype=np.int64)

        def store_load(
            slots: np.ndarray,
        ) -> Callable[[], tuple[list[TransferJob], Callable[[], bool]]]:
            state: dict[str, np.ndarray] = {}

            def store() -> tuple[list[TransferJob], Callable[[], bool]]:
                perm = rng.permutation(num_blocks)
                state["src"] = perm[:n]
                return [
                    TransferJob(
                        next(_ids), "store", tuple(perm[:n].tolist()), tuple(slots.tolist())
                    )
                ], lambda: True

            def load() -> tuple[list[TransferJob], Callable[[], bool]]:
                src = state["src"]
                rest = np.setdiff1d(np.arange(num_blocks), src)
                dst = rng.permutation(rest)[:n]
                job = TransferJob(next(_ids), "load", tuple(dst.tolist()), tuple(slots.tolist()))
                return [job], lambda: same_pages(ex, src, dst)

            return store, load

        store, load = store_load(contiguous)
        one("store", store, n * block)
        one("load", load, n * block)

        def both() -> tuple[list[TransferJob], Callable[[], bool]]:
            # slots [0, n) hold blocks a; store b -> slots [n, 2n) while loading [0, n) -> dst
            perm = rng.permutation(num_blocks)
            a, b, dst = perm[:n], perm[n : 2 * n], perm[2 * n : 3 * n]
            pre = TransferJob(next(_ids), "store", tuple(a.tolist()), tuple(range(n)))
            ex.submit([pre])
            assert ex.wait(pre.job_id, timeout_s=120).ok
            jobs = [
                TransferJob(next(_ids), "store", tuple(b.tolist()), tuple(range(n, 2 * n))),
                TransferJob(next(_ids), "load", tuple(dst.tolist()), tuple(range(n))),
            ]
            return jobs, lambda: same_pages(ex, a, dst)

        one("both", both, 2 * n * block)
        print(f"  {label}: the default path is {ex.scatter!r}", flush=True)
        # the same contiguous jobs through each other path (a fresh executor each: the pool's
        # layout follows the path)
        for variant, scatter in (("kernel", "kernel"), ("engines", "runs")):
            ex.close()
            try:
                ex = TorchExecutor(kv, 2 * n, scatter=scatter)  # type: ignore[arg-type]
            except ConfigError as e:
                print(f"  {label:<26} {variant:<16} unavailable: {e}", flush=True)
                ex = TorchExecutor(kv, 2 * n, scatter="runs")
                continue
            one(f"store {variant}", store, n * block)
            one(f"load {variant}", load, n * block)
            one(f"both {variant}", both, 2 * n * block)
        scattered = rng.permutation(2 * n)[:n].astype(np.int64)
        for mode in scatter_modes:
            ex.close()
            try:
                ex = TorchExecutor(kv, 2 * n, scatter=mode, max_runs=1)  # type: ignore[arg-type]
            except ConfigError as e:
                print(f"  {label:<26} {mode:<16} unavailable: {e}", flush=True)
                ex = TorchExecutor(kv, 2 * n, scatter="runs")
                for d in ("store", "load"):
                    results[f"{d} scat/{mode}"] = (float("nan"), float("nan"))
                continue
            s_store, s_load = store_load(scattered)
            one(f"store scat/{mode}", s_store, n * block)
            one(f"load scat/{mode}", s_load, n * block)
    finally:
        ex.close()
        del kv
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return results


def bench_submit_cpu(
    device: torch.device, regions: int, blocks: int, page: int, reps: int, clock: Clock
) -> dict[str, float]:
    """Median CPU ms of one ``submit`` of ``blocks`` blocks × ``regions`` regions: the default
    path with contiguous slots, then each other path with scattered slots."""
    stacked = regions % 2 == 0 and regions > 32
    layers = regions // 2 if stacked else regions
    num_blocks = 2 * blocks
    kv = make_kv(device, layers, page, num_blocks, stacked=stacked)
    rng = np.random.default_rng(1)
    out: dict[str, float] = {}
    variants = [("", "auto"), (" runs", "runs")]
    variants += [(" kernel", "kernel"), (" batch", "batch")] if device.type == "cuda" else []
    for variant, scatter in variants:
        try:
            ex = TorchExecutor(kv, 2 * blocks, scatter=scatter)  # type: ignore[arg-type]
        except ConfigError:
            continue
        assert ex.layout.num_regions == regions, ex.layout.num_regions
        times: dict[str, list[float]] = {"store": [], "load": []}
        try:
            for rep in range(reps + 2):
                for direction in ("store", "load"):
                    devb = rng.permutation(num_blocks)[:blocks]
                    slots = range(blocks)
                    if variant:  # the other paths: scattered slots
                        slots = rng.permutation(2 * blocks)[:blocks].tolist()
                    job = TransferJob(next(_ids), direction, tuple(devb.tolist()), tuple(slots))
                    _, _, cpu_ms = timed_submit(ex, [job], clock)
                    if rep >= 2:
                        times[direction].append(cpu_ms)
        finally:
            ex.close()
        for direction, values in times.items():
            out[f"{direction}{variant}"] = median(values)
    del kv
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--quick", action="store_true", help="small sizes (runs on CPU in seconds)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument(
        "--mib", type=int, default=None, help="bytes per measurement, MiB (default 1024)"
    )
    ap.add_argument("--out", default=None, help="also write the table as markdown to this file")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    quick = args.quick
    nbytes = (args.mib or (16 if quick else 1024)) * MiB
    reps = args.reps or (2 if quick else 5)
    layers = 4 if quick else 32
    pages = [16 * KiB, 64 * KiB] if quick else [16 * KiB, 32 * KiB, 64 * KiB]
    clock = Clock(device)
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else platform.processor() or "cpu"
    )
    header = (
        f"device: {device} ({name}); torch {torch.__version__}; "
        f"python {platform.python_version()}; "
        f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
        f"{nbytes // MiB} MiB per measurement, median of {reps}"
    )
    print(header, flush=True)
    rows: list[Row] = []
    rng = np.random.default_rng(0)

    link = bench_link(device, nbytes, reps, clock)
    print(
        f"  link: D2H {link['d2h']:.1f}  H2D {link['h2d']:.1f}  both {link['both']:.1f} GB/s",
        flush=True,
    )
    rows += [
        Row("link: one contiguous pinned copy D2H", link["d2h"], ref=link["d2h"]),
        Row("link: one contiguous pinned copy H2D", link["h2d"], ref=link["h2d"]),
        Row("link: both directions at once", link["both"], ref=link["both"]),
    ]
    naive_bytes = nbytes if not quick else nbytes // 4
    for page in pages:
        nv = bench_naive(device, page, naive_bytes, max(1, reps // 2), clock)
        print(
            f"  naive {page // KiB} KiB: D2H {nv['d2h']:.1f}  H2D {nv['h2d']:.1f} GB/s", flush=True
        )
        rows += [
            Row(f"naive copy_ per page {page // KiB} KiB D2H", nv["d2h"], ref=link["d2h"]),
            Row(f"naive copy_ per page {page // KiB} KiB H2D", nv["h2d"], ref=link["h2d"]),
        ]

    scatter_modes = ["host"] + (["uva", "kernel"] if device.type == "cuda" else [])
    scatter_modes += ["batch"] if batch_copy.available(device.type) else []
    configs = [(f"{page // KiB} KiB x {layers} layers", layers, page) for page in pages]
    configs.append(
        (
            "2 MiB cross-layer" if not quick else "256 KiB cross-layer",
            1,
            (256 * KiB if quick else 2 * MiB),
        )
    )
    for label, nl, page in configs:
        try:
            res = bench_kvflow(device, label, nl, page, nbytes, reps, clock, scatter_modes, rng)
        except Exception as e:  # keep the rest of the run
            print(f"  {label}: FAILED to set up: {type(e).__name__}: {e}", flush=True)
            continue
        small = page <= 16 * KiB and nl > 1
        target = 0.80 if small else 0.90
        rows += [
            Row(
                f"kvflow store {label}",
                res["store"][0],
                ref=link["d2h"],
                target=target,
                note=f"wall {res['store'][1]:.1f}",
            ),
            Row(
                f"kvflow load {label}",
                res["load"][0],
                ref=link["h2d"],
                target=target,
                note=f"wall {res['load'][1]:.1f}",
            ),
            Row(
                f"kvflow store+load overlapped {label}",
                res["both"][0],
                ref=link["both"],
                target=0.85,
                note=f"wall {res['both'][1]:.1f}",
            ),
        ]
        for variant, what in (("kernel", "through the page kernel"),
                              ("engines", "one copy per region (copy engines)")):
            for key, ref in (("store", link["d2h"]), ("load", link["h2d"]), ("both", link["both"])):
                if f"{key} {variant}" in res:
                    rows.append(
                        Row(
                            f"kvflow {key} {label}, contiguous slots {what}",
                            res[f"{key} {variant}"][0],
                            ref=ref,
                            note=f"wall {res[f'{key} {variant}'][1]:.1f}",
                        )
                    )
        for mode in scatter_modes:
            for d, ref in (("store", link["d2h"]), ("load", link["h2d"])):
                key = f"{d} scat/{mode}"
                rows.append(
                    Row(
                        f"kvflow {d} {label}, scattered slots ({mode})",
                        res[key][0],
                        ref=ref,
                        note=f"wall {res[key][1]:.1f}",
                    )
                )

    step_blocks = 100 if quick else 1000
    for regions in (4, 8) if quick else (32, 64):
        cpu = bench_submit_cpu(
            device, regions, step_blocks, 16 * KiB if not quick else 4 * KiB, reps, clock
        )
        for d in ("store", "load"):
            rows.append(
                Row(
                    f"submit CPU: {d} {step_blocks} blocks x {regions} regions, contiguous "
                    "slots, default path",
                    cpu[d],
                    unit="ms",
                    target=1.0,
                )
            )
            for variant, what in (
                ("runs", "one copy per region and run"),
                ("kernel", "page kernel"),
                ("batch", "batched copy engines per page"),
            ):
                if f"{d} {variant}" in cpu:
                    rows.append(
                        Row(
                            f"submit CPU: {d} {step_blocks} blocks x {regions} regions, "
                            f"scattered slots, {what}",
                            cpu[f"{d} {variant}"],
                            unit="ms",
                        )
                    )
        print(
            f"  submit CPU {regions} regions: store {cpu['store']:.3f} ms, "
            f"load {cpu['load']:.3f} ms",
            flush=True,
        )

    table = render(rows)
    print()
    print(header)
    print(table)
    if args.out:
        with open(args.out, "w") as f:
            f.write(
                f"# Transfer benchmark results\n\n{header}\n\n"
                f"Command: `{' '.join(sys.argv)}`\n\n{table}\n"
            )
    return 0


def render(rows: list[Row]) -> str:
    lines = [
        "| measurement | value | ratio to link | target | status | note |",
        "|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        value = f"{r.value:.3f} ms" if r.unit == "ms" else f"{r.value:.1f} GB/s"
        ratio = "" if r.ratio is None else f"{r.ratio:.2f}"
        if r.target is None:
            target = ""
        else:
            target = f"<= {r.target:.1f} ms" if r.unit == "ms" else f">= {r.target:.2f}"
        lines.append(f"| {r.name} | {value} | {ratio} | {target} | {r.status} | {r.note} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
