"""Run-at-a-time moves between ARC's ordered lists, for ``ARCPolicy``'s bulk methods.

A bulk event names its hashes in runs of one kind (a chain: its new blocks, then its hits;
a store: its ghost hits, then its first sightings), so each helper moves one run with the
least per-hash work CPython offers and says where the run ended; the caller picks the list
for the next run. A run ends where an ``OrderedDict`` operation raises ``KeyError``: one
exception per run boundary costs less than testing every hash's list first (a lookup per
hash, about as much as the move itself). Pure: the lists are changed, nothing else read.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from operator import eq

Ordered = OrderedDict[int, None]


def move_run(source: Ordered, target: Ordered, hashes: tuple[int, ...]) -> int:
    """Move the longest prefix of ``hashes`` found in ``source`` (in order, each the newest
    of ``target``; ``target`` holds none of them) and return its length."""
    before = len(source)
    try:
        for h in hashes:
            del source[h]
            target[h] = None
    except KeyError:  # the first hash not in ``source``: the run ends before it
        pass
    return before - len(source)


def drop_run(members: Ordered, hashes: tuple[int, ...]) -> int:
    """Delete the longest prefix of ``hashes`` found in ``members`` and return its length."""
    before = len(members)
    try:
        for h in hashes:
            del members[h]
    except KeyError:  # the first hash not in ``members``: the run ends before it
        pass
    return before - len(members)


def refresh_run(members: Ordered, hashes: tuple[int, ...]) -> int:
    """Move the longest prefix of ``hashes`` found in ``members`` to its newest end, in
    order, and return its length (repeats allowed: a member stays one)."""
    try:
        deque(map(members.move_to_end, hashes), 0)  # C-level: no bytecode per hash
    except KeyError as missing:
        # The first occurrence of the missing hash ends the run: an earlier one would have
        # failed first, since moving a member keeps it a member.
        return hashes.index(missing.args[0])
    return len(hashes)


def is_newest(members: Ordered, hashes: tuple[int, ...]) -> bool:
    """Whether ``hashes`` are ``members``' newest entries, in order: moving each to the
    newest end, in order, would then change nothing. Stops at the first difference (the
    usual answer costs one step of each iterator)."""
    return len(hashes) <= len(members) and all(map(eq, reversed(members), reversed(hashes)))


def ghost_steps(other: int, own: int, hits: int) -> int:
    """How far ``hits`` ghost hits in a row in one ghost list move ``p`` in all:
    ``max(1, other // own)`` for each, ``own`` (that list's length, the hit included)
    falling by one per hit and ``other`` (the other list's length) unchanged.

    A length above ``other`` makes the quotient 0, so the step 1: those are counted, and
    only the quotients of the lengths up to ``other`` are summed (none, usually)."""
    smallest = own - hits + 1
    largest_summed = min(own, other)
    if largest_summed < smallest:
        return hits
    return own - largest_summed + sum(map(other.__floordiv__, range(smallest, largest_summed + 1)))
