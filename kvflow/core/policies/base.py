"""The eviction-policy interface: a base class whose subclasses implement a few single-block
methods.

A policy orders the CPU tier's resident blocks and says which to give up. It is *part of the
state*: the state calls ``insert``, ``touch``, ``refresh`` and ``remove`` as events are applied,
so that folding a trace rebuilds it exactly, and asks ``victims`` when it needs room. It is
never asked to decide *when* to evict, nor anything about pins, jobs or slots: the state owns
those, and checks every ``victims`` answer before acting on it (``PolicyError`` otherwise).

A policy must be deterministic (no clock, no randomness, no iteration of a set), or a trace
would not re-decide the same. The bulk forms the state calls, one call per event, apply the
single-block method to each hash in order; they are written once, here. The built-in policies
are ``RunPolicy``s, each rule written once over a run of hashes (docs/performance.md,
"Policies"); a subclass that redefines a single-block method gets this loop for its bulk form
again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

from kvflow.core.errors import PolicyError, one_line

_BULK_FORMS = {"insert": "insert_many", "touch": "touch_many", "refresh": "refresh_many", "remove": "remove_many"}
"""Each single-block method the state calls and its bulk form."""


class Policy(ABC):
    """Subclass it, implement the abstract methods, and name the class in ``Config(policy=
    "package.module:ClassName")``. The class is built as ``cls(capacity)``, ``capacity`` being
    the tier's size in blocks. A block is named by its hash, an ``int``."""

    __slots__ = ()

    def __init__(self, capacity: int) -> None:
        """``capacity``: the tier's size in blocks (a policy may ignore it)."""

    def __init_subclass__(cls, **kwargs: object) -> None:
        """A bulk form applies the class's own single-block method: a class that redefines
        one without its bulk form gets the loop below for it, whatever its parent had (a
        built-in policy's bulk forms are written for its own single-block methods)."""
        super().__init_subclass__(**kwargs)
        for single, bulk in _BULK_FORMS.items():
            if single in cls.__dict__ and bulk not in cls.__dict__:
                setattr(cls, bulk, getattr(Policy, bulk))

    @abstractmethod
    def insert(self, block_hash: int) -> None:
        """``block_hash`` became resident (its store completed). It was not resident before."""

    @abstractmethod
    def touch(self, block_hash: int) -> None:
        """``block_hash`` (resident) was used again."""

    def refresh(self, block_hash: int) -> None:
        """``block_hash`` (resident) is reordered without counting as a new use (a request's
        end orders its chain deepest first). By default, a touch."""
        self.touch(block_hash)

    @abstractmethod
    def remove(self, block_hash: int) -> None:
        """``block_hash`` (resident) left the tier: evicted, or dropped as corrupt."""

    @abstractmethod
    def victims(self, num_blocks: int, pinned: Callable[[int], bool]) -> list[int] | None:
        """The ``num_blocks`` resident hashes to evict, in eviction order, none of them one
        for which ``pinned(block_hash)`` is true; or ``None`` when fewer than ``num_blocks``
        are not pinned (all or nothing). Must not change the policy: the state calls
        ``remove`` for each victim when the eviction is applied."""

    @abstractmethod
    def resident(self) -> list[int]:
        """Every resident hash, in the policy's order (coldest first, where it has one)."""

    @abstractmethod
    def clear(self) -> None:
        """Forget everything (the tier was reset)."""

    def snapshot(self) -> object:
        """What drives the policy's decisions, as plain lists, ints and strings: it goes into
        the state digest that traces record. By default the resident hashes in order; a
        policy that keeps more (counts, ghosts) includes it."""
        return self.resident()

    def __len__(self) -> int:
        """How many hashes are resident."""
        return len(self.resident())

    # The bulk forms: one call per event (a store's, a touch's, an eviction's hashes). Each
    # applies the single-block method to every hash in order; an exception a policy raises
    # becomes a PolicyError naming the policy, the call and the hash.

    def insert_many(self, hashes: tuple[int, ...]) -> None:
        """``insert`` of each hash, in order (a store's: distinct, none resident)."""
        insert = self.insert
        try:
            for block_hash in hashes:
                insert(block_hash)
        except Exception as exc:
            raise self._failed("insert", block_hash, exc) from exc

    def touch_many(self, hashes: tuple[int, ...]) -> None:
        """``touch`` of each hash, in order (resident; a hash may come twice)."""
        touch = self.touch
        try:
            for block_hash in hashes:
                touch(block_hash)
        except Exception as exc:
            raise self._failed("touch", block_hash, exc) from exc

    def refresh_many(self, hashes: tuple[int, ...]) -> None:
        """``refresh`` of each hash, in order (resident; a hash may come twice)."""
        refresh = self.refresh
        try:
            for block_hash in hashes:
                refresh(block_hash)
        except Exception as exc:
            raise self._failed("refresh", block_hash, exc) from exc

    def remove_many(self, hashes: tuple[int, ...]) -> None:
        """``remove`` of each hash, in order (an eviction's: distinct, resident)."""
        remove = self.remove
        try:
            for block_hash in hashes:
                remove(block_hash)
        except Exception as exc:
            raise self._failed("remove", block_hash, exc) from exc

    def _failed(self, method: str, block_hash: int, exc: Exception) -> PolicyError:
        return PolicyError(f"policy {policy_name(self)!r}: {method}({block_hash}) raised {one_line(exc)}")


class RunPolicy(Policy):
    """A policy whose rules are each written once, over a run of hashes (the built-in ones):
    it implements ``_insert``, ``_touch``, ``_refresh`` and ``_remove`` of a tuple of hashes,
    each stopping at the first hash it cannot take with ``KeyError(hash)`` or
    ``AlreadyResident(hash)``. The state calls the bulk forms, one call per event (a run), and
    a single-block method is its run of one (docs/performance.md, "Policies")."""

    __slots__ = ()

    @abstractmethod
    def _insert(self, hashes: tuple[int, ...]) -> None: ...

    @abstractmethod
    def _touch(self, hashes: tuple[int, ...]) -> None: ...

    @abstractmethod
    def _refresh(self, hashes: tuple[int, ...]) -> None: ...

    @abstractmethod
    def _remove(self, hashes: tuple[int, ...]) -> None: ...

    def insert(self, block_hash: int) -> None:
        self._insert((block_hash,))

    def touch(self, block_hash: int) -> None:
        self._touch((block_hash,))

    def refresh(self, block_hash: int) -> None:
        self._refresh((block_hash,))

    def remove(self, block_hash: int) -> None:
        self._remove((block_hash,))

    def insert_many(self, hashes: tuple[int, ...]) -> None:
        try:
            self._insert(hashes)
        except AlreadyResident as exc:
            raise self._failed("insert", exc.args[0], exc) from exc

    def touch_many(self, hashes: tuple[int, ...]) -> None:
        try:
            self._touch(hashes)
        except KeyError as exc:
            raise self._failed("touch", exc.args[0], exc) from exc

    def refresh_many(self, hashes: tuple[int, ...]) -> None:
        try:
            self._refresh(hashes)
        except KeyError as exc:
            raise self._failed("refresh", exc.args[0], exc) from exc

    def remove_many(self, hashes: tuple[int, ...]) -> None:
        try:
            self._remove(hashes)
        except KeyError as exc:
            raise self._failed("remove", exc.args[0], exc) from exc


class AlreadyResident(ValueError):
    """An insert of a block the policy holds already (``args[0]``, its hash): the state and the
    policy disagree, and keeping the old place would corrupt the order."""

    def __str__(self) -> str:
        return f"block hash {self.args[0]} is already resident"




def policy_name(policy: object) -> str:
    """How messages name a policy: a built-in's registry name, else ``module:Class``."""
    cls = type(policy)
    return getattr(cls, "name", None) or f"{cls.__module__}:{cls.__qualname__}"
