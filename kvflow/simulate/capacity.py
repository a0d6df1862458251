"""Capacity in the user's terms: a model's KV geometry (how many bytes of KV cache one token
takes, for the models ``kvflow simulate`` knows by name), blocks of it, and GB of blocks.

One token's KV cache is a key and a value vector for every layer and KV head::

    bytes per token = 2 (K and V) x layers x KV heads x head dim x bytes per element

and a block of ``block_tokens`` tokens takes ``block_tokens`` times that. A capacity in GB
becomes whole blocks through it, and the simulated transfers move that many bytes per block.
Without a geometry the simulator assumes :data:`DEFAULT_BYTES_PER_TOKEN` (say so when it
matters: a CPU tier sized in GB holds 32 times more 4 KiB tokens than Llama-3-8B tokens).

Pure data and arithmetic: imports only the standard library and kvflow's errors (the ``kvflow
simulate`` command reads its option defaults here without loading the simulator).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kvflow.core.errors import ConfigError
from kvflow.core.values import is_int

__all__ = [
    "DEFAULT_BYTES_PER_TOKEN",
    "DEFAULT_CPU_BLOCKS",
    "DEFAULT_DISK_BANDWIDTH_GBPS",
    "DEFAULT_DISK_LATENCY_US",
    "DEFAULT_KV_DTYPE",
    "GB",
    "KV_DTYPES",
    "MODELS",
    "KvGeometry",
    "ModelKv",
    "blocks_for_gb",
    "kv_geometry",
]

GB = 10**9
"""Decimal, like the GB of ``--cpu-gb``, of the summary and of ``--bandwidth-gbps``."""

DEFAULT_CPU_BLOCKS = 2000
"""The CPU tier's capacity when neither a number of blocks nor GB is given."""

DEFAULT_DISK_BANDWIDTH_GBPS = 3.0
"""A simulated disk tier's bandwidth per direction, GB/s (an NVMe drive's sequential rate)."""

DEFAULT_DISK_LATENCY_US = 100.0
"""A simulated disk job's fixed cost, µs (an NVMe read's latency, rounded up)."""


@dataclass(frozen=True)
class ModelKv:
    """The KV-cache shape of a model, as its ``config.json`` gives it: ``num_hidden_layers``,
    ``num_key_value_heads`` and ``head_dim`` (``hidden_size / num_attention_heads`` where the
    config leaves it out)."""

    title: str
    """The model, as its makers name it (several releases may share one geometry)."""
    layers: int
    kv_heads: int
    head_dim: int

    def bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes  # (a K and a V)


MODELS: dict[str, ModelKv] = {
    "llama3-8b": ModelKv("Llama 3 / 3.1 8B", layers=32, kv_heads=8, head_dim=128),
    "llama3-70b": ModelKv("Llama 3 / 3.1 / 3.3 70B", layers=80, kv_heads=8, head_dim=128),
    "qwen2.5-7b": ModelKv("Qwen2.5 7B", layers=28, kv_heads=4, head_dim=128),
    "qwen2.5-72b": ModelKv("Qwen2.5 72B", layers=80, kv_heads=8, head_dim=128),
    "mistral-7b": ModelKv("Mistral 7B", layers=32, kv_heads=8, head_dim=128),
}
"""The models known by name (``--model``), in the order ``--help`` lists them."""

KV_DTYPES: dict[str, int] = {"bf16": 2, "fp16": 2, "fp8": 1, "fp32": 4}
"""Bytes per element of the KV cache, by its dtype (``--kv-dtype``)."""

DEFAULT_KV_DTYPE = "bf16"

DEFAULT_BYTES_PER_TOKEN = 4096
"""KV bytes per token when no geometry is given: 2 MiB per 512-token (Mooncake) block."""


@dataclass(frozen=True)
class KvGeometry:
    """The KV bytes per token a simulation uses, and where the number came from: a known
    ``model`` in ``kv_dtype``, a number given as it is (``model`` None), or the default
    (``default`` True). Made by :func:`kv_geometry`, which checks what it is given."""

    bytes_per_token: int
    model: str | None = None
    kv_dtype: str | None = None
    default: bool = False

    def bytes_per_block(self, block_tokens: int) -> int:
        return self.bytes_per_token * block_tokens

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` form: the source, and the shape of a named model."""
        out: dict[str, Any] = {
            "source": "default" if self.default else "kv_bytes_per_token" if self.model is None else "model",
            "model": self.model,
            "kv_dtype": self.kv_dtype,
            "bytes_per_token": self.bytes_per_token,
        }
        if self.model is not None:
            shape = MODELS[self.model]
            out.update(
                layers=shape.layers,
                kv_heads=shape.kv_heads,
                head_dim=shape.head_dim,
                dtype_bytes=KV_DTYPES[self.kv_dtype or DEFAULT_KV_DTYPE],
            )
        return out


def kv_geometry(
    model: str | None = None, kv_dtype: str | None = None, kv_bytes_per_token: int | None = None
) -> KvGeometry:
    """The geometry of a known ``model`` (in ``kv_dtype``, bf16 unless told), or of
    ``kv_bytes_per_token`` given as it is, or the default when neither is given. Giving both,
    or a dtype without a model, is an error: the bytes per token already count the dtype."""
    if model is not None and kv_bytes_per_token is not None:
        raise ConfigError("give the KV geometry once: --model or --kv-bytes-per-token, not both")
    if kv_dtype is not None:
        if model is None:
            raise ConfigError(
                "--kv-dtype applies to --model (--kv-bytes-per-token already counts the dtype)"
            )
        if kv_dtype not in KV_DTYPES:
            raise ConfigError(f"--kv-dtype must be one of {', '.join(KV_DTYPES)}, got {kv_dtype!r}")
    if model is not None:
        shape = MODELS.get(model)
        if shape is None:
            raise ConfigError(f"--model must be one of {', '.join(MODELS)}, got {model!r}")
        dtype = kv_dtype or DEFAULT_KV_DTYPE
        return KvGeometry(shape.bytes_per_token(KV_DTYPES[dtype]), model, dtype)
    if kv_bytes_per_token is None:
        return KvGeometry(DEFAULT_BYTES_PER_TOKEN, default=True)
    if not is_int(kv_bytes_per_token) or kv_bytes_per_token <= 0:
        raise ConfigError(f"--kv-bytes-per-token must be a whole number > 0, got {kv_bytes_per_token!r}")
    return KvGeometry(kv_bytes_per_token)


def blocks_for_gb(gb: float, bytes_per_block: int, option: str = "--cpu-gb") -> int:
    """A CPU tier of ``gb`` GB as whole blocks of ``bytes_per_block`` bytes (the bytes per block
    the simulated transfers move), rounded down: a partial block holds nothing, and rounding
    down never gives the tier more memory than asked. ``0`` disables offload, like
    ``--cpu-blocks 0``; a positive size below one block is refused rather than silently
    disabling offload."""
    if not is_int(bytes_per_block) or bytes_per_block <= 0:
        raise ConfigError(f"bytes per block must be a whole number > 0, got {bytes_per_block!r}")
    if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not math.isfinite(gb) or gb < 0:
        raise ConfigError(f"{option} must be a finite number >= 0, got {gb!r}")
    # to the nearest byte first, so that float noise (0.3 * 1e9 = 299999999.99...) cannot
    # cost a whole block when GB is an exact multiple of the block size
    blocks = round(gb * GB) // bytes_per_block
    if blocks == 0 and gb > 0:
        raise ConfigError(
            f"{option} {gb:g} is less than one block of {bytes_per_block:,} bytes "
            "(rounds down to 0 blocks; use 0 for none)"
        )
    return blocks
