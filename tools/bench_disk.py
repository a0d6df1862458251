"""The disk tier against the disk itself: ``fio`` with O_DIRECT, then the tier's own stores and
loads of the same bytes, on the same file system, in one run (rounds interleave the two).

    python tools/bench_disk.py [--dir D] [--block-mib 2] [--total-mib 1024] [--io-threads 4]
                               [--batch 16] [--pages 2] [--repeat 5] [--mode encrypt]

``fio`` writes then reads a file of ``--total-mib`` in blocks of the tier's slot size (the
entry's header block and its payload), O_DIRECT, libaio at a queue depth of ``--io-threads``.
Then a ``DiskEntryFile`` with that many I/O threads stores the same amount in batches of
``--batch`` entries (each batch made durable, then journaled) from page-aligned host memory,
and loads it all back (every entry proven: header, full hash, tag; ``--mode`` encrypt, mac or none). ``--repeat`` rounds
of fio write, tier store, fio read, tier load; the table shows each side's best and the median
of the rounds' ratios (the last line's); MB/s count the bytes that reach the disk (whole slots)
on both sides.
The tier's first fill of its preallocated file is shown apart: it pays the file system's
conversion of unwritten extents, which fio's own file (laid out by its first write) pays too.

Needs ``fio`` (Debian/Ubuntu: ``apt-get install fio``). The last line is
``bench_disk: slot <KiB> KiB, queue depth <n>, store/fio <ratio>, load/fio <ratio>``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvflow.core.names import name_of  # noqa: E402
from kvflow.tiers.disk_file import DiskEntryFile, slot_bytes_of  # noqa: E402
from kvflow.tiers.entry import ENCRYPT, MAC, NONE, EntryCodec, Layout  # noqa: E402
from kvflow.tiers.keys import TierKeys  # noqa: E402


def fio(directory: Path, rw: str, block: int, total: int, depth: int) -> float:
    """Bytes per second of one fio job (O_DIRECT, libaio, ``depth`` in flight)."""
    out = subprocess.run(
        ["fio", "--name=bench_disk", f"--filename={directory / 'fio.dat'}", f"--rw={rw}", f"--bs={block}",
         f"--size={total}", "--direct=1", "--ioengine=libaio", f"--iodepth={depth}", "--numjobs=1",
         "--output-format=json"],
        capture_output=True, text=True, check=True, timeout=900,
    ).stdout  # fmt: skip
    job = json.loads(out[out.index("{") :])["jobs"][0]
    return float(job["write" if rw == "write" else "read"]["bw_bytes"])


def tier_pass(tier: DiskEntryFile, host: list[list[memoryview]], entries: int, batch: int, load: bool) -> float:
    """Bytes per second (whole slots) of storing or loading ``entries`` entries, ``batch`` per call."""
    call = tier.load if load else tier.store
    started = time.perf_counter()
    for first in range(0, entries, batch):
        slots = range(first, min(first + batch, entries))
        reasons = call([(s, name_of(1_000_003 * s + 7), host[s - first]) for s in slots])
        if any(reasons):
            raise SystemExit(f"bench_disk: the tier refused: {next(r for r in reasons if r)}")
    return entries * tier.slot_bytes / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, default=None, help="where the tier and fio's file go (default: a temporary directory in /var/tmp)")
    parser.add_argument("--block-mib", type=float, default=2.0, help="an entry's payload")
    parser.add_argument("--total-mib", type=int, default=1024)
    parser.add_argument("--io-threads", type=int, default=4, help="the tier's I/O threads = fio's queue depth")
    parser.add_argument("--batch", type=int, default=16, help="entries per store/load call")
    parser.add_argument("--pages", type=int, default=2, help="pages (host pool regions) per entry")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--mode", choices=(ENCRYPT, MAC, NONE), default=ENCRYPT,
                        help="how entries are sealed (a random key of this run's own)")  # fmt: skip
    args = parser.parse_args()
    if shutil.which("fio") is None:
        print("bench_disk: fio is not installed (Debian/Ubuntu: apt-get install fio)", file=sys.stderr)
        return 2
    payload = int(args.block_mib * (1 << 20))
    if payload % (4096 * args.pages):
        parser.error("--block-mib must split into --pages pages of whole 4 KiB")
    base = args.dir if args.dir is not None else Path(tempfile.mkdtemp(prefix="bench_disk.", dir="/var/tmp"))
    base.mkdir(parents=True, exist_ok=True)
    try:
        return run(args, base, payload)
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
        else:
            shutil.rmtree(base / "tier", ignore_errors=True)
            (base / "fio.dat").unlink(missing_ok=True)


def run(args: argparse.Namespace, base: Path, payload: int) -> int:
    layout = Layout(model="bench-disk", page_bytes=(payload // args.pages,) * args.pages, block_tokens=16)
    slot = slot_bytes_of(layout)
    entries = max(args.batch, (args.total_mib << 20) // slot)
    total = entries * slot
    memory = mmap.mmap(-1, args.batch * payload)  # page-aligned "host slots"
    memory[:] = os.urandom(1 << 20) * (len(memory) >> 20) + os.urandom(len(memory) % (1 << 20))
    view = memoryview(memory)
    page = payload // args.pages
    host = [[view[b * payload + p * page : b * payload + (p + 1) * page] for p in range(args.pages)]
            for b in range(args.batch)]  # fmt: skip
    keys = None if args.mode == NONE else TierKeys([os.urandom(32)], "bench_disk's random key")
    tier = DiskEntryFile(base / "tier", codec=EntryCodec(layout, keys, args.mode), slots=entries, io_threads=args.io_threads)
    rounds: list[tuple[float, float, float, float]] = []
    try:
        note = "O_DIRECT" if tier.direct else tier.direct_note
        first_fill = tier_pass(tier, host, entries, args.batch, load=False)
        fio(base, "write", slot, total, args.io_threads)  # fio's first write lays its file out
        for _ in range(args.repeat):  # interleaved: a shared disk's mood hits both sides alike
            rounds.append((
                fio(base, "write", slot, total, args.io_threads),
                tier_pass(tier, host, entries, args.batch, load=False),
                fio(base, "read", slot, total, args.io_threads),
                tier_pass(tier, host, entries, args.batch, load=True),
            ))  # fmt: skip
    finally:
        tier.close()
        del host, view
        memory.close()
    fio_w, store, fio_r, load = (max(r[i] for r in rounds) for i in range(4))
    store_ratio = statistics.median(r[1] / r[0] for r in rounds)
    load_ratio = statistics.median(r[3] / r[2] for r in rounds)

    mb = 1e6
    rows = [
        (f"fio (O_DIRECT, libaio, queue depth {args.io_threads})", fio_w / mb, fio_r / mb),
        (f"kvflow disk tier ({args.io_threads} I/O threads, batches of {args.batch}, {note}, {args.mode})", store / mb, load / mb),
        ("  its first fill of the preallocated file", first_fill / mb, float("nan")),
        ("tier / fio (best against best)", store / fio_w, load / fio_r),
        ("tier / fio (median of the rounds' ratios)", store_ratio, load_ratio),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"slot {slot // 1024} KiB ({payload / (1 << 20):g} MiB payload + header block), {entries} entries, "
          f"{total / (1 << 20):.0f} MiB, on {base}, {args.repeat} rounds")  # fmt: skip
    print(f"{'':<{width}}  {'write MB/s':>10}  {'read MB/s':>10}")
    for name, w, r in rows:
        fmt = "{:>10.2f}" if name.startswith("tier / fio") else "{:>10.0f}"
        print(f"{name:<{width}}  {fmt.format(w)}  {'' if r != r else fmt.format(r):>10}")
    print(f"bench_disk: slot {slot // 1024} KiB, queue depth {args.io_threads}, "
          f"store/fio {store_ratio:.2f}, load/fio {load_ratio:.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
