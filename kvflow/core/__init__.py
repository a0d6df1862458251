"""The pure core: what kvflow decides and how its state changes, with nothing else.

Holds the values an engine hands kvflow and the rules over them: ``commands`` (what the engine
asks), ``events`` (what happened), ``jobs`` (what moves where), ``config``, ``errors``, ``values``
(the one home of value rules: ints that are not bools, 64-bit ranges, finite times), the state
machine (``state/``), the decisions (``decide/``) and the eviction policies (``policies/``).

May import: only ``kvflow.core`` and the standard library plus msgspec. No I/O, clock,
randomness, logging or threads (``tests/test_layout.py`` and ``tests/core/test_purity.py`` enforce it).
"""
