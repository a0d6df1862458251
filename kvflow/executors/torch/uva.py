"""Unified addressing (UVA): a CUDA tensor that aliases a pinned host region of the pool.

With it, device kernels (``index_select`` / ``index_copy_``) gather and scatter scattered slots
of the pinned pool directly, with no CPU work: the executor's ``scatter="uva"`` path.
"""

from __future__ import annotations

import torch

from kvflow.core.errors import ConfigError, one_line
from kvflow.executors.torch.layout import word_bytes


class _CudaArray:
    """``__cuda_array_interface__`` over pinned host memory: a CUDA tensor aliasing the pool."""

    def __init__(self, host: torch.Tensor) -> None:
        self._host = host
        typestr = {1: "|u1", 2: "<i2", 4: "<i4", 8: "<i8"}[word_bytes(host.dtype)]
        self.__cuda_array_interface__ = {
            "shape": tuple(host.shape),
            "strides": tuple(s * host.element_size() for s in host.stride()),
            "typestr": typestr,
            "data": (host.data_ptr(), False),
            "version": 2,
        }


def device_alias(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over a pinned host region (UVA), so kernels gather/scatter it directly."""
    try:
        alias = torch.as_tensor(_CudaArray(host), device=device)
    except Exception as e:  # noqa: BLE001
        raise ConfigError(
            f"scatter='uva' unavailable: cannot map the pinned pool ({one_line(e)})"
        ) from None
    if alias.data_ptr() != host.data_ptr():
        raise ConfigError("scatter='uva' unavailable: device pointer differs from the host pointer")
    return alias
