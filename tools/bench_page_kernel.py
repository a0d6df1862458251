#!/usr/bin/env python3
"""The page kernel alone (kvflow/executors/page_kernel.py), swept over its launch shape, and
both directions at once against the copy engines: what the executor's defaults are chosen from.

    python tools/bench_page_kernel.py [--page-kib 16] [--layers 32] [--mib 1024]

Random scattered slots and device blocks, every region of a batch in one launch; each figure is
the median of ``--reps`` runs, as a fraction of one contiguous pinned copy measured alongside.
Needs CUDA.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_transfer import Clock, bench_link, gbps  # noqa: E402

from kvflow.executors.torch import page_kernel  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page-kib", type=int, default=16)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device("cuda")
    clock = Clock(dev)
    page = args.page_kib << 10
    words = page // 8
    n = (args.mib << 20) // (page * args.layers)
    nb, cb = 2 * n, 2 * n
    kv = [torch.randint(-(2**62), 2**62, (nb, words), dtype=torch.int64, device=dev) for _ in range(args.layers)]
    pool = torch.empty((args.layers, cb, words), dtype=torch.int64, pin_memory=True)
    store_t, load_t = page_kernel.region_table(kv, [page] * args.layers, list(pool.unbind(0)), [page] * args.layers, dev)  # type: ignore[misc]
    blocks = torch.randperm(nb, device=dev)[:n]
    slots = torch.randperm(cb, device=dev)[:n]
    dst = torch.randperm(nb, device=dev)[:n]
    link = bench_link(dev, args.mib << 20, args.reps, clock)
    moved = n * page * args.layers
    print(f"{torch.cuda.get_device_name()}: {args.layers} regions x {n} pages of {args.page_kib} KiB "
          f"({moved / 2**30:.2f} GiB); link D2H {link['d2h']:.1f} H2D {link['h2d']:.1f} both {link['both']:.1f} GB/s")

    def timed(fn) -> float:  # type: ignore[no-untyped-def]
        fn()
        return statistics.median(clock.time_ms(fn) for _ in range(args.reps))

    for warps in (4, 8):
        for tile in (512, 1024, 2048):
            for programs in (16, 32, 64, 132, 264):
                kw = dict(programs=programs, tile=tile, num_warps=warps)
                s = timed(lambda: page_kernel.copy_pages(store_t, blocks, slots, words, **kw))  # noqa: B023
                ld = timed(lambda: page_kernel.copy_pages(load_t, slots, dst, words, **kw))  # noqa: B023
                print(f"  warps {warps} tile {tile:5d} programs {programs:4d}: store {gbps(moved, s) / link['d2h']:.2f}  "
                      f"load {gbps(moved, ld) / link['h2d']:.2f} of the link", flush=True)
    # the host's cost of one launch (what a submit pays on top of planning)
    import time

    for _ in range(3):
        page_kernel.copy_pages(store_t, blocks, slots, words)
    torch.cuda.synchronize()
    launches = []
    for _ in range(20):
        t0 = time.perf_counter()
        page_kernel.copy_pages(store_t, blocks[:64], slots[:64], words)
        launches.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    print(f"  host time of one launch: median {statistics.median(launches):.0f} us", flush=True)
    # both directions at once: kernel + kernel, and each kernel beside a copy-engine transfer
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    flat_dev = torch.empty(moved, dtype=torch.uint8, device=dev)
    flat_host = torch.empty(moved, dtype=torch.uint8, pin_memory=True)

    def both(a, b) -> None:  # type: ignore[no-untyped-def]
        cur = torch.cuda.current_stream()
        for s, fn in ((s1, a), (s2, b)):
            s.wait_stream(cur)
            with torch.cuda.stream(s):
                fn()
        cur.wait_stream(s1)
        cur.wait_stream(s2)

    for programs in (32, 132):
        st = lambda: page_kernel.copy_pages(store_t, blocks, slots, words, programs=programs)  # noqa: E731,B023
        ld = lambda: page_kernel.copy_pages(load_t, slots, dst, words, programs=programs)  # noqa: E731,B023
        dma_in = lambda: flat_dev.copy_(flat_host, non_blocking=True)  # noqa: E731
        dma_out = lambda: flat_host.copy_(flat_dev, non_blocking=True)  # noqa: E731
        for name, a, b in (("kernel store + kernel load", st, ld), ("kernel store + DMA in", st, dma_in),
                           ("DMA out + kernel load", dma_out, ld), ("DMA out + DMA in", dma_out, dma_in)):
            t = timed(lambda: both(a, b))  # noqa: B023
            print(f"  both, programs {programs}: {name:<28} {gbps(2 * moved, t) / link['both']:.2f} of the bidirectional link", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
