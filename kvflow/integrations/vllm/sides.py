"""The two halves of kvflow's vLLM KV connector, free of vLLM imports (tested without it).

vLLM splits a KV connector in two: the *scheduler* side decides (which prefix blocks the CPU
tier can load, which computed blocks to store) and the *worker* side copies, with a metadata
object passed from one to the other each step and worker output passed back. kvflow maps
that onto its own split: ``SchedulerSide`` owns the ``OffloadManager`` (decisions, the event
log, the optional trace); ``WorkerSide`` owns the ``TorchExecutor`` over vLLM's KV tensors.
Every executor result crosses back to the scheduler side and is applied there, so the trace
holds the decisions and the workers' outcomes (``kvflow replay`` / ``incidents`` read it).

Ranks: vLLM runs one worker per rank of its world (tensor x pipeline parallel), each with its
own shard of the KV cache, so each ``WorkerSide`` copies its shard and reports its results under
its rank, and the scheduler side's engine has vLLM's world size. A job is done only once every
rank reported it; a job that fails on one rank fails (its load's blocks are recomputed) and
stays fenced until every rank's copy is over (F15).

Block hashes: vLLM's are bytes (a sha256 digest); kvflow's are 64-bit ints, the digest's first
8 bytes, big-endian (as the anchor harness does).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from kvflow.core.commands import JobResult, TierRefused
from kvflow.core.config import DISK_STORE_MODES, MAX_REMOTE_BLOCKS, REMOTE_STORE_MODES, Config
from kvflow.core.errors import ConfigError
from kvflow.core.jobs import LOAD, STORE, TransferJob
from kvflow.core.names import BlockName, tier_names
from kvflow.core.policies.registry import policy_class
from kvflow.core.values import is_int
from kvflow.engine.manager import OffloadManager
from kvflow.engine.notices import StepReport
from kvflow.integrations.vllm.kv_events import BlockRemoved, BlockStored, KVEvent, KVEventPublisher
from kvflow.log.memory import NullLog
from kvflow.log.protocol import Log
from kvflow.log.writer import TraceWriter

if TYPE_CHECKING:  # (torch is imported when a worker registers its KV caches)
    pass


def kvflow_hash(block_hash: bytes | int) -> int:
    """A vLLM block hash as kvflow takes it: whole (vLLM's SHA-256 digest, 256 bits, as an
    int; the shared tiers key entries by all of it), or an int hash as it is."""
    if isinstance(block_hash, (bytes, bytearray)):
        return int.from_bytes(bytes(block_hash[:32]), "big")
    return int(block_hash)


@dataclass(frozen=True)
class ConnectorConfig:
    """``kv_connector_extra_config`` of the vLLM command line, checked.

    Capacity as vLLM, LMCache and SGLang users give it: ``cpu_bytes`` or ``cpu_gb`` (of KV,
    divided by the bytes of one block of this model) or ``cpu_blocks``. ``policy``: ``lru``,
    ``arc`` or a class of one's own as ``"module:Class"`` (docs/policies.md). Faults for tests:
    ``fail_job_ids`` are kvflow job ids whose copy fails, on the ranks ``fail_ranks`` names
    (every rank when it is empty)."""

    cpu_blocks: int | None = None
    cpu_bytes: int | None = None
    policy: str = "lru"
    job_deadline_ms: float = 30_000.0
    trace_path: str | None = None
    checksums: bool = False
    fail_job_ids: tuple[int, ...] = ()
    fail_ranks: tuple[int, ...] = ()
    disk_path: str | None = None
    disk_bytes: int | None = None
    disk_store_mode: str = "ahead_of_eviction"
    disk_key_file: str | None = None  # the disk tier's keys file (kvflow.tiers.keys)
    disk_insecure_no_key: bool = False
    remote_url: str | None = None  # redis:// or rediss:// (a cluster: any one node)
    remote_cluster: bool = False
    remote_mode: str = "write_through"
    remote_blocks: int = 1_000_000  # remote blocks kvflow remembers
    remote_key_file: str | None = None
    remote_insecure_no_key: bool = False
    remote_encrypt: bool = True
    remote_tls: tuple[tuple[str, str], ...] = ()  # redis-py's ssl_* keyword arguments

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorConfig:
        extra = dict(extra or {})
        known = {
            "cpu_blocks",
            "cpu_bytes",
            "cpu_gb",
            "policy",
            "store_mode",
            "job_deadline_ms",
            "trace_path",
            "checksums",
            "fail_job_ids",
            "fail_ranks",
            "disk_path",
            "disk_gb",
            "disk_store_mode",
            "disk_key_file",
            "disk_insecure_no_key",
            *_REMOTE_KEYS,
        }
        unknown = sorted(set(extra) - known)
        if unknown:
            raise ConfigError(f"kv_connector_extra_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        sizes = [k for k in ("cpu_blocks", "cpu_bytes", "cpu_gb") if k in extra]
        if len(sizes) != 1:
            raise ConfigError("kv_connector_extra_config: give exactly one of cpu_blocks, cpu_bytes, cpu_gb")
        if extra.get("store_mode", "eager") != "eager":
            # kvflow's lazy mode stores what the device cache is about to drop; vLLM tells a
            # connector of no such moment (its eviction reuses the block at once)
            raise ConfigError(
                f"kv_connector_extra_config: store_mode {extra['store_mode']!r}: inside vLLM kvflow stores "
                "eagerly (vLLM offers connectors no hook before it reuses an evicted block)"
            )
        cpu_blocks = cpu_bytes = None
        if "cpu_blocks" in extra:
            cpu_blocks = _whole(extra["cpu_blocks"], "cpu_blocks")
        elif "cpu_bytes" in extra:
            cpu_bytes = _whole(extra["cpu_bytes"], "cpu_bytes")
        else:
            gb = extra["cpu_gb"]
            if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not math.isfinite(gb) or gb <= 0:
                raise ConfigError(f"kv_connector_extra_config: cpu_gb must be a number > 0, got {gb!r}")
            cpu_bytes = int(gb * (1 << 30))
        disk_path, disk_bytes = _disk(extra)
        key_file, no_key = extra.get("disk_key_file"), extra.get("disk_insecure_no_key", False)
        if key_file is not None and (not isinstance(key_file, str) or not key_file):
            raise ConfigError(f"kv_connector_extra_config: disk_key_file must be a file's path, got {key_file!r}")
        if not isinstance(no_key, bool):
            raise ConfigError(f"kv_connector_extra_config: disk_insecure_no_key must be true or false, got {no_key!r}")
        if disk_path is not None and key_file is None and not no_key:
            raise ConfigError(
                "kv_connector_extra_config: the disk tier needs a key: disk_key_file (a keys file, see "
                "docs/disk-tier.md), or disk_insecure_no_key: true for a private single-tenant deployment"
            )
        remote = _remote(extra)
        trace_path = extra.get("trace_path")
        if trace_path is not None and (not isinstance(trace_path, str) or not trace_path):
            raise ConfigError(f"kv_connector_extra_config: trace_path must be a file's path, got {trace_path!r}")
        return cls(
            disk_path=disk_path,
            disk_bytes=disk_bytes,
            disk_key_file=key_file,
            disk_insecure_no_key=no_key,
            disk_store_mode=_choice(extra.get("disk_store_mode", "ahead_of_eviction"), "disk_store_mode", DISK_STORE_MODES),
            cpu_blocks=cpu_blocks,
            cpu_bytes=cpu_bytes,
            policy=_policy(extra.get("policy", "lru")),
            job_deadline_ms=_milliseconds(extra.get("job_deadline_ms", 30_000.0), "job_deadline_ms"),
            trace_path=trace_path,
            checksums=_flag(extra.get("checksums", False), "checksums"),
            fail_job_ids=_ids(extra.get("fail_job_ids", []), "fail_job_ids"),
            fail_ranks=_ids(extra.get("fail_ranks", []), "fail_ranks"),
            **remote,
        )

    def disk_blocks(self, block_bytes: int) -> int:
        """The disk tier's capacity in blocks of ``block_bytes`` (0: no disk tier)."""
        if self.disk_bytes is None:
            return 0
        blocks = self.disk_bytes // max(1, block_bytes)
        if blocks <= 0:
            raise ConfigError(f"kv_connector_extra_config: disk_gb holds no block of {block_bytes} bytes")
        return blocks

    def blocks(self, block_bytes: int) -> int:
        """The tier's capacity in blocks of ``block_bytes`` (rounded down)."""
        if self.cpu_blocks is not None:
            return self.cpu_blocks
        blocks = int(self.cpu_bytes or 0) // max(1, block_bytes)
        if blocks <= 0:
            raise ConfigError(f"kv_connector_extra_config: {self.cpu_bytes} bytes hold no block of {block_bytes} bytes")
        return blocks


def check_shared_hashes(config: ConnectorConfig, hash_algo: str, environ: Mapping[str, str]) -> None:
    """A tier that outlives the process (the disk) or is shared between processes (the
    remote tier) is worth something only if every vLLM process names a block the same way:
    refuse (one line, saying what to set) a hash function vLLM seeds at random per process
    (its non-cryptographic ones, unless ``PYTHONHASHSEED`` fixes the seed)."""
    if config.remote_url is not None:
        tier = "the remote tier"
    elif config.disk_path is not None:
        tier = "the disk tier"
    else:
        return
    if hash_algo.startswith("xxhash") and environ.get("PYTHONHASHSEED") is None:
        raise ConfigError(
            f"kv_connector_extra_config: {tier} needs block hashes every vLLM process agrees on, but "
            f"prefix_caching_hash_algo {hash_algo!r} is seeded at random per process: set PYTHONHASHSEED "
            "(the same value for every process) or use sha256"
        )


def _disk(extra: Mapping[str, Any]) -> tuple[str | None, int | None]:
    """``disk_path`` and ``disk_gb``: both or neither."""
    if ("disk_path" in extra) != ("disk_gb" in extra):
        raise ConfigError("kv_connector_extra_config: a disk tier needs both disk_path and disk_gb")
    if "disk_path" not in extra:
        return None, None
    path, gb = extra["disk_path"], extra["disk_gb"]
    if not isinstance(path, str) or not path:
        raise ConfigError(f"kv_connector_extra_config: disk_path must be a directory's path, got {path!r}")
    if isinstance(gb, bool) or not isinstance(gb, (int, float)) or not math.isfinite(gb) or gb <= 0:
        raise ConfigError(f"kv_connector_extra_config: disk_gb must be a number > 0, got {gb!r}")
    return path, int(gb * (1 << 30))


# kv_connector_extra_config's TLS keys -> redis-py's keyword arguments
_REMOTE_TLS = {
    "remote_tls_ca_file": "ssl_ca_certs",
    "remote_tls_cert_file": "ssl_certfile",
    "remote_tls_key_file": "ssl_keyfile",
}
_REMOTE_KEYS = (
    "remote_url", "remote_cluster", "remote_mode", "remote_blocks", "remote_key_file",
    "remote_insecure_no_key", "remote_encrypt", *_REMOTE_TLS,
)  # fmt: skip


def _remote(extra: Mapping[str, Any]) -> dict[str, Any]:
    """The remote tier's keys, checked (each value in one line naming its key); none of them
    without ``remote_url``."""
    given = [k for k in _REMOTE_KEYS if k in extra]
    if "remote_url" not in extra:
        if given:
            raise ConfigError(f"kv_connector_extra_config: {given[0]} needs remote_url (the remote tier's server)")
        return {}
    url = extra["remote_url"]
    if not isinstance(url, str) or not url.startswith(("redis://", "rediss://")):
        raise ConfigError(f"kv_connector_extra_config: remote_url must be a redis:// or rediss:// URL, got {url!r}")
    cluster = _flag(extra.get("remote_cluster", False), "remote_cluster")
    from kvflow.tiers.redis_store import check_url  # (redis-py: imported only with a remote tier)

    try:
        check_url(url, cluster)
    except ConfigError as exc:
        raise ConfigError(f"kv_connector_extra_config: remote_url: {exc}") from None
    key_file, no_key = extra.get("remote_key_file"), extra.get("remote_insecure_no_key", False)
    if key_file is not None and (not isinstance(key_file, str) or not key_file):
        raise ConfigError(f"kv_connector_extra_config: remote_key_file must be a file's path, got {key_file!r}")
    if not isinstance(no_key, bool):
        raise ConfigError(f"kv_connector_extra_config: remote_insecure_no_key must be true or false, got {no_key!r}")
    if key_file is None and not no_key:
        raise ConfigError(
            "kv_connector_extra_config: the remote tier needs a key: remote_key_file (a keys file, see "
            "docs/tier-keys.md), or remote_insecure_no_key: true for a private single-tenant deployment"
        )
    tls = []
    for name, kwarg in _REMOTE_TLS.items():
        path = extra.get(name)
        if path is not None:
            if not isinstance(path, str) or not path:
                raise ConfigError(f"kv_connector_extra_config: {name} must be a file's path, got {path!r}")
            tls.append((kwarg, path))
    return {
        "remote_url": url,
        "remote_cluster": cluster,
        "remote_mode": _choice(extra.get("remote_mode", "write_through"), "remote_mode", REMOTE_STORE_MODES),
        "remote_blocks": _remote_blocks(extra.get("remote_blocks", 1_000_000)),
        "remote_key_file": key_file,
        "remote_insecure_no_key": no_key,
        "remote_encrypt": _flag(extra.get("remote_encrypt", True), "remote_encrypt"),
        "remote_tls": tuple(tls),
    }


def _remote_blocks(value: Any) -> int:
    if not is_int(value) or not 0 < value <= MAX_REMOTE_BLOCKS:
        raise ConfigError(
            f"kv_connector_extra_config: remote_blocks must be a whole number in 1..{MAX_REMOTE_BLOCKS:,}, got {value!r}"
        )
    return int(value)


def _choice(value: Any, name: str, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ConfigError(f"kv_connector_extra_config: {name} must be one of {', '.join(choices)}, got {value!r}")
    return str(value)


def _policy(value: Any) -> str:
    """A built-in policy's name or a class of one's own as ``"module:Class"``, loaded and
    checked now, so a policy that cannot be used fails before vLLM starts."""
    try:
        policy_class(value)
    except ConfigError as exc:
        raise ConfigError(f"kv_connector_extra_config: {exc}") from None
    return str(value)


def _flag(value: Any, name: str) -> bool:
    """JSON's true or false: a string (even "false") is an error, never read as a truth value."""
    if not isinstance(value, bool):
        raise ConfigError(f"kv_connector_extra_config: {name} must be true or false, got {value!r}")
    return value


def _milliseconds(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"kv_connector_extra_config: {name} must be a number of milliseconds > 0, got {value!r}")
    return float(value)


def _ids(value: Any, name: str) -> tuple[int, ...]:
    """A list of whole numbers >= 0 (job ids, ranks)."""
    if not isinstance(value, (list, tuple)) or not all(is_int(v) and v >= 0 for v in value):
        raise ConfigError(f"kv_connector_extra_config: {name} must be a list of whole numbers >= 0, got {value!r}")
    return tuple(value)


def _whole(value: Any, name: str) -> int:
    if not is_int(value) or value <= 0:
        raise ConfigError(f"kv_connector_extra_config: {name} must be a whole number > 0, got {value!r}")
    return value


_PREFIX = "kv_connector_extra_config: "


def _now(now_ms: float | None) -> float:
    return time.monotonic() * 1000.0 if now_ms is None else now_ms


class StepPlan(msgspec.Struct, frozen=True):
    """Scheduler -> worker, once per step: the jobs to run, and the requests whose blocks vLLM
    keeps until their stores are over (``request_finished`` returned True for them), and the
    requests preempted this step (their copies must end before vLLM reuses their blocks)."""

    jobs: list[TransferJob] = []
    delayed_free: list[str] = []
    preempted: list[str] = []
    probes: list[BlockName] = []  # blocks every worker's remote tier is asked about


# the tiers whose entries are read back from outside the process: their refusals are counted
SHARED_TIERS = ("remote", "disk")

# how long a block some rank's remote tier answered absent is taken as absent, by the scheduler
# side and by each worker's tier (a request waiting for its turn looks its prefix up every step)
ABSENT_TTL_MS = 1000.0


@dataclass
class _Tracked:
    """What the scheduler side remembers of a live vLLM request."""

    hashes: list[int] = field(default_factory=list)  # kvflow hashes of its full blocks (whole)
    keys: Sequence[int] = ()  # their keys (kvflow.core.names): what the decisions name them by
    tenant: str | None = None  # vLLM's cache_salt
    tokens: Sequence[int] = ()  # its token ids (vLLM's list: for the KV events of its blocks)
    block_ids: list[int] = field(default_factory=list)  # its device blocks, in order
    next_store: int = 0  # blocks before this are stored, deduplicated or being loaded
    device_hit: int = 0  # blocks vLLM's own prefix cache had at the lookup
    load_job: int | None = None
    load_range: tuple[int, int] = (0, 0)  # [first, end) blocks the load brings


class SchedulerSide:
    """kvflow's decisions behind vLLM's scheduler hooks, for vLLM's ``world_size`` workers."""

    def __init__(self, config: ConnectorConfig, block_tokens: int, block_bytes: int, world_size: int = 1) -> None:
        self.block_tokens = block_tokens
        cpu_blocks = config.blocks(block_bytes)
        self.config = Config(
            cpu_blocks=cpu_blocks,
            block_tokens=block_tokens,
            policy=config.policy,
            job_deadline_ms=config.job_deadline_ms,
            world_size=world_size,
            disk_blocks=config.disk_blocks(block_bytes),
            disk_store_mode=config.disk_store_mode,
            remote_blocks=config.remote_blocks if config.remote_url is not None else 0,
            remote_store_mode=config.remote_mode,
        )
        self._world_size = world_size
        # the remote tier's probes: every rank's tier is asked (its own shard); a block is
        # found once every rank found it, absent (for ABSENT_TTL_MS) once one did not
        self._to_probe: dict[int, BlockName] = {}  # for the next plan
        self._probing: dict[int, tuple[float, dict[int, bool]]] = {}  # key -> (asked at, rank -> found)
        self._absent_until: dict[int, float] = {}
        self._held_since: dict[str, float] = {}  # requests held back ("ask later"), since when
        self.remote_found = 0
        # a warm restart: each rank's disk tier sends what its journal vouches for once; the
        # entries every rank holds are indexed when the last rank's list came
        self._disk_entries: dict[int, list[tuple[int, BlockName]]] | None = {}
        self.disk_restored = 0
        log: Log = NullLog()
        if config.trace_path:
            log = TraceWriter(config.trace_path, self.config, meta={"engine": "vllm"})
        self.manager = OffloadManager(self.config, log=log)
        self._kv_events = KVEventPublisher(block_tokens)
        self.manager.subscribe(self._kv_events)
        # kvflow key -> vLLM's own hash of the block, so KV events name blocks as vLLM does,
        # and -> (its parent's key, its token ids) for a block stored, so they carry both
        self._vllm_hash: dict[int, bytes | int] = {}
        self._block_of: dict[int, tuple[int | None, tuple[int, ...]]] = {}
        self.requests: dict[str, _Tracked] = {}
        self._load_failed: set[str] = set()  # live requests whose load failed: no more hits
        self._delayed: list[str] = []
        self._waiting_free: set[str] = set()
        self.loads_landed = 0
        self.loads_failed = 0
        self._closed = False

    # -- lookup and allocation -------------------------------------------------------------

    def matched_tokens(
        self,
        request_id: str,
        block_hashes: Sequence[bytes | int],
        num_tokens: int,
        num_computed_tokens: int,
        tenant: str | None = None,
        token_ids: Sequence[int] = (),
        now_ms: float | None = None,
    ) -> int | None:
        """How many tokens after the ``num_computed_tokens`` vLLM has can come from the tier.
        A request whose load failed is offered nothing again: vLLM recomputes its blocks
        (a load that keeps failing must not loop lookup -> load -> fail). ``None``: ask again
        next step (a lower tier is loading blocks past the hits, or the remote tier is being
        asked about them; never longer than the job deadline for one request). ``tenant``: the request's
        ``cache_salt`` (F21: its blocks never hit for another salt); ``token_ids``: its tokens
        (for the KV events of the blocks it stores)."""
        if request_id in self._load_failed:
            return 0
        if self._disk_entries is not None and self.manager.state.disk is not None:
            return None  # the workers' disk tiers have not said yet what they hold (first step)
        tracked = self.requests.setdefault(request_id, _Tracked())
        tracked.hashes = [kvflow_hash(h) for h in block_hashes]
        tracked.tenant = tenant or None
        tracked.tokens = token_ids
        tracked.keys = self.manager.keys(tracked.hashes, tenant)
        self._vllm_hash.update(zip(tracked.keys, block_hashes))
        tracked.device_hit = num_computed_tokens // self.block_tokens
        now = _now(now_ms)
        asking = False
        if self.config.remote:
            hits, wanted, names = self.manager.lookup_and_probe(
                request_id, tracked.hashes, num_tokens, tracked.device_hit, tenant
            )
            self._ask(wanted, names, now)
            start = tracked.device_hit + hits
            # the block right after the hits is being asked about: its answer may extend them
            asking = bool(wanted) and start < len(tracked.keys) and wanted[0] == tracked.keys[start]
            asking = asking and (wanted[0] in self._to_probe or wanted[0] in self._probing)
        else:
            hits = self.manager.lookup(request_id, tracked.hashes, num_tokens, tracked.device_hit, tenant)
        if asking or self.manager.arriving(tracked.hashes, num_tokens, tracked.device_hit, tenant):
            # the blocks after the hits are on their way from a lower tier, or the remote tier
            # is being asked about them: hold the request back (vLLM asks again next step) so
            # that its next lookup hits them here, for one job deadline at most
            since = self._held_since.setdefault(request_id, now)
            if now - since < self.config.job_deadline_ms:
                self.manager.accept_hits(request_id, [])
                return None
        self._held_since.pop(request_id, None)
        return hits * self.block_tokens

    def _ask(self, wanted: Sequence[int], names: Sequence[BlockName], now: float) -> None:
        """Queue the remote tier's probe of ``wanted`` blocks (each once while asked, not again
        while answered absent)."""
        if not wanted:
            return
        absent, probing, to_probe = self._absent_until, self._probing, self._to_probe
        for key, name in zip(wanted, names or tier_names(wanted, ())):
            if key not in to_probe and key not in probing and absent.get(key, 0.0) <= now:
                to_probe[key] = name

    def _probed(self, answers: Mapping[int, tuple[Sequence[int], Sequence[int]]], now: float) -> list[int]:
        """The workers' probe answers (rank -> (keys asked and over, keys found)): the keys
        every rank found (the manager records them); a key one rank did not find is absent."""
        everywhere: list[int] = []
        probing, world = self._probing, self._world_size
        for rank, (asked, found) in sorted(answers.items()):
            if not 0 <= rank < world:
                continue
            there = set(found)
            for key in asked:
                entry = probing.get(key)
                if entry is None:
                    continue
                entry[1][rank] = key in there
                if len(entry[1]) == world:
                    del probing[key]
                    if all(entry[1].values()):
                        everywhere.append(key)
                    else:
                        self._absent_until[key] = now + ABSENT_TTL_MS
        self.remote_found += len(everywhere)
        return everywhere

    def _plan_probes(self, now: float) -> list[BlockName]:
        """The probes for this step's plan; a probe some rank never answered (its tier lost
        it) is forgotten after one job deadline, and so are absent answers that expired."""
        deadline = self.config.job_deadline_ms
        probing = self._probing
        for key in [k for k, (asked, _) in probing.items() if now - asked >= deadline]:
            del probing[key]
        if len(self._absent_until) > 4 * self.config.cpu_blocks:
            self._absent_until = {k: t for k, t in self._absent_until.items() if t > now}
        out, self._to_probe = list(self._to_probe.values()), {}
        for name in out:
            probing[name.key] = (now, {})
        return out

    def allocated(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """vLLM allocated the request's blocks: load the hits it took into the blocks after
        its own prefix hits (as counted at the lookup: the request's ``num_computed_tokens``
        is not updated yet here), or release them."""
        tracked = self.requests.setdefault(request_id, _Tracked())
        tracked.block_ids = list(block_ids)
        n = num_external_tokens // self.block_tokens
        if request_id not in self.manager.state.requests:
            return
        if n <= 0:
            if self.manager.state.requests[request_id].offered:
                self.manager.accept_hits(request_id, [])
            return
        first = tracked.device_hit
        job = self.manager.accept_hits(request_id, tracked.block_ids[first : first + n])
        tracked.load_job = job
        tracked.load_range = (first, first + n)

    # -- each step ---------------------------------------------------------------------------

    def step(
        self,
        scheduled: Iterable[tuple[str, int, Sequence[int] | None, bool]],
        preempted: Sequence[str],
        now_ms: float | None = None,
    ) -> StepPlan:
        """One scheduler step: ``scheduled`` lists (request, tokens it will have computed after
        this step, new block ids or None, whether the ids replace the old ones). Stores the
        blocks that become full; the manager's step then times out what is overdue and plans
        every queued job, for the workers."""
        now = _now(now_ms)
        for request_id in preempted:
            self.requests.pop(request_id, None)
            self._held_since.pop(request_id, None)
            self.manager.finish_request(request_id, preempted=True)
        for request_id, computed_after, new_ids, replace in scheduled:
            tracked = self.requests.get(request_id)
            if tracked is None:
                continue
            if new_ids is not None:
                tracked.block_ids = list(new_ids) if replace else tracked.block_ids + list(new_ids)
            self._store_full_blocks(request_id, tracked, computed_after)
        jobs, report = self.manager.step(now)
        self._told(report)
        delayed, self._delayed = self._delayed, []
        probes = self._plan_probes(now) if self.config.remote else []
        return StepPlan(jobs=jobs, delayed_free=delayed, preempted=list(preempted), probes=probes)

    def _store_full_blocks(self, request_id: str, tracked: _Tracked, computed_after: int) -> None:
        full = min(computed_after // self.block_tokens, len(tracked.hashes), len(tracked.block_ids))
        start = tracked.next_store
        if full <= start:
            return
        first, end = tracked.load_range
        for a, b in ((start, min(full, first)), (max(start, end), full)):
            if a < b:
                self.manager.blocks_computed(
                    request_id, tracked.hashes[a:b], tracked.block_ids[a:b], tracked.tenant
                )
        keys, tokens, size = tracked.keys, tracked.tokens, self.block_tokens
        if len(tokens) >= min(full, len(keys)) * size:
            for i in range(start, min(full, len(keys))):
                self._block_of[keys[i]] = (keys[i - 1] if i else None, tuple(tokens[i * size : (i + 1) * size]))
        tracked.next_store = full

    def disk_entries(self, by_rank: Mapping[int, Sequence[tuple[int, BlockName]]]) -> None:
        """A worker's disk tier sent what it held at start (a warm restart): once every rank's
        list came, the entries all of them hold join the disk index."""
        waiting = self._disk_entries
        if self.manager.state.disk is None or waiting is None:
            return
        waiting.update({rank: list(entries) for rank, entries in by_rank.items()})
        if len(waiting) < self._world_size:
            return
        everywhere = sorted(set.intersection(*(set(entries) for entries in waiting.values())), key=lambda e: e[0])
        self._disk_entries = None
        self.disk_restored = self.manager.disk_restored(everywhere) if everywhere else 0

    def results(
        self,
        results: Sequence[JobResult],
        now_ms: float | None = None,
        refusals: Sequence[TierRefused] = (),
        probes: Mapping[int, tuple[Sequence[int], Sequence[int]]] | None = None,
    ) -> None:
        """The workers' outcomes for this step (every rank's), applied by the manager's step
        (each is recorded in the trace; one it refuses is logged and the rest applied, F2),
        the entries their shared tiers refused (recorded; dropped from the tier's index), and
        their remote tiers' probe answers (``probes``: rank -> (keys asked and over, keys
        found); what every rank found is recorded as found remotely).
        Jobs are not planned here: they go to the workers with the next step's metadata."""
        now = _now(now_ms)
        found = self._probed(probes, now) if probes else []
        _, report = self.manager.step(now, results, refusals=refusals, found=found, plan=False)
        self._told(report)
        if not self._closed:
            self.manager.log.flush()  # each step on disk: vLLM may end its engine process without shutdown()

    def _told(self, report: StepReport) -> None:
        """What a step's report tells the connector: loads landed or failed (a request whose
        load failed is offered no hits again)."""
        self.loads_landed += len(report.loads_finished)
        self.loads_failed += len(report.loads_failed)
        self._load_failed.update(f.request_id for f in report.loads_failed)

    def finished(self, request_id: str) -> bool:
        """The request ended: its pins are released and kvflow touches its chain (the hashes
        its lookups and stores named) deepest first (F14, ``Config.chain_recency``). True when
        a store of it still reads its blocks: vLLM must keep them until the worker reports the
        request's saves over."""
        self.requests.pop(request_id, None)
        self._held_since.pop(request_id, None)
        self._load_failed.discard(request_id)
        self.manager.finish_request(request_id)
        storing = any(
            job.direction == STORE and job.request_id == request_id for job in self.manager.state.jobs.values()
        )
        if storing:
            self._delayed.append(request_id)
        return storing

    def take_kv_events(self) -> list[KVEvent]:
        """The tier's KV events since the last call, naming blocks by vLLM's own hashes."""
        events = self._kv_events.take()
        if not events:
            return []
        original, block_of = self._vllm_hash, self._block_of
        out: list[KVEvent] = []
        for event in events:
            if isinstance(event, BlockStored):
                named = [original.get(h, h) if isinstance(h, int) else h for h in event.block_hashes]
                blocks = [block_of[h] for h in event.block_hashes if isinstance(h, int) and h in block_of]
                if blocks and len(blocks) == len(event.block_hashes):
                    parent = blocks[0][0]
                    out.append(
                        msgspec.structs.replace(
                            event,
                            block_hashes=named,
                            parent_block_hash=None if parent is None else original.get(parent),
                            token_ids=[t for _, tokens in blocks for t in tokens],
                            seq=0,
                        )
                    )
                else:
                    out.append(msgspec.structs.replace(event, block_hashes=named, seq=0))
            elif isinstance(event, BlockRemoved):
                named = [original.get(h, h) if isinstance(h, int) else h for h in event.block_hashes]
                out.append(msgspec.structs.replace(event, block_hashes=named, seq=0))
            else:
                out.append(msgspec.structs.replace(event, seq=0))
        if len(original) > 4 * self.config.cpu_blocks:  # forget blocks no tier holds nor any request asks for
            asked = {k for tracked in self.requests.values() for k in tracked.keys}
            knows = self.manager.knows
            self._vllm_hash = {h: v for h, v in original.items() if h in asked or knows(h)}
            self._block_of = {h: v for h, v in block_of.items() if h in asked or knows(h)}
        return out

    def close(self) -> None:
        """End the trace (its last checkpoint). Idempotent: vLLM may shut down twice."""
        if not self._closed:
            self._closed = True
            self.manager.close()


class WorkerSide:
    """kvflow's copies behind vLLM's worker hooks: a ``TorchExecutor`` over this worker's KV
    tensors (its shard), reporting under vLLM's ``rank`` of this worker."""

    def __init__(
        self, config: ConnectorConfig, rank: int = 0, model: str = "", block_tokens: int = 16, world_size: int = 1
    ) -> None:
        """``model`` names the KV's model and dtype: with the page sizes and this worker's rank
        of ``world_size`` it is the layout identity of the disk tier's entries (a directory
        written under another starts empty)."""
        self.config = config
        self.rank = rank
        self.world_size = world_size
        self.model = model
        self.block_tokens = block_tokens
        self.executor: Any = None  # a TorchExecutor, behind a disk tier when there is one
        self._disk_entries: list[tuple[int, BlockName]] | None = None  # to send once
        self._jobs: dict[int, TransferJob] = {}  # submitted, not reported
        self._pending_loads: list[TransferJob] = []
        self._pending_stores: list[TransferJob] = []
        self._results: list[JobResult] = []
        self._recving: set[str] = set()
        self._load_errors: set[int] = set()
        self._delayed: set[str] = set()
        self._stats: dict[str, int] = {}  # since the last take_stats (vLLM's connector stats)
        self._rejected_seen: dict[str, dict[str, int]] = {}  # tier -> reason -> refusals taken
        self.block_bytes = 0

    def register(self, kv_caches: Mapping[str, Any]) -> int:
        """Build the executor over vLLM's KV tensors (block dimension first, as vLLM lays them
        out); the host pool is sized once. Returns the bytes of one block (all layers)."""
        from kvflow.executors.torch.executor import TorchExecutor
        from kvflow.executors.torch.layout import KVLayout

        layout = KVLayout.from_caches(dict(kv_caches), block_dim=0)
        self.block_bytes = int(layout.block_bytes)
        cpu_blocks = self.config.blocks(layout.block_bytes)
        executor: Any = TorchExecutor(
            dict(kv_caches),
            cpu_blocks,
            block_dim=0,
            rank=self.rank,
            checksums=self.config.checksums,
            fail_job_ids=self.config.fail_job_ids if self.rank in self.config.fail_ranks or not self.config.fail_ranks else (),
        )
        try:  # (a tier's refusal, its keys file's, its server's: one line naming where it came from)
            self.executor = self._tiers(executor, cpu_blocks, layout.block_bytes)
        except ConfigError as exc:
            text = str(exc)
            raise ConfigError(text if text.startswith(_PREFIX) else _PREFIX + text) from None
        return int(layout.block_bytes)

    def _tiers(self, executor: Any, cpu_blocks: int, block_bytes: int) -> Any:
        """``executor`` behind this rank's disk and remote tiers, as configured."""
        disk_blocks = self.config.disk_blocks(block_bytes)
        if disk_blocks and self.config.disk_path:
            from kvflow.tiers.disk_executor import disk_tier
            from kvflow.tiers.keys import TierKeys

            key_file = self.config.disk_key_file
            # each rank keeps its own shard of every block, in a directory of its own
            tier = disk_tier(
                executor,
                Config(cpu_blocks=cpu_blocks, block_tokens=self.block_tokens, disk_blocks=disk_blocks),
                os.path.join(self.config.disk_path, f"rank-{self.rank}"),
                model=self.model,
                ranks=(self.rank,),
                keys=TierKeys.from_file(key_file) if key_file is not None else None,
                insecure_no_key=self.config.disk_insecure_no_key,
                shard=(self.rank, self.world_size),
            )
            self._disk_entries = tier.disk_entries()
            executor = tier
        if self.config.remote_url is not None:
            executor = self._remote_tier(executor, cpu_blocks)
        return executor

    def _remote_tier(self, executor: Any, cpu_blocks: int) -> Any:
        """``executor`` behind this rank's remote tier: its shard of every block, under the
        layout identity of this rank of the world (ranks never read each other's shard),
        reporting its jobs for this rank alone."""
        from kvflow.tiers.keys import TierKeys
        from kvflow.tiers.redis_store import redis_tier

        config = self.config
        assert config.remote_url is not None
        key_file = config.remote_key_file
        tls: dict[str, Any] = dict(config.remote_tls)
        return redis_tier(
            executor,
            Config(
                cpu_blocks=cpu_blocks,
                block_tokens=self.block_tokens,
                job_deadline_ms=config.job_deadline_ms,
                remote_blocks=config.remote_blocks,
                remote_store_mode=config.remote_mode,
            ),
            config.remote_url,
            model=self.model,
            cluster=config.remote_cluster,
            keys=TierKeys.from_file(key_file) if key_file is not None else None,
            encrypt=config.remote_encrypt,
            insecure_no_key=config.remote_insecure_no_key,
            shard=(self.rank, self.world_size),
            ranks=(self.rank,),
            absent_ttl_s=ABSENT_TTL_MS / 1000.0,
            **tls,
        )

    def take_probed(self) -> tuple[list[int], list[int]] | None:
        """This rank's remote tier's probe answers since the last call: (keys asked and over,
        keys found), or None when there are none (or no remote tier)."""
        take = getattr(self.executor, "take_probed", None)
        if take is None:
            return None
        asked, found = take()
        return (asked, found) if asked else None

    def take_refused(self) -> list[TierRefused]:
        """The entries this rank's disk tier refused since the last call (for the scheduler
        side, which records them)."""
        take = getattr(self.executor, "take_refused", None)
        return take() if take is not None else []

    def take_disk_entries(self) -> list[tuple[int, BlockName]] | None:
        """What this rank's disk tier held when it opened, once (then None)."""
        out, self._disk_entries = self._disk_entries, None
        return out

    def bind(self, plan: StepPlan) -> None:
        # (the disk tier's jobs read and write host slots only: they start with the loads)
        self._pending_loads = [j for j in plan.jobs if j.direction != STORE]
        self._pending_stores = [j for j in plan.jobs if j.direction == STORE]
        self._delayed.update(plan.delayed_free)
        if plan.probes and self.executor is not None and hasattr(self.executor, "probe"):
            self.executor.probe([n.key for n in plan.probes], plan.probes)
        if plan.preempted:
            self._wait_for(set(plan.preempted))

    def start_loads(self) -> None:
        """Before the forward pass. (A loading request is not scheduled until its load is
        reported over, so nothing of this step reads the blocks being loaded.)"""
        self._submit(self._pending_loads, None)
        self._pending_loads = []

    def start_stores(self) -> None:
        """After the forward pass was enqueued: the copies wait for an event recorded on the
        compute stream now (F9), so they read the blocks this step computed. (On the CPU the
        forward pass is over already: no event is needed.)"""
        if not self._pending_stores:
            return
        compute_done = None
        if self.executor is not None:
            from kvflow.executors.torch.streams import compute_done_event  # (torch lives there)

            compute_done = compute_done_event(self.executor.device)
        self._submit(self._pending_stores, compute_done)
        self._pending_stores = []

    def _submit(self, jobs: list[TransferJob], compute_done: Any) -> None:
        if not jobs or self.executor is None:
            return
        for job in jobs:
            self._jobs[job.job_id] = job
        try:
            self.executor.submit(jobs, compute_done)
        except Exception as exc:  # F2: a failed submission fails its jobs, never the engine
            for job in jobs:
                self._accept(JobResult(job_id=job.job_id, rank=self.rank, ok=False, error=f"submit failed: {exc!r}"))

    def poll(self) -> None:
        if self.executor is None:
            return
        for result in self.executor.poll():
            self._accept(result)

    def _accept(self, result: JobResult) -> None:
        self._results.append(result)
        job = self._jobs.pop(result.job_id, None)
        if job is not None:
            kind = f"{job.direction}_{'ok' if result.ok else 'failed'}"
            stats = self._stats
            stats[f"{kind}_jobs"] = stats.get(f"{kind}_jobs", 0) + 1
            blocks = len(job.device_blocks if job.direction in (LOAD, STORE) else job.hashes)
            stats[f"{kind}_blocks"] = stats.get(f"{kind}_blocks", 0) + blocks
            if result.ok:
                moved = blocks * self.block_bytes
                stats[f"{job.direction}_bytes"] = stats.get(f"{job.direction}_bytes", 0) + moved
        if job is None or job.direction != LOAD or job.request_id is None:
            return
        self._recving.add(job.request_id)
        if not result.ok:
            self._load_errors.update(job.device_blocks)

    def _wait_for(self, requests: set[str], timeout_s: float = 60.0) -> None:
        """Block until no copy of ``requests`` runs (vLLM frees a preempted request's blocks)."""
        deadline = time.monotonic() + timeout_s
        while any(j.request_id in requests for j in self._jobs.values()) and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.0005)

    def finished(self) -> tuple[set[str], set[str]]:
        """(requests whose delayed stores are over, requests whose load is over)."""
        self.poll()
        busy = {j.request_id for j in self._jobs.values() if j.direction == STORE}
        sending = {r for r in self._delayed if r not in busy}
        self._delayed -= sending
        recving, self._recving = self._recving, set()
        return sending, recving

    def take_results(self) -> list[JobResult]:
        out, self._results = self._results, []
        return out

    def take_stats(self) -> dict[str, int]:
        """Jobs, blocks and bytes by direction and outcome since the last call, and the values
        this rank's shared tiers refused to serve since then, by reason
        (``remote_rejected:<reason>``, ``disk_rejected:<reason>``: ``kvflow.tiers.entry.REJECTED``)."""
        out, self._stats = self._stats, {}
        for tier in SHARED_TIERS:
            # (tiers stack: each answers for the tiers it wraps; the counts are totals)
            counts = getattr(self.executor, f"{tier}_rejected", None) if self.executor is not None else None
            if counts is None:
                continue
            seen = self._rejected_seen.setdefault(tier, {})
            for reason, total in counts().items():
                if total > seen.get(reason, 0):
                    out[f"{tier}_rejected:{reason}"] = total - seen.get(reason, 0)
                    seen[reason] = total
        return out

    def take_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors, set()
        return out

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
