"""The host tier: one pinned buffer, allocated once, laid out per KV region.

Region ``r`` is ``cpu_blocks`` pages of ``page_bytes[r]`` back to back, so slot ``i`` of a region
is one contiguous page and a run of consecutive slots is one contiguous range: a job whose slots
form a run is copied with one transfer per region. Region starts are aligned to 4 KiB
so that a rank can pin just its own range.

The pool is sized once, before any worker maps it, and never reallocated (F10). ``cpu_blocks=0``
is a *disabled* pool: nothing is allocated and the executor refuses every job (F11).

Shared pools (several rank processes, one pool) live in a file under ``/dev/shm``: the creating
process reserves the whole size up front with ``posix_fallocate`` (a full ``/dev/shm`` becomes a
``ConfigError`` now instead of a SIGBUS on first touch later), every process maps it with
``torch.from_file(shared=True)``, and on CUDA each process pins its own mapping with
``cudaHostRegister``. Layout in a shared pool: ``world_size × R`` regions, rank ``k`` owns regions
``[k·R, (k+1)·R)`` (``for_rank``), so ranks never write each other's bytes.
"""

from __future__ import annotations

import os
import uuid
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvflow.core.errors import ConfigError
from kvflow.core.values import is_int
from kvflow.executors.torch.npu import DeviceTraits, traits_for

ALIGN = 4096
HUGE_PAGE = 2 << 20
CUDA_HOST_REGISTER_PORTABLE = 1


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _page_aligned_empty(nbytes: int) -> torch.Tensor:
    """``nbytes`` of host memory starting on a 2 MiB boundary.

    ``torch.empty`` returns a large buffer 16-64 bytes past a page boundary, so every pool page
    would straddle one more 4 KiB page than it needs, and a GPU kernel reading or writing
    pinned pages splits each access that crosses a page: measured on an H200 (16 KiB pages,
    scattered), the page kernel moved 0.88 / 0.85 of the link from such a buffer and 0.94 / 0.92
    from an aligned one. 2 MiB also lets the kernel back the pool with huge pages."""
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)
    skip = (-raw.data_ptr()) % HUGE_PAGE
    return raw[skip : skip + nbytes]


@dataclass(frozen=True)
class PoolSpec:
    """What a process needs to map a shared pool (picklable, sent to rank processes)."""

    page_bytes: tuple[int, ...]
    cpu_blocks: int
    path: str | None
    page_first: bool = False  # slot-major: a slot's pages of every region back to back

    @property
    def offsets(self) -> tuple[int, ...]:
        """Byte offset of each region's first slot."""
        out, at = [], 0
        for pb in self.page_bytes:
            out.append(at)
            at += pb if self.page_first else _align(pb * self.cpu_blocks)
        return tuple(out)

    @property
    def block_bytes(self) -> int:
        """Bytes of one slot over every region."""
        return sum(self.page_bytes)

    @property
    def nbytes(self) -> int:
        if self.page_first:
            return _align(self.block_bytes * self.cpu_blocks)
        return sum(_align(pb * self.cpu_blocks) for pb in self.page_bytes)


def _check_sizes(page_bytes: Sequence[int], cpu_blocks: object) -> tuple[int, ...]:
    if not is_int(cpu_blocks):
        raise ConfigError(f"cpu_blocks must be an integer, not {cpu_blocks!r}")
    if cpu_blocks < 0:
        raise ConfigError(f"cpu_blocks must be >= 0 (0 disables offload), got {cpu_blocks}")
    pages = tuple(int(p) for p in page_bytes)
    if not pages or any(p <= 0 for p in pages):
        raise ConfigError(f"page sizes must be positive byte counts, got {list(page_bytes)[:8]}")
    return pages


class HostPool:
    """Host memory for ``cpu_blocks`` slots of every region; see the module doc."""

    def __init__(
        self,
        spec: PoolSpec,
        buffer: torch.Tensor | None,
        *,
        first_region: int = 0,
        num_regions: int | None = None,
        pinned: bool = False,
        owner: bool = False,
        registered: list[tuple[int, int]] | None = None,
    ) -> None:
        """Use ``create`` or ``attach``; this wraps an already-allocated buffer."""
        self.spec = spec
        self._buffer = buffer
        self.first_region = first_region
        self.num_regions = (
            len(spec.page_bytes) - first_region if num_regions is None else num_regions
        )
        self.pinned = pinned
        self._owner = owner
        self._registered = registered if registered is not None else []
        self._offsets = spec.offsets
        self._views: dict[tuple[int, torch.dtype], torch.Tensor] = {}

    # --- construction ---------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        page_bytes: Sequence[int],
        cpu_blocks: int,
        *,
        device: torch.device | str = "cpu",
        shared: bool = False,
        path: str | None = None,
        page_first: bool = False,
    ) -> HostPool:
        """Allocate (and pin, for an accelerator) the whole pool once. ``page_first``: lay it
        out slot by slot (a slot's pages of every region back to back, ``blocks()``), so that a
        run of consecutive slots is one contiguous range over every region: one copy moves it
        (the staged copy path). Private pools only: ranks sharing a pool pin their own regions."""
        pages = _check_sizes(page_bytes, cpu_blocks)
        dev = torch.device(device)
        traits = traits_for(dev.type)
        if page_first and shared:
            raise ConfigError("a shared host pool is laid out region by region (page_first=False)")
        if cpu_blocks == 0:
            return cls(PoolSpec(pages, 0, None), None)
        spec = PoolSpec(pages, cpu_blocks, None, page_first)
        nbytes = spec.nbytes
        if shared:
            path = path or f"/dev/shm/kvflow-pool-{os.getpid()}-{uuid.uuid4().hex[:12]}"
            _reserve_file(path, nbytes)
            spec = PoolSpec(pages, cpu_blocks, path)
            try:
                buffer = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            except RuntimeError as e:
                os.unlink(path)
                raise ConfigError(f"cannot map host pool file {path}: {_first_line(e)}") from None
            pool = cls(spec, buffer, owner=True)
            pool._pin(traits, dev, whole=True)
            return pool
        if traits.pin_strategy == "pin_memory":
            try:
                buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as e:
                raise ConfigError(_alloc_message(nbytes, cpu_blocks, pages, e)) from None
            return cls(spec, buffer, pinned=True, owner=True)
        try:
            buffer = _page_aligned_empty(nbytes)
        except RuntimeError as e:
            raise ConfigError(_alloc_message(nbytes, cpu_blocks, pages, e)) from None
        pool = cls(spec, buffer, owner=True)
        pool._pin(traits, dev, whole=True)
        return pool

    @classmethod
    def attach(
        cls,
        spec: PoolSpec,
        *,
        device: torch.device | str = "cpu",
        first_region: int = 0,
        num_regions: int | None = None,
    ) -> HostPool:
        """Map an existing shared pool in this process; pin only the regions it will use."""
        if spec.path is None:
            raise ConfigError("this pool is not shared (no path): create it with shared=True")
        if not os.path.exists(spec.path):
            raise ConfigError(f"shared host pool {spec.path} does not exist (creator gone?)")
        size = os.path.getsize(spec.path)
        if size != spec.nbytes:
            raise ConfigError(
                f"shared host pool {spec.path} holds {size} B, expected {spec.nbytes}"
            )
        try:
            buffer = torch.from_file(spec.path, shared=True, size=spec.nbytes, dtype=torch.uint8)
        except RuntimeError as e:
            raise ConfigError(f"cannot map host pool file {spec.path}: {_first_line(e)}") from None
        count = len(spec.page_bytes) - first_region if num_regions is None else num_regions
        pool = cls(spec, buffer, first_region=first_region, num_regions=count)
        dev = torch.device(device)
        pool._pin(traits_for(dev.type), dev, whole=False)
        return pool

    def for_rank(self, rank: int, regions_per_rank: int) -> HostPool:
        """The view of this pool that rank ``rank`` uses: regions ``[rank·R, (rank+1)·R)``."""
        first = self.first_region + rank * regions_per_rank
        if rank < 0 or first + regions_per_rank > self.first_region + self.num_regions:
            raise ConfigError(
                f"rank {rank} needs regions [{first}, {first + regions_per_rank}) but the pool "
                f"has {self.num_regions}"
            )
        return HostPool(
            self.spec,
            self._buffer,
            first_region=first,
            num_regions=regions_per_rank,
            pinned=self.pinned,
        )

    def _pin(self, traits: DeviceTraits, device: torch.device, *, whole: bool) -> None:
        """Page-lock this process's mapping so that copies run at link speed (not 1/3 of it)."""
        assert self._buffer is not None
        if traits.pin_strategy == "none":
            return
        if traits.pin_strategy == "pin_memory":
            warnings.warn(
                f"kvflow: host pool on {device.type} cannot be pinned in place (no host-register "
                "API); copies to a shared pool run at pageable speed",
                stacklevel=3,
            )
            return
        start = self._offsets[self.first_region]
        end = self._offsets[self.first_region + self.num_regions - 1] + _align(
            self.spec.page_bytes[self.first_region + self.num_regions - 1] * self.spec.cpu_blocks
        )
        if whole:
            start, end = 0, self.spec.nbytes
        ptr = self._buffer.data_ptr() + start
        try:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch: untyped
            err = cudart.cudaHostRegister(ptr, end - start, CUDA_HOST_REGISTER_PORTABLE)
        except (RuntimeError, AttributeError) as e:
            raise ConfigError(f"cannot pin host pool ({end - start} B): {_first_line(e)}") from None
        if int(err) != 0:
            raise ConfigError(
                f"cannot pin host pool ({end - start} B): cudaHostRegister returned {err}; "
                "is cpu_blocks larger than host memory allows?"
            )
        self._registered.append((ptr, end - start))
        self.pinned = True

    # --- use --------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        """False for ``cpu_blocks=0``: offload is disabled and nothing was allocated."""
        return self._buffer is not None

    @property
    def cpu_blocks(self) -> int:
        return self.spec.cpu_blocks

    @property
    def page_bytes(self) -> tuple[int, ...]:
        return self.spec.page_bytes[self.first_region : self.first_region + self.num_regions]

    @property
    def nbytes(self) -> int:
        return self.spec.nbytes

    @property
    def path(self) -> str | None:
        return self.spec.path

    def region(self, index: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """``[cpu_blocks, page_bytes // word]`` view of region ``index`` (relative to this view)."""
        if self._buffer is None:
            raise ConfigError("host pool is disabled (cpu_blocks=0)")
        if not 0 <= index < self.num_regions:
            raise IndexError(f"region {index} out of range [0, {self.num_regions})")
        key = (index, dtype)
        view = self._views.get(key)
        if view is None:
            g = self.first_region + index
            off, pb = self._offsets[g], self.spec.page_bytes[g]
            if self.spec.page_first:  # every block_bytes, one page
                word = torch.empty((), dtype=dtype).element_size()
                if pb % word or self.spec.block_bytes % word or off % word:
                    raise ConfigError(f"region {index}: pages of {pb} B are not {dtype} words")
                flat = self._buffer[off:].view(dtype)
                view = flat.as_strided(
                    (self.spec.cpu_blocks, pb // word), (self.spec.block_bytes // word, 1)
                )
            else:
                raw = self._buffer[off : off + pb * self.spec.cpu_blocks]
                view = raw.view(dtype).view(self.spec.cpu_blocks, -1)
            self._views[key] = view
        return view

    def blocks(self) -> torch.Tensor:
        """``[cpu_blocks, block_bytes]`` bytes of a page-first pool: row ``s`` is slot ``s``'s
        pages of every region, at ``spec.offsets`` within the row."""
        if self._buffer is None:
            raise ConfigError("host pool is disabled (cpu_blocks=0)")
        if not self.spec.page_first:
            raise ConfigError("blocks() needs a page-first pool (create it with page_first=True)")
        n = self.spec.cpu_blocks * self.spec.block_bytes
        return self._buffer[:n].view(self.spec.cpu_blocks, self.spec.block_bytes)

    def close(self) -> None:
        """Unpin what this process pinned; the creator also removes the shared file."""
        if self._registered:
            cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]  # torch: untyped
            for ptr, _size in self._registered:
                cudart.cudaHostUnregister(ptr)
            self._registered = []
        self._views.clear()
        self._buffer = None
        if self._owner and self.spec.path and os.path.exists(self.spec.path):
            os.unlink(self.spec.path)
        self._owner = False

    def __repr__(self) -> str:
        return (
            f"HostPool(cpu_blocks={self.cpu_blocks}, regions={self.num_regions}, "
            f"nbytes={self.nbytes}, pinned={self.pinned}, path={self.path})"
        )


def _reserve_file(path: str, nbytes: int) -> None:
    """Create the shared file with every byte reserved, or fail now with a clear message."""
    directory = os.path.dirname(path) or "."
    try:
        st = os.statvfs(directory)
        free = st.f_bavail * st.f_frsize
    except OSError as e:
        raise ConfigError(f"cannot use {directory} for a shared host pool: {e.strerror}") from None
    if nbytes > free:
        raise ConfigError(
            f"shared host pool needs {nbytes} B but {directory} has {free} B free; "
            "lower cpu_blocks or enlarge /dev/shm"
        )
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise ConfigError(f"cannot create shared host pool {path}: {e.strerror}") from None
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as e:
        os.close(fd)
        os.unlink(path)
        raise ConfigError(
            f"cannot reserve {nbytes} B for shared host pool {path}: {e.strerror}"
        ) from None
    os.close(fd)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def _alloc_message(nbytes: int, cpu_blocks: int, pages: tuple[int, ...], e: BaseException) -> str:
    return (
        f"cannot allocate host pool of {nbytes} B ({cpu_blocks} blocks × {sum(pages)} B): "
        f"{_first_line(e)}; lower cpu_blocks"
    )
