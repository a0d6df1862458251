"""ARC's REPLACE choice made ``n`` times, read-only: which residents an ARC policy gives up
next (``ARCPolicy.victims``; its lists and ``p`` are read, never changed).

Take ``T1``'s coldest when ``|T1| > p`` (``|T1|`` shrinking as victims are taken from it),
else ``T2``'s coldest; when the preferred list has nothing evictable left, the other list's.
Each list is scanned at most once, from its cold end. Pure.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from itertools import filterfalse, islice


def replace_choices(
    t1: OrderedDict[int, None],
    t2: OrderedDict[int, None],
    p: int,
    num_blocks: int,
    pinned: Callable[[int], bool] | None,
) -> list[int] | None:
    """The ``num_blocks`` (>= 0) victims in order, skipping ``pinned`` entries (None: none
    is), or ``None`` if fewer are unpinned (all-or-nothing, F8)."""
    if num_blocks > len(t1) + len(t2):
        return None
    # The usual outcome in C-level scans: T1's share (down to p) then T2's rest. A list
    # is scanned only for a share: building a scan costs about ten of its steps, and the
    # usual eviction takes from T1 alone. (Conditional expressions: min() and max() cost
    # about four times as much, keywords parsed.)
    t1_share = len(t1) - p
    from_t1 = 0 if t1_share <= 0 else num_blocks if num_blocks < t1_share else t1_share
    from_t2 = num_blocks - from_t1
    chosen = []
    if from_t1:
        chosen = list(islice(t1 if pinned is None else filterfalse(pinned, t1), from_t1))
    if len(chosen) == from_t1:
        if not from_t2:
            return chosen
        rest = list(islice(t2 if pinned is None else filterfalse(pinned, t2), from_t2))
        if len(rest) == from_t2:
            chosen += rest
            return chosen
    return _one_by_one(t1, t2, p, num_blocks, pinned or _never_pinned)


def _one_by_one(
    t1: OrderedDict[int, None],
    t2: OrderedDict[int, None],
    p: int,
    num_blocks: int,
    pinned: Callable[[int], bool],
) -> list[int] | None:
    """``replace_choices`` when a list runs out of unpinned entries before its share is taken."""
    # filterfalse() over the dicts: C-speed skipping of pinned entries, lazily consumed.
    cold1 = filterfalse(pinned, t1)
    cold2 = filterfalse(pinned, t2)
    # The next evictable entry of each list, peeked only when needed (None: none left).
    head1: int | None = None
    head2: int | None = None
    peeked1 = peeked2 = False
    t1_left = len(t1)
    chosen: list[int] = []
    append = chosen.append
    for _ in range(num_blocks):
        if t1_left > p:
            if not peeked1:
                head1, peeked1 = next(cold1, None), True
            if head1 is not None:
                append(head1)
                peeked1 = False
                t1_left -= 1
                continue
        if not peeked2:
            head2, peeked2 = next(cold2, None), True
        if head2 is not None:
            append(head2)
            peeked2 = False
            continue
        if not peeked1:
            head1, peeked1 = next(cold1, None), True
        if head1 is None:
            return None
        append(head1)
        peeked1 = False
        t1_left -= 1
    return chosen


def _never_pinned(block_hash: int) -> bool:
    """``pinned`` when nothing is: for the rare scans that still test each hash."""
    return False
