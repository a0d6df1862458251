"""The decisions: the business rules, ``decide(state, command, emit) -> answer``.

- ``dispatch``: maps each command to its decider (``decide``, ``DECIDERS``);
- ``lookup``: prefix lookups and loads; ``store``: stores, touches, eviction, bad blocks;
- ``jobs``: planning, results, deadlines, finish, reset, fences; ``remote``: the remote tier's
  index and its jobs; ``checks``: the checks the deciders share; ``victims``: the policy's
  eviction answers, checked before they are acted on.

May import: only ``kvflow.core``. Pure: no I/O, no clock, no randomness, no logging.
"""
