"""KV layout registration: the engine's KV cache tensors seen as *regions* of pages.

A region is ``num_blocks`` pages, one per device block, each ``page_bytes`` long and each one
dense range of memory. The executor copies pages, never elements, so a region is kept as a
``[num_blocks, page_words]`` view of the tensor's storage in the widest integer "word" type
that the page size, the block stride and the start address allow (int64 where it can):
gathers and copies then move 8 bytes per element and never convert values.

Accepted inputs (the shapes vLLM-like engines use):

* one cross-layer tensor ``[num_blocks, ...]``: one region;
* a list (or dict) of per-layer tensors ``[num_blocks, ...]``, K and V separate or not: one
  region each;
* per-layer stacked tensors ``[2, num_blocks, ...]``: detected (``ndim >= 3``, ``shape[0] == 2``,
  ``shape[1] != 2``), or named with ``block_dim=1``; each index of the dims before the block dim
  is its own region (K and V here), because one block's K and V pages are not adjacent.

Pages are sized from shape and strides, never from the storage size (a storage may hold more
than the tensor). A page that is not one dense range (a sliced head dim, a transposed block dim)
is refused with a ``ConfigError``: it cannot be moved as one range of bytes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kvflow.core.errors import ConfigError

KVCaches = torch.Tensor | Sequence[torch.Tensor] | Mapping[str, torch.Tensor]

_WORDS: tuple[tuple[int, torch.dtype], ...] = (
    (8, torch.int64),
    (4, torch.int32),
    (2, torch.int16),
    (1, torch.uint8),
)


def word_dtype_for(*byte_quantities: int) -> torch.dtype:
    """The widest integer type whose size divides every quantity (offsets, sizes, strides)."""
    g = 0
    for q in byte_quantities:
        g = math.gcd(g, int(q))
    for size, dtype in _WORDS:
        if g % size == 0:
            return dtype
    return torch.uint8


def word_bytes(dtype: torch.dtype) -> int:
    """Size in bytes of one word of ``dtype``."""
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Region:
    """One range of pages: ``pages[i]`` is device block ``i``'s page in this tensor."""

    name: str
    pages: torch.Tensor  # [num_blocks, page_bytes // word] view of the engine's storage
    page_bytes: int
    block_stride_bytes: int

    @property
    def word_dtype(self) -> torch.dtype:
        return self.pages.dtype

    @property
    def num_blocks(self) -> int:
        return int(self.pages.shape[0])


@dataclass(frozen=True)
class KVLayout:
    """All regions of one rank's KV cache; every region has ``num_blocks`` pages."""

    regions: tuple[Region, ...]
    num_blocks: int
    device: torch.device
    # the KV tensors' element types, each once, in order ("bfloat16"): the lower tiers' entries
    # name them, so that a bf16 and an fp16 deployment of one model never read each other's bytes
    kv_dtypes: tuple[str, ...] = ()

    @property
    def kv_dtype(self) -> str:
        """The KV's element type(s), as the lower tiers' layout identity names them."""
        return ",".join(self.kv_dtypes)

    @property
    def page_bytes(self) -> tuple[int, ...]:
        return tuple(r.page_bytes for r in self.regions)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block across every region (what one slot of the host pool holds)."""
        return sum(r.page_bytes for r in self.regions)

    @property
    def num_regions(self) -> int:
        return len(self.regions)

    @classmethod
    def from_caches(
        cls,
        kv_caches: KVCaches,
        *,
        block_dim: int | None = None,
        num_blocks: int | None = None,
    ) -> KVLayout:
        """Register the engine's KV tensors (see the module doc for accepted shapes).

        ``block_dim`` names the block dimension explicitly; ``num_blocks`` disambiguates the
        automatic detection (the block dim is the first of dims 0 and 1 of that size).
        """
        named = _named_tensors(kv_caches)
        if not named:
            raise ConfigError("kv_caches is empty: register at least one KV tensor")
        device = named[0][1].device
        regions: list[Region] = []
        for name, tensor in named:
            if tensor.device != device:
                raise ConfigError(
                    f"KV tensor {name} is on {tensor.device}, others on {device}: "
                    "one executor serves one device"
                )
            dim = _block_dim_of(name, tensor, block_dim, num_blocks)
            regions.extend(_regions_of(name, tensor, dim))
        counts = {r.num_blocks for r in regions}
        if len(counts) != 1:
            detail = ", ".join(f"{r.name}={r.num_blocks}" for r in regions[:8])
            raise ConfigError(
                f"KV regions disagree on num_blocks ({detail}); pass block_dim= if the "
                "block dimension was guessed wrong"
            )
        n = counts.pop()
        if n <= 0:
            raise ConfigError("KV cache has 0 blocks")
        dtypes = tuple(dict.fromkeys(str(t.dtype).removeprefix("torch.") for _, t in named))
        return cls(regions=tuple(regions), num_blocks=n, device=device, kv_dtypes=dtypes)


def _named_tensors(kv_caches: KVCaches) -> list[tuple[str, torch.Tensor]]:
    if isinstance(kv_caches, torch.Tensor):
        return [("kv", kv_caches)]
    if isinstance(kv_caches, Mapping):
        items = list(kv_caches.items())
    elif isinstance(kv_caches, Sequence):
        items = [(str(i), t) for i, t in enumerate(kv_caches)]
    else:
        raise ConfigError(
            "kv_caches must be a tensor, a list or a dict of tensors, "
            f"not {type(kv_caches).__name__}"
        )
    for name, t in items:
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"KV entry {name} is a {type(t).__name__}, not a tensor")
    return [(str(k), t) for k, t in items]


def _block_dim_of(name: str, t: torch.Tensor, block_dim: int | None, num_blocks: int | None) -> int:
    if t.ndim == 0:
        raise ConfigError(f"KV tensor {name} is a scalar; it needs a block dimension")
    if block_dim is not None:
        if not 0 <= block_dim < t.ndim:
            raise ConfigError(
                f"block_dim={block_dim} is out of range for {name} of shape {tuple(t.shape)}"
            )
        return block_dim
    if num_blocks is not None:
        for d in range(min(2, t.ndim)):
            if t.shape[d] == num_blocks:
                return d
        raise ConfigError(
            f"KV tensor {name} of shape {tuple(t.shape)} has no dim 0 or 1 of size {num_blocks}"
        )
    if t.ndim >= 3 and t.shape[0] == 2 and t.shape[1] != 2:
        return 1  # [2, num_blocks, ...]: K and V stacked in front of the block dim
    return 0


def _is_dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """True when the elements of a (sizes, strides) view fill one range without gaps or overlap."""
    dims = sorted((st, sz) for sz, st in zip(sizes, strides, strict=True) if sz != 1)
    expected = 1
    for stride, size in dims:
        if stride != expected:
            return False
        expected *= size
    return True


def _regions_of(name: str, t: torch.Tensor, block_dim: int) -> list[Region]:
    if any(s < 0 for s in t.stride()):
        raise ConfigError(f"KV tensor {name} has a negative stride; pages must be dense ranges")
    outer = t.shape[:block_dim]
    out: list[Region] = []
    for index in itertools.product(*(range(s) for s in outer)):
        sub = t[index] if index else t
        label = name + "".join(f"[{i}]" for i in index)
        out.append(_region(label, sub))
    return out


def _region(name: str, sub: torch.Tensor) -> Region:
    """View ``sub`` (block dim first) as ``[num_blocks, page_words]`` over its storage."""
    elem = sub.element_size()
    n = int(sub.shape[0])
    page_sizes, page_strides = list(sub.shape[1:]), list(sub.stride()[1:])
    page_elems = math.prod(page_sizes)
    page_bytes = page_elems * elem
    if page_bytes == 0:
        raise ConfigError(f"KV region {name} has empty pages (shape {tuple(sub.shape)})")
    if not _is_dense(page_sizes, page_strides):
        raise ConfigError(
            f"KV region {name}: a block's page is not contiguous in memory "
            f"(shape {tuple(sub.shape)}, strides {tuple(sub.stride())}); "
            "each block must be one dense range of bytes"
        )
    block_stride_bytes = int(sub.stride(0)) * elem
    if n > 1 and block_stride_bytes < page_bytes:
        raise ConfigError(
            f"KV region {name}: block stride {block_stride_bytes} B is smaller than the page "
            f"({page_bytes} B), so pages overlap; is the block dimension right?"
        )
    offset_bytes = int(sub.storage_offset()) * elem
    base = 0 if sub.device.type == "meta" else sub.untyped_storage().data_ptr()
    word = word_dtype_for(
        page_bytes, block_stride_bytes if n > 1 else page_bytes, offset_bytes, base
    )
    w = word_bytes(word)
    pages = torch.empty(0, dtype=word, device=sub.device)
    pages.set_(
        sub.untyped_storage(),
        offset_bytes // w,
        (n, page_bytes // w),
        ((block_stride_bytes if n > 1 else page_bytes) // w, 1),
    )
    return Region(
        name=name, pages=pages, page_bytes=page_bytes, block_stride_bytes=block_stride_bytes
    )
