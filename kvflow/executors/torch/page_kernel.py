"""One kernel launch that copies a batch's pages of every KV region (Triton, through UVA).

The executor's other paths launch per region (a gather, then a copy or scatter): 32-64 launches
per batch, and with scattered slots the link sat at 0.59-0.85 of one contiguous copy. Here one
launch covers every region: a table holds each region's base address and block stride on both
sides (device cache and pinned pool, which kernels address directly through unified addressing),
and the kernel's programs walk the (region, pair) pages of the batch, each page in tiles of
``TILE`` 8-byte words. A fixed, small number of programs (``programs``) keeps enough bytes in
flight to fill the link while leaving most multiprocessors to the engine's compute (vLLM and
SGLang copy KV with a few SMs the same way).

The same kernel serves both directions: a store reads device pages and writes pool slots, a
load the reverse. ``first``/``count`` select a range of regions, so a load can be launched layer
by layer, each with its own event (``TorchExecutor(load_groups=...)``).

Needs Triton and 8-byte words on every region (``layout.py`` picks int64 words whenever page
size, stride and address allow: every real KV geometry). ``available`` says whether this process
can launch it; under ``TRITON_INTERPRET=1`` it runs on CPU tensors (how the tests check it
without a GPU).
"""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Sequence
from typing import Any

import torch

TILE = 1024  # int64 words per tile: 8 KiB, 8 words (four 16-byte accesses) per thread at 4 warps
DEFAULT_PROGRAMS = 0  # 0: one program per multiprocessor (see copy_pages)


def _triton() -> Any | None:
    """The triton module, or None where it is not installed (CPU-only installs, NPU hosts)."""
    try:
        triton = importlib.import_module("triton")
        importlib.import_module("triton.language")
    except ImportError:
        return None
    return triton


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU (``TRITON_INTERPRET=1``), as the tests do."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")


def available(device: torch.device) -> bool:
    """Can this process launch the page kernel on ``device``?"""
    if _triton() is None:
        return False
    if device.type == "cuda":
        return not interpreting()
    return device.type == "cpu" and interpreting()


@functools.cache
def _kernel(interpret: bool) -> Any:
    """The jitted kernel; built once per mode (Triton decides at decoration time whether a
    kernel is interpreted on the CPU, so both modes can live in one test process)."""
    del interpret  # the cache key
    triton = _triton()
    assert triton is not None
    tl = triton.language

    @triton.jit(do_not_specialize=["n_pairs", "first", "n_tiles", "tiles_per_page"])
    def copy_pages(
        table,  # int64 [5, R]: src base, src stride, dst base, dst stride (bytes), page words
        src_index,  # int64 [n]: source page of each pair (device block or slot)
        dst_index,  # int64 [n]: destination page of each pair
        n_pairs,
        first,  # first region of this launch
        n_tiles,  # count regions x n_pairs x tiles_per_page
        tiles_per_page,
        R,
        TILE: tl.constexpr,  # type: ignore[name-defined]
    ):
        pid = tl.program_id(0)
        step = tl.num_programs(0)
        offsets = tl.arange(0, TILE)
        t = pid
        while t < n_tiles:  # (a while loop: Triton's interpreter cannot range() over tensors)
            page = t // tiles_per_page
            part = t - page * tiles_per_page
            r = first + page // n_pairs
            i = page % n_pairs
            words = tl.load(table + 4 * R + r)
            src = tl.load(table + r) + tl.load(src_index + i) * tl.load(table + R + r)
            dst = tl.load(table + 2 * R + r) + tl.load(dst_index + i) * tl.load(table + 3 * R + r)
            at = part * TILE + offsets
            mask = at < words
            values = tl.load(src.to(tl.pointer_type(tl.int64)) + at, mask=mask)
            tl.store(dst.to(tl.pointer_type(tl.int64)) + at, values, mask=mask)
            t += step

    return copy_pages


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    """One program per multiprocessor: measured on an H100 (tools/bench_page_kernel.py), 32 to
    264 programs all move one direction at 0.95-0.97 of the link, but both directions at once
    reach 0.89 of the bidirectional link with 132 programs against 0.75 with 32."""
    if device.type != "cuda":
        return 4
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def store_programs(device: torch.device) -> int:
    """Programs of a store launch: half the multiprocessors. A store's writes to pinned memory
    are posted, so half as many programs still move 0.94-0.95 of the link alone; with a load
    running beside it (which keeps one program per multiprocessor), the two reached 0.72-0.85
    of the bidirectional link on an H200 against 0.64-0.78 with as many store programs."""
    return max(1, _multiprocessors(device) // 2)


def region_table(
    device_pages: Sequence[torch.Tensor],
    device_strides: Sequence[int],
    host_pages: Sequence[torch.Tensor],
    page_bytes: Sequence[int],
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The store and load tables ``[5, R]`` (int64, on ``device``), or None when a region's
    pages are not whole 8-byte words (the kernel moves int64 words only)."""
    if any(p.dtype != torch.int64 for p in (*device_pages, *host_pages)):
        return None
    dev_base = [p.data_ptr() for p in device_pages]
    host_base = [p.data_ptr() for p in host_pages]
    host_strides = [p.stride(0) * 8 for p in host_pages]  # page_bytes, or a page-first block
    words = [pb // 8 for pb in page_bytes]
    store = torch.tensor(
        [dev_base, list(device_strides), host_base, host_strides, words], dtype=torch.int64
    )
    load = torch.tensor(
        [host_base, host_strides, dev_base, list(device_strides), words], dtype=torch.int64
    )
    return store.to(device), load.to(device)


def copy_pages(
    table: torch.Tensor,
    src_index: torch.Tensor,
    dst_index: torch.Tensor,
    max_words: int,
    *,
    first: int = 0,
    count: int | None = None,
    programs: int = DEFAULT_PROGRAMS,
    tile: int = TILE,
    num_warps: int = 4,
) -> None:
    """Copy page ``src_index[i]`` to page ``dst_index[i]`` in regions ``[first, first+count)``
    of ``table`` (``region_table``), on the current stream, in one launch."""
    regions = int(table.shape[1])
    count = regions - first if count is None else count
    n = int(src_index.shape[0])
    if n == 0 or count <= 0:
        return
    if programs <= 0:
        programs = _multiprocessors(table.device)
    tiles_per_page = -(-max_words // tile)
    n_tiles = count * n * tiles_per_page
    grid = (max(1, min(int(programs), n_tiles)),)
    _kernel(interpreting())[grid](
        table, src_index, dst_index, n, first, n_tiles, tiles_per_page, regions, TILE=tile,
        num_warps=num_warps,
    )
