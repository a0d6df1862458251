"""Kill a disk-tier writer at random points and prove that a restart never serves a wrong entry.

    python tools/crash_disk.py --kills 100 [--dir D] [--seed 0] [--slots 64] [--page-kib 32]
                               [--max-delay-ms 400]

A writer process opens a ``DiskEntryFile`` and stores batches of entries without end (overwriting
slots, forgetting some), each entry's payload made from its block hash by a fixed rule (a
seeded length of hash-derived bytes, zeros after). The parent SIGKILLs it after a random delay
(seeded: the same seed kills at the same offsets; where the writer then is depends on the
machine), reopens the directory, loads every entry the journal recovered and checks its bytes
against the rule: a load that answers "filled" with other bytes is served wrongly (must be 0); a
miss (a slot overwritten after its record) is only counted. Then the next writer continues in
the same directory, from the state the crash left.

Last line: ``crash_disk: kills N, restarts N, entries recovered <n>, served wrongly <n>``; the
exit status is 1 if any entry was served wrongly or a restart failed.
"""

from __future__ import annotations

import argparse
import hashlib
import mmap
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvflow.core.names import name_of  # noqa: E402
from kvflow.tiers.disk_file import DiskEntryFile  # noqa: E402
from kvflow.tiers.entry import NONE, EntryCodec, Layout  # noqa: E402


def layout_of(page_kib: int) -> Layout:
    return Layout(model="crash-disk", page_bytes=(page_kib * 1024, page_kib * 1024), block_tokens=16)


def codec_of(layout: Layout) -> EntryCodec:
    """Unkeyed entries: what a crash can do to a slot, the checksum finds as well as a tag."""
    return EntryCodec(layout, None, NONE)


def payload_of(block_hash: int, size: int) -> bytes:
    """The rule: a length between 1 and ``size`` drawn from the hash, hash-derived bytes, zeros."""
    seed = hashlib.blake2b(block_hash.to_bytes(16, "little", signed=True), digest_size=8).digest()
    length = 1 + int.from_bytes(seed, "little") % size
    return hashlib.shake_128(seed).digest(length) + bytes(size - length)


class HostPages:
    """One page-aligned host slot (what the host pool hands the tier)."""

    def __init__(self, layout: Layout) -> None:
        self.buf = mmap.mmap(-1, layout.payload_bytes)
        view = memoryview(self.buf)
        self.pages, at = [], 0
        for size in layout.page_bytes:
            self.pages.append(view[at : at + size])
            at += size

    def put(self, data: bytes) -> list[memoryview]:
        self.buf[:] = data
        return self.pages


def writer(directory: str, slots: int, page_kib: int, seed: int) -> None:
    layout = layout_of(page_kib)
    tier = DiskEntryFile(directory, codec=codec_of(layout), slots=slots, io_threads=4)
    rng = random.Random(seed)
    hosts = [HostPages(layout) for _ in range(8)]
    print("ready", flush=True)
    counter = 0
    while True:
        if rng.random() < 0.15:
            tier.forget(rng.sample(range(slots), rng.randint(1, 4)))
            continue
        batch = []
        for slot, host in zip(rng.sample(range(slots), rng.randint(1, len(hosts))), hosts):
            counter += 1
            block_hash = (seed << 40) ^ counter ^ (rng.getrandbits(30) << 8)
            batch.append((slot, name_of(block_hash), host.put(payload_of(block_hash, layout.payload_bytes))))
        reasons = tier.store(batch)
        if any(reasons):
            print(f"store failed: {reasons}", file=sys.stderr, flush=True)
            sys.exit(3)


def check(directory: Path, slots: int, page_kib: int) -> tuple[str, int, int, Counter[str]]:
    """Reopen, load every recovered entry, compare with the rule: (note, recovered, wrong, misses)."""
    layout = layout_of(page_kib)
    host = HostPages(layout)
    wrong, misses = 0, Counter[str]()
    with DiskEntryFile(directory, codec=codec_of(layout), slots=slots, io_threads=4) as tier:
        for slot, name in tier.recovered:
            host.buf[:] = b"\xa5" * layout.payload_bytes
            [reason] = tier.load([(slot, name, host.pages)])
            if reason is not None:
                misses[reason] += 1
            elif bytes(host.buf) != payload_of(name.key, layout.payload_bytes):
                wrong += 1
        return tier.restart_note, len(tier.recovered), wrong, misses


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kills", type=int, default=100)
    parser.add_argument("--dir", type=Path, default=None, help="the tier's directory (default: a temporary one)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slots", type=int, default=64)
    parser.add_argument("--page-kib", type=int, default=32, help="two pages of this size per entry")
    parser.add_argument("--max-delay-ms", type=float, default=400.0, help="kill within this long of the writer being ready")
    parser.add_argument("--writer", nargs=2, type=int, metavar=("RUN", "SEED"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.kills < 1:
        parser.error("--kills must be at least 1")
    if args.dir is None:
        with tempfile.TemporaryDirectory(prefix="crash_disk.") as tmp:
            return run(args, Path(tmp) / "tier")
    return run(args, args.dir)


def run(args: argparse.Namespace, directory: Path) -> int:
    if args.writer is not None:
        writer(str(directory), args.slots, args.page_kib, args.writer[1])
        return 0
    rng = random.Random(args.seed)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    kills = restarts = recovered = wrong = warm = failed = 0
    misses: Counter[str] = Counter()
    before_ready = 0
    started = time.perf_counter()
    for run_no in range(args.kills):
        cmd = [sys.executable, __file__, "--dir", str(directory), "--slots", str(args.slots),
               "--page-kib", str(args.page_kib), "--writer", str(run_no), str(rng.getrandbits(20))]  # fmt: skip
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # one kill in eight lands while the writer opens (replaying, cutting, compacting)
        early = rng.random() < 0.125
        delay = rng.uniform(0, args.max_delay_ms) / 1000.0
        if early:
            time.sleep(rng.uniform(0.05, 0.6))
        else:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip() != "ready":
                proc.kill()
                print(f"writer {run_no} did not start: {line!r} {proc.communicate()[1][-2000:]}", file=sys.stderr)
                return 1
            time.sleep(delay)
        if proc.poll() is not None:
            print(f"writer {run_no} ended by itself ({proc.returncode}): {proc.communicate()[1][-2000:]}", file=sys.stderr)
            return 1
        os.kill(proc.pid, signal.SIGKILL)
        proc.communicate()
        kills += 1
        before_ready += early
        try:
            note, n, bad, missed = check(directory, args.slots, args.page_kib)
        except Exception as exc:  # a restart that fails is a failure of the tool's check
            print(f"restart {run_no + 1} failed: {type(exc).__name__}: {exc}", file=sys.stderr)
            failed += 1
            continue
        restarts += 1
        warm += note.startswith("warm")
        recovered += n
        wrong += bad
        misses.update(missed)
    seconds = time.perf_counter() - started
    rows = [
        ("kills (SIGKILL)", kills), ("  of them while the writer opened", before_ready),
        ("restarts", restarts), ("  warm (the journal replayed)", warm), ("  failed", failed),
        ("entries recovered (sum over restarts)", recovered),
        ("  loaded and checked", recovered - sum(misses.values()) - wrong),
        *((f"  missed: {reason}", count) for reason, count in sorted(misses.items())),
        ("served wrongly", wrong), ("seconds", round(seconds, 1)),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value:>8}")
    print(f"crash_disk: kills {kills}, restarts {restarts}, entries recovered {recovered}, served wrongly {wrong}")
    return 1 if wrong or failed else 0


if __name__ == "__main__":
    sys.exit(main())
