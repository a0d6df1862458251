"""Many copies in one driver call, on the copy engines (CUDA 12.8's cuMemcpyBatchAsync).

Kernels that read or write pinned memory (the page kernel, ``page_kernel``) move one direction
at 0.90-0.95 of the link but both directions at once at only 0.69-0.78 (measured on an H200):
each multiprocessor access is a small PCIe request, and both directions' requests share each
way of the link. The copy engines move both directions at the link's speed. Rather than one
``cudaMemcpyAsync`` per transfer, the batch call takes a whole batch as three arrays
(destinations, sources, sizes), built with numpy. The driver still spends host time on each
transfer in the batch (docs/performance.md), so the executor hands it few, large transfers:
the staged path's runs of whole blocks (one per run of consecutive slots of a page-first
pool), or pages of 512 KiB and more (``scatter="batch"``).

The entry point is looked up through ``cuGetProcAddress`` at the 12.8 ABI, so the signature is
fixed whatever the driver's version; drivers without it (before 12.8) leave ``available`` false
and the executor uses the page kernel. Ascend's CANN 8.5 has the same call
(``aclrtMemcpyBatchAsync``); torch-npu does not expose it yet, so the NPU path stages on the host.

Source reads are ordered with the stream (``SRC_ACCESS_ORDER_STREAM``): a store must not read a
device page before the engine's compute-done event, which the stream waits for.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np

ABI_VERSION = 12080  # CUDA 12.8: the first with cuMemcpyBatchAsync (this ABI has failIdx)
SRC_ACCESS_ORDER_STREAM = 1


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attributes(ctypes.Structure):
    """CUmemcpyAttributes: the same for every copy of a batch (one entry, index 0)."""

    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_location_hint", _Location),
        ("dst_location_hint", _Location),
        ("flags", ctypes.c_uint),
    ]


_BatchFn = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p,  # CUdeviceptr* dsts
    ctypes.c_void_p,  # CUdeviceptr* srcs
    ctypes.c_void_p,  # size_t* sizes
    ctypes.c_size_t,  # count
    ctypes.POINTER(_Attributes),
    ctypes.POINTER(ctypes.c_size_t),  # attrsIdxs
    ctypes.c_size_t,  # numAttrs
    ctypes.POINTER(ctypes.c_size_t),  # failIdx
    ctypes.c_void_p,  # CUstream
)


@functools.cache
def _entry() -> Any | None:
    """The driver's cuMemcpyBatchAsync (12.8 ABI), or None where the driver lacks it."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        get = lib.cuGetProcAddress_v2
    except (OSError, AttributeError):
        return None
    lib.cuInit(0)  # (looked up before any CUDA call, the entry point would read as missing)
    get.restype = ctypes.c_int
    get.argtypes = [
        ctypes.c_char_p,
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.c_int,
        ctypes.c_uint64,
        ctypes.POINTER(ctypes.c_int),
    ]
    pfn, status = ctypes.c_void_p(), ctypes.c_int()
    if get(b"cuMemcpyBatchAsync", ctypes.byref(pfn), ABI_VERSION, 0, ctypes.byref(status)) != 0:
        return None
    return _BatchFn(pfn.value) if pfn.value else None


def available(device_type: str) -> bool:
    """Can this process batch copies on ``device_type``?"""
    return device_type == "cuda" and _entry() is not None


class RegionAddresses:
    """Base address and block stride of every region on both sides, for building descriptors."""

    def __init__(
        self,
        device_base: list[int],
        device_stride: list[int],
        host_base: list[int],
        host_stride: list[int],
        page_bytes: list[int],
    ) -> None:
        self.device_base = np.asarray(device_base, dtype=np.uint64)[:, None]
        self.device_stride = np.asarray(device_stride, dtype=np.uint64)[:, None]
        self.host_base = np.asarray(host_base, dtype=np.uint64)[:, None]
        self.host_stride = np.asarray(host_stride, dtype=np.uint64)[:, None]
        self.page_bytes = np.asarray(page_bytes, dtype=np.uint64)

    def descriptors(
        self, blocks: np.ndarray, slots: np.ndarray, first: int, count: int, *, store: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(destinations, sources, sizes) of every (region, pair) page in regions
        ``[first, first+count)``, region by region."""
        r = slice(first, first + count)
        dev = self.device_base[r] + blocks.astype(np.uint64)[None, :] * self.device_stride[r]
        host = self.host_base[r] + slots.astype(np.uint64)[None, :] * self.host_stride[r]
        sizes = np.repeat(self.page_bytes[r], len(blocks))
        if store:
            return host.ravel(), dev.ravel(), sizes
        return dev.ravel(), host.ravel(), sizes


def copy(dsts: np.ndarray, srcs: np.ndarray, sizes: np.ndarray, stream_handle: int) -> None:
    """Enqueue ``sizes[i]`` bytes from ``srcs[i]`` to ``dsts[i]`` for every i on the stream.

    Raises ``RuntimeError`` naming the driver's error and the first copy it refused."""
    fn = _entry()
    if fn is None:
        raise RuntimeError("cuMemcpyBatchAsync is not available (CUDA driver before 12.8)")
    n = len(sizes)
    if n == 0:
        return
    attrs = _Attributes(SRC_ACCESS_ORDER_STREAM, _Location(0, 0), _Location(0, 0), 0)
    index, failed = ctypes.c_size_t(0), ctypes.c_size_t(0)
    rc = fn(
        dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n, ctypes.byref(attrs),
        ctypes.byref(index), 1, ctypes.byref(failed), stream_handle,
    )
    if rc != 0:
        raise RuntimeError(f"cuMemcpyBatchAsync returned CUresult {rc} at copy {failed.value} of {n}")
