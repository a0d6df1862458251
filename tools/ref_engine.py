"""A compact reference serving engine with kvflow embedded: paged KV, block tables, prefix
caching by block hash, greedy decoding of a Llama-architecture model.

It is what the GPU evidence runs (``tools/bench_ref_engine.py``): a real model loop whose KV
blocks go to kvflow's CPU tier and come back, driven through kvflow's step API with the
compute-done event, the way a serving engine embeds it.

* KV: per layer one K and one V tensor ``[num_blocks, block_tokens, kv_heads, head_dim]``; a
  request's block table maps its token positions to device blocks. kvflow's TorchExecutor
  registers these tensors (one page = one block of one tensor: 32 KiB for Llama-3-8B's
  geometry at 16 tokens in bf16).
* Device prefix cache: full blocks are cached by a chained block hash; an unreferenced cached
  block is evicted (least recently used) when blocks run out, never while kvflow holds it.
* kvflow (optional): after the device cache's hits, ``lookup``; the hits load into the request's
  next blocks; every block that becomes full is stored (``blocks_computed`` after the forward
  pass, with the compute-done event); at the end the chain is touched deepest first; fenced
  loads recompute into fresh blocks.
* Overlap (``overlap=True``, the default): the pass over the new tokens does not wait for the
  load on the host. It runs at once, optimistically, each layer's attention waiting on the
  device for that layer's pages only (the executor's ``load_events``, one per layer with
  ``TorchExecutor(load_groups=layers)``), so the copy of layer ``i+1`` overlaps the compute of
  layer ``i``. The load's outcome is read after the pass: if it failed, the pass is discarded
  and the prefix recomputed (into fresh blocks when fenced), as without overlap.

Models: ``random_llama`` (any dimensions, random weights from a seed: Llama-3-8B's by default)
and ``load_llama`` (a Hugging Face Llama directory, e.g. glassllm's from tools/glassllm_model.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

_MASK = (1 << 63) - 1


@dataclass(frozen=True)
class Dims:
    layers: int = 32
    d_model: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336
    vocab: int = 128256
    rope_base: float = 500000.0
    eps: float = 1e-5


LLAMA3_8B = Dims()


@dataclass
class Llama:
    """Weights of a Llama-architecture decoder (tied embeddings allowed), half-split RoPE."""

    dims: Dims
    embed: torch.Tensor
    lm_head: torch.Tensor
    norm: torch.Tensor
    layers: list[dict[str, torch.Tensor]] = field(default_factory=list)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype


def _fused(layer: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One matrix for q, k and v, one for the gate and up projections: fewer kernel launches
    per layer (the loop is bound by launching them)."""
    out = dict(layer)
    out["wqkv"] = torch.cat([out.pop("wq"), out.pop("wk"), out.pop("wv")], dim=1)
    out["w13"] = torch.cat([out.pop("w1"), out.pop("w3")], dim=1)
    return out


def random_llama(dims: Dims = LLAMA3_8B, *, device: str = "cuda", dtype: torch.dtype = torch.bfloat16, seed: int = 0) -> Llama:
    """Random weights from ``seed`` (scaled so activations stay O(1)); nothing is downloaded."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def w(rows: int, cols: int) -> torch.Tensor:
        t = torch.empty((rows, cols), device=device, dtype=dtype)
        return t.normal_(0.0, 1.0 / math.sqrt(rows), generator=gen)

    d, h, kv, hd = dims.d_model, dims.heads, dims.kv_heads, dims.head_dim
    embed = torch.empty((dims.vocab, d), device=device, dtype=dtype).normal_(0.0, 1.0, generator=gen)
    layers = [
        {
            "attn_norm": torch.ones(d, device=device, dtype=dtype),
            "wq": w(d, h * hd),
            "wk": w(d, kv * hd),
            "wv": w(d, kv * hd),
            "wo": w(h * hd, d),
            "mlp_norm": torch.ones(d, device=device, dtype=dtype),
            "w1": w(d, dims.ffn),
            "w3": w(d, dims.ffn),
            "w2": w(dims.ffn, d),
        }
        for _ in range(dims.layers)
    ]
    return Llama(dims, embed, embed, torch.ones(d, device=device, dtype=dtype), [_fused(x) for x in layers])


def load_llama(model_dir: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Llama:
    """A Hugging Face LlamaForCausalLM directory (config.json + model.safetensors)."""
    from safetensors.torch import load_file

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    dims = Dims(
        layers=cfg["num_hidden_layers"],
        d_model=cfg["hidden_size"],
        heads=cfg["num_attention_heads"],
        kv_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
        ffn=cfg["intermediate_size"],
        vocab=cfg["vocab_size"],
        rope_base=float(cfg.get("rope_theta", 10000.0)),
        eps=float(cfg.get("rms_norm_eps", 1e-5)),
    )
    t = {k: v.to(device=device, dtype=dtype) for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}
    layers = []
    for i in range(dims.layers):
        p = f"model.layers.{i}."
        layers.append(
            {
                "attn_norm": t[p + "input_layernorm.weight"],
                "wq": t[p + "self_attn.q_proj.weight"].T.contiguous(),
                "wk": t[p + "self_attn.k_proj.weight"].T.contiguous(),
                "wv": t[p + "self_attn.v_proj.weight"].T.contiguous(),
                "wo": t[p + "self_attn.o_proj.weight"].T.contiguous(),
                "mlp_norm": t[p + "post_attention_layernorm.weight"],
                "w1": t[p + "mlp.gate_proj.weight"].T.contiguous(),
                "w3": t[p + "mlp.up_proj.weight"].T.contiguous(),
                "w2": t[p + "mlp.down_proj.weight"].T.contiguous(),
            }
        )
    embed = t["model.embed_tokens.weight"]
    return Llama(dims, embed, t.get("lm_head.weight", embed), t["model.norm.weight"], [_fused(x) for x in layers])


class PagedKV:
    """K and V of every layer, in blocks of ``block_tokens`` positions."""

    def __init__(self, dims: Dims, num_blocks: int, block_tokens: int, device: torch.device, dtype: torch.dtype) -> None:
        shape = (num_blocks, block_tokens, dims.kv_heads, dims.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(dims.layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(dims.layers)]
        self.block_tokens = block_tokens
        self.num_blocks = num_blocks

    def tensors(self) -> list[torch.Tensor]:
        """In the order kvflow registers them (block dimension first)."""
        return [t for pair in zip(self.k, self.v) for t in pair]


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rotation(positions: torch.Tensor, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [n, 1, head_dim / 2] of the rotary angles at ``positions`` (once a pass)."""
    half = head_dim // 2
    freqs = base ** (-torch.arange(half, device=positions.device, dtype=torch.float32) / half)
    angles = positions.float()[:, None] * freqs[None, :]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Half-split rotary embedding of ``x`` [n, heads, head_dim]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def _indices(values: list[int], device: torch.device) -> torch.Tensor:
    """``values`` on ``device`` without the host waiting for the GPU: a copy from pageable
    memory makes CUDA finish the stream's earlier work first, which stalled every token."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@torch.inference_mode()
def forward(
    model: Llama,
    kv: PagedKV,
    tokens: list[int],
    start: int,
    table: list[int],
    layer_ready: list[Any] | None = None,
) -> torch.Tensor:
    """Run ``tokens`` at positions ``start..`` of a sequence whose blocks are ``table``: write
    their K/V into the pages, attend over the whole prefix; the last position's logits.
    ``layer_ready[i]``: an event the compute stream waits for before layer ``i`` (its pages
    are being loaded), or None."""
    dims, B = model.dims, kv.block_tokens
    n, total = len(tokens), start + len(tokens)
    dev = model.device
    ids = _indices(tokens, dev)
    positions = torch.arange(start, total, device=dev)
    page = _indices([table[p // B] for p in range(start, total)], dev)
    offset = positions % B
    blocks = _indices(table[: (total + B - 1) // B], dev)
    mask = None
    if start:  # the new positions attend to the whole prefix: causal, aligned bottom-right
        from torch.nn.attention.bias import causal_lower_right

        mask = causal_lower_right(n, total)
    x = model.embed[ids]
    cos, sin = _rotation(positions, dims.head_dim, dims.rope_base)
    q_end, k_end = dims.heads * dims.head_dim, (dims.heads + dims.kv_heads) * dims.head_dim
    for i, (layer, k_cache, v_cache) in enumerate(zip(model.layers, kv.k, kv.v)):
        if layer_ready is not None and layer_ready[i] is not None:
            torch.cuda.current_stream().wait_event(layer_ready[i])
        h = _rms(x, layer["attn_norm"], dims.eps)
        qkv = h @ layer["wqkv"]
        q = _rope(qkv[:, :q_end].view(n, dims.heads, dims.head_dim), cos, sin)
        k = _rope(qkv[:, q_end:k_end].view(n, dims.kv_heads, dims.head_dim), cos, sin)
        v = qkv[:, k_end:].view(n, dims.kv_heads, dims.head_dim)
        k_cache[page, offset] = k
        v_cache[page, offset] = v
        keys = k_cache[blocks].reshape(-1, dims.kv_heads, dims.head_dim)[:total]
        values = v_cache[blocks].reshape(-1, dims.kv_heads, dims.head_dim)[:total]
        # 4-D [batch, heads, positions, head_dim] with grouped KV heads: what the fused
        # kernels take (a 16k prefill never materialises heads x n x n scores)
        attn = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],
            keys.transpose(0, 1)[None],
            values.transpose(0, 1)[None],
            attn_mask=mask,
            is_causal=mask is None,
            enable_gqa=True,
        )[0]
        x = x + attn.transpose(0, 1).reshape(n, -1) @ layer["wo"]
        h = _rms(x, layer["mlp_norm"], dims.eps)
        gate, up = (h @ layer["w13"]).chunk(2, dim=-1)
        x = x + (F.silu(gate) * up) @ layer["w2"]
    return (_rms(x[-1:], model.norm, dims.eps) @ model.lm_head.T)[0].float()


def block_hashes(tokens: list[int], block_tokens: int) -> list[int]:
    """Chained hashes of the full blocks (a block's hash covers its whole prefix), over the
    tokens' 8-byte values: hashing them as JSON text showed in a long prompt's first token."""
    whole = np.asarray(tokens, dtype=np.int64).tobytes()
    step = 8 * block_tokens
    out, parent = [], b""
    for i in range(len(tokens) // block_tokens):
        parent = hashlib.blake2b(parent + whole[i * step : (i + 1) * step], digest_size=8).digest()
        out.append(int.from_bytes(parent, "big") & _MASK)
    return out


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    device_hit_blocks: int = 0
    loaded_blocks: int = 0
    load_failed: bool = False
    ttft_s: float = 0.0
    before_load_s: float = 0.0  # from the request's start to handing the hits over (host)
    load_s: float = 0.0
    prefill_s: float = 0.0  # the forward pass over what was neither cached nor loaded
    # overlapped, on CUDA: (before the hits were accepted, after the load's copies) recorded on
    # the load stream with timing, so a benchmark can tell the copies' time from their delivery
    load_marks: tuple[Any, Any] | None = None


class RefEngine:
    """Greedy generation, one request at a time, over paged KV with a device prefix cache and
    (optionally) kvflow's CPU tier behind it."""

    def __init__(self, model: Llama, kv: PagedKV, kvflow: Any = None, *, overlap: bool = True) -> None:
        self.model, self.kv, self.kvflow = model, kv, kvflow
        self.overlap = overlap
        self.kvflow_s = 0.0  # host time spent inside kvflow's calls (its CPU cost per token)
        self.free: list[int] = list(range(kv.num_blocks - 1, -1, -1))
        self.cached: OrderedDict[int, int] = OrderedDict()  # hash -> block, unreferenced, LRU first
        self.hash_of: dict[int, int] = {}  # block -> its hash, for full cached blocks
        self.pending_free: list[int] = []  # released by a request, maybe still held by kvflow
        self.requests = 0
        self.last_table: list[int] = []  # the last request's block table (for checks)

    # -- device blocks -------------------------------------------------------------------

    def _held(self) -> set[int]:
        return set(self.kvflow.held_device_blocks()) if self.kvflow is not None else set()

    def _settle(self) -> None:
        held = self._held()
        self.free.extend(b for b in self.pending_free if b not in held)
        self.pending_free = [b for b in self.pending_free if b in held]

    def _alloc(self, n: int) -> list[int]:
        self._settle()
        held = self._held()
        while len(self.free) < n and self.cached:
            victim = next((h for h, b in self.cached.items() if b not in held), None)
            if victim is None:
                break
            block = self.cached.pop(victim)
            del self.hash_of[block]
            self.free.append(block)
        if len(self.free) < n:
            raise RuntimeError(f"out of device blocks: need {n}, {len(self.free)} free")
        return [self.free.pop() for _ in range(n)]

    def _release(self, table: list[int]) -> None:
        for block in table:
            h = self.hash_of.get(block)
            if h is not None and h not in self.cached:
                self.cached[h] = block  # stays cached, now evictable
            else:  # a partial block, or a second copy of a cached one
                self.hash_of.pop(block, None)
                self.pending_free.append(block)

    # -- kvflow --------------------------------------------------------------------------

    def _step(self) -> Any:
        import time

        t0 = time.perf_counter()
        compute_done = None
        if self.model.device.type == "cuda" and self.kvflow.manager.state.queued:  # (stores wait on it)
            compute_done = torch.cuda.Event()
            compute_done.record()
        report = self.kvflow.step(compute_done=compute_done)
        self.kvflow_s += time.perf_counter() - t0
        return report

    @staticmethod
    def _outcome(report: Any, job: int) -> tuple[bool, bool] | None:
        """(landed, fenced) if ``report`` tells how the load ``job`` ended, else None."""
        if any(j == job for _, j in report.loads_finished):
            return True, False
        for failure in report.loads_failed:
            if failure.job_id == job:
                return False, failure.fenced
        return None

    def _wait_load(self, job: int, report: Any = None) -> tuple[bool, bool]:
        """Step until the load of ``job`` is over: (landed, fenced)."""
        while True:
            outcome = None if report is None else self._outcome(report, job)
            if outcome is not None:
                return outcome
            report = self._step()

    def _mark(self) -> Any:
        """A timing event on the load stream now (None off CUDA)."""
        stream = self.kvflow.executor.stream("load") if hasattr(self.kvflow.executor, "stream") else None
        if stream is None:
            return None
        event = torch.Event(device=self.model.device, enable_timing=True)
        event.record(stream)
        return event

    def _marks(self, before: Any) -> tuple[Any, Any] | None:
        """(``before``, a timing event after the copies enqueued on the load stream so far)."""
        after = self._mark()
        return None if before is None or after is None else (before, after)

    def _layer_events(self) -> list[Any] | None:
        """Per layer, the event after which its pages (K and V, regions 2i and 2i+1) have
        landed: the last load's group events, else its whole-batch event for every layer."""
        executor = self.kvflow.executor
        groups = executor.load_events() if hasattr(executor, "load_events") else []
        layers = self.model.dims.layers
        if not groups:
            last = executor.last_event("load") if hasattr(executor, "last_event") else None
            return [last] * layers
        return [next(ev for end, ev in groups if end >= 2 * i + 2) for i in range(layers)]

    def _store(self, rid: str, hashes: list[int], table: list[int], first: int, end: int) -> None:
        if self.kvflow is not None and first < end:
            import time

            t0 = time.perf_counter()
            self.kvflow.blocks_computed(rid, hashes[first:end], table[first:end])
            self.kvflow_s += time.perf_counter() - t0

    # -- generation ----------------------------------------------------------------------

    def generate(self, prompt: list[int], max_new: int) -> tuple[list[int], TurnStats]:
        """Greedy tokens after ``prompt`` (``max_new`` of them) and the turn's statistics."""
        for out, stats in self.turn(prompt, max_new):
            pass
        return out, stats

    def turn(self, prompt: list[int], max_new: int) -> Iterator[tuple[list[int], TurnStats]]:
        """``generate`` a token at a time: yields (the tokens so far, the statistics) after the
        first token and after each later one; the request ends when the iterator is
        exhausted. A benchmark interleaves two engines token by token with it."""
        import time

        B = self.kv.block_tokens
        self.requests += 1
        rid = f"req{self.requests}"
        stats = TurnStats(prompt_tokens=len(prompt))
        start_time = time.perf_counter()
        hashes = block_hashes(prompt, B)
        cap = (len(prompt) - 1) // B
        table: list[int] = []
        for h in hashes[:cap]:  # the device prefix cache
            block = self.cached.pop(h, None)
            if block is None:
                break
            table.append(block)
        stats.device_hit_blocks = d = len(table)
        need = (len(prompt) + max_new + B - 1) // B - d
        table += self._alloc(need)
        loaded = 0
        logits = None
        if self.kvflow is not None:
            hits = self.kvflow.lookup(rid, hashes, len(prompt), d)
            if hits:
                t0 = time.perf_counter()
                stats.before_load_s = t0 - start_time
                before = self._mark()
                job = self.kvflow.accept_hits(rid, table[d : d + hits])
                report = None
                if self.overlap:  # hand the load over, then the pass over the new tokens
                    report = self._step()
                    stats.load_marks = self._marks(before)
                    ready = self._layer_events()
                    t_prefill = time.perf_counter()
                    start = (d + hits) * B
                    logits = forward(self.model, self.kv, prompt[start:], start, table, ready)
                    stats.prefill_s = time.perf_counter() - t_prefill
                landed, fenced = self._wait_load(job, report)
                stats.load_s = time.perf_counter() - t0
                if landed:
                    loaded = hits
                else:
                    logits = None  # the pass read pages that never landed: recompute
                    stats.load_failed = True
                    if fenced:  # F15: the late copy may still write them: recompute elsewhere
                        fresh = self._alloc(hits)
                        self.pending_free.extend(table[d : d + hits])
                        table[d : d + hits] = fresh
        stats.loaded_blocks = loaded
        done = d + loaded
        if logits is None:
            t_prefill = time.perf_counter()
            logits = forward(self.model, self.kv, prompt[done * B :], done * B, table)
            stats.prefill_s = time.perf_counter() - t_prefill
        out = [int(logits.argmax())]
        if self.model.device.type == "cuda":
            torch.cuda.synchronize()
        stats.ttft_s = time.perf_counter() - start_time
        full = len(hashes)
        for i, h in enumerate(hashes):
            self.hash_of[table[i]] = h
        self._store(rid, hashes, table, 0, d)  # the device cache's hits, if the tier lost them
        self._store(rid, hashes, table, done, full)
        if self.kvflow is not None:
            self._step()
        yield out, stats
        tokens = prompt + out
        for _ in range(max_new - 1):
            logits = forward(self.model, self.kv, [tokens[-1]], len(tokens) - 1, table)
            if len(tokens) % B == 0:  # this forward pass filled a block
                hashes = block_hashes(tokens, B)
                self.hash_of[table[len(hashes) - 1]] = hashes[-1]
                self._store(rid, hashes, table, len(hashes) - 1, len(hashes))
            out.append(int(logits.argmax()))
            tokens.append(out[-1])
            if self.kvflow is not None:
                self._step()
            yield out, stats
        if self.kvflow is not None:
            self.kvflow.finish_request(rid)  # (kvflow touches the chain it saw, deepest first)
        self._release(table)
        self.last_table = table

    def forget_device_cache(self) -> None:
        """Drop every cached block (as a device cache under pressure would): the next request
        finds its prefix only in kvflow's tier."""
        for block in self.cached.values():
            del self.hash_of[block]
            self.pending_free.append(block)
        self.cached.clear()
        self._settle()
