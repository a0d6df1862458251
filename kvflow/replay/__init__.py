"""Replay a recorded trace.

- ``fold``: ``replay``, folding the events and checking invariants and every checkpoint digest;
- ``redecide``: re-running the commands through today's decision code to the first divergence;
- ``result``: what a replay finds (``ReplayResult``, ``Divergence``).

May import: ``kvflow.core`` and ``kvflow.log``.
"""
