"""The disk tier on the GPU: time to first token with a 16k-token prefix brought from the disk
tier (disk -> host slots -> GPU) against recomputing it, in a model's real loop
(tools/ref_engine.py).

    python tools/bench_disk_gpu.py --dir DIR [--prefix 16384] [--repeat 3] [--io-threads 8]

Each repetition takes a fresh random prompt: the first turn computes it (time to first token,
recomputed) and stores its blocks to the CPU tier and, written through, to the disk tier in DIR
(a directory on the machine's local disk); the CPU tier and the device cache are then emptied,
so the prefix is on disk only. The second turn's lookup queues the disk load; the engine waits
for it (``arriving``), then loads the prefix from the CPU tier to the GPU as usual. Reported: the
disk stage (lookup until the blocks are host-resident), the GPU stage (time to first token from
the CPU tier) and their sum against recomputing, with the disk's read rate; and whether the
first tokens and the loaded KV are the computed ones.

Llama-3-8B's dimensions in bf16 with random weights from a fixed seed; 16-token blocks (2 MiB
over all 64 pages). Needs CUDA and the ``disk`` extra.
"""

from __future__ import annotations

import argparse
import os
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
from kvflow.tiers.disk_executor import disk_tier  # noqa: E402
from kvflow.tiers.keys import TierKeys  # noqa: E402

B = 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", required=True, help="the disk tier's directory, on the local disk")
    ap.add_argument("--prefix", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lines: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    model = ref.random_llama(ref.LLAMA3_8B, device="cuda", dtype=torch.bfloat16, seed=0)
    prefix_blocks = args.prefix // B
    kv = ref.PagedKV(model.dims, num_blocks=2 * prefix_blocks + 64, block_tokens=B, device=model.device, dtype=model.dtype)
    config = Config(
        cpu_blocks=prefix_blocks + 64,
        block_tokens=B,
        job_deadline_ms=120_000.0,
        disk_blocks=(args.repeat + 2) * (prefix_blocks + 1),
        disk_store_mode="write_through",
    )
    executor = TorchExecutor(kv.tensors(), config.cpu_blocks, block_dim=0, load_groups=model.dims.layers)
    keys = TierKeys([os.urandom(32)], "bench_disk_gpu's random key")  # (encrypted entries, as by default)
    tier = disk_tier(executor, config, args.dir, model="bench-llama3-8b-random-bf16", io_threads=args.io_threads, keys=keys)
    kvflow = SyncEngine(config, tier)
    engine = ref.RefEngine(model, kv, kvflow)
    say(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}; disk tier in {args.dir}: "
        f"{tier.disk.restart_note}; {'O_DIRECT' if tier.disk.direct else tier.disk.direct_note}")
    recomputed, disk_stage, gpu_stage, total = [], [], [], []
    identical, bitwise = True, True
    nbytes = 0
    for rep in range(args.repeat + 1):  # (the first warms up kernels, the pools and the file)
        g = torch.Generator().manual_seed(100 + rep)
        prompt = torch.randint(0, model.dims.vocab, (args.prefix + B // 2,), generator=g).tolist()
        hashes = ref.block_hashes(prompt, B)
        first, st1 = engine.generate(prompt, 2)  # recomputed; stored to the CPU tier and the disk
        kvflow.drain(timeout_ms=120_000)
        index = torch.tensor(engine.last_table[:prefix_blocks], device="cuda")
        snapshot = [t.index_select(0, index) for t in kv.tensors()]
        engine.forget_device_cache()
        kvflow.manager.evict(len(kvflow.manager.state.policy))  # the prefix is on disk only now
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        rid = f"disk-{rep}"
        kvflow.lookup(rid, hashes, len(prompt))
        kvflow.accept_hits(rid, [])
        while kvflow.has_live_jobs():  # the disk load: disk -> host slots
            kvflow.step()
            time.sleep(0.0002)
        t_disk = time.perf_counter() - t0
        kvflow.finish_request(rid)
        resident = sum(kvflow.manager.state.is_resident(h) for h in hashes[:prefix_blocks])
        second, st2 = engine.generate(prompt, 2)  # the CPU tier -> GPU, as for any hit
        kvflow.drain(timeout_ms=120_000)
        loaded = torch.tensor(engine.last_table[:prefix_blocks], device="cuda")
        same = all(torch.equal(a, t.index_select(0, loaded)) for a, t in zip(snapshot, kv.tensors()))
        del snapshot
        engine.forget_device_cache()
        kvflow.manager.evict(len(kvflow.manager.state.policy))
        if rep == 0:
            continue
        nbytes = resident * executor.layout.block_bytes
        recomputed.append(st1.ttft_s)
        disk_stage.append(t_disk)
        gpu_stage.append(st2.ttft_s)
        total.append(t_disk + st2.ttft_s)
        identical &= first == second
        bitwise &= same and st2.loaded_blocks == prefix_blocks == resident
    tc, td, tg, tt = (statistics.median(v) for v in (recomputed, disk_stage, gpu_stage, total))
    say(f"TTFT, {args.prefix}-token prefix (+{B // 2} new tokens), medians of {args.repeat}:")
    say(f"  recomputed                              {tc * 1e3:8.1f} ms")
    say(f"  from disk: disk -> host slots           {td * 1e3:8.1f} ms  ({nbytes / 2**30:.2f} GiB, {nbytes / td / 1e9:.2f} GB/s)")
    say(f"             host slots -> GPU, first token {tg * 1e3:8.1f} ms")
    say(f"             together                     {tt * 1e3:8.1f} ms  ratio {tt / tc:.3f}x of recomputing")
    say(f"  first tokens identical: {identical}; loaded KV bitwise equal to the computed KV: {bitwise}")
    kvflow.close()
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
