"""Asking the policy which blocks to evict, and checking its answer before anything acts on it.

The policy may be a class of the user's own (``Config.policy``), so the deciders never take its
``victims`` answer on trust: it must name exactly the number of blocks asked for, each once, as
plain ints, each resident on the tier and none that eviction must pass over (the predicate it
was given: pinned blocks, a store's own chain, blocks in a fenced slot). A wrong answer, or an
exception from the policy, is a ``PolicyError`` raised before the decider emits the eviction.

Every decider but one asks before its first event, so a refused answer leaves the state and
the trace as they were (a store decides its admission first for that). The exception is a
lookup's load from the remote tier, asked after the lookup has pinned its hits, because the
pins decide what may be evicted: the lookup's own events stay, legal and recorded, as when an
observer raises; nothing is evicted and no load is queued. Pure.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping

from kvflow.core.errors import PolicyError, one_line
from kvflow.core.policies.base import policy_name
from kvflow.core.state.model import State


def checked_victims(state: State, num_blocks: int, kept: Mapping[int, object]) -> list[int] | None:
    """``state.policy.victims(num_blocks, pinned)``, checked (see the module docstring); the
    policy's ``pinned`` is ``kept``'s ``in``: ``kept`` holds the blocks eviction must pass over
    (the state's pin counts, or more), ``{}`` to ask for the policy's coldest blocks whatever
    holds them."""
    policy = state.policy
    pinned: Callable[[int], bool] = kept.__contains__
    try:
        chosen = policy.victims(num_blocks, pinned)
    except Exception as exc:
        raise PolicyError(f"policy {policy_name(policy)!r}: victims({num_blocks}) raised {one_line(exc)}") from exc
    if chosen is None:
        return None
    if (
        type(chosen) is list
        and len(chosen) == num_blocks
        and operator.countOf(map(type, chosen), int) == num_blocks
        # (those on the tier, as a set: as many as asked for if each is there, and named once)
        and len(on_tier := state.slot_of.keys() & chosen) == num_blocks
        and state.pending.keys().isdisjoint(on_tier)
        and kept.keys().isdisjoint(on_tier)
    ):
        return chosen
    raise PolicyError(
        f"policy {policy_name(policy)!r}: victims({num_blocks}) answered {_preview(chosen)}: "
        f"{_what_is_wrong(state, chosen, num_blocks, pinned)}"
    )


def _what_is_wrong(state: State, chosen: object, num_blocks: int, pinned: Callable[[int], bool]) -> str:
    if type(chosen) is not list:
        return f"not a list (or None) but {type(chosen).__name__}"
    if len(chosen) != num_blocks:
        return f"{len(chosen)} blocks, not {num_blocks}"
    seen: set[int] = set()
    for h in chosen:
        if type(h) is not int:
            return f"{h!r} is not an int block hash"
        if h in seen:
            return f"block {h} is named twice"
        seen.add(h)
        if not state.is_resident(h):
            return f"block {h} is not resident on the tier"
        if pinned(h):
            if h in state.pin_count:
                return f"block {h} is pinned"
            return f"block {h} must be kept (the store's own chain, or a fenced slot)"
    return "a block the tier cannot evict"


def _preview(chosen: object) -> str:
    """The answer, cut short for a one-line message."""
    if isinstance(chosen, list) and len(chosen) > 6:
        return f"[{', '.join(map(repr, chosen[:6]))}, ... ({len(chosen)} in all)]"
    return repr(chosen)[:200]
