"""The state machine of the CPU tier: its tables, its data, ``evolve``, invariants, digest.

- ``tables``: the block and job lifecycle tables, the machine itself;
- ``model``: ``State`` (entries column-wise, live jobs, requests, the policy) and its queries;
- ``legality`` / ``apply`` / ``moves`` / ``job_events``: ``evolve`` applies one event, reading
  every next state from the tables;
- ``invariants``: the structural rules checked at checkpoints and by the tests;
- ``digest``: the deterministic state digest that traces carry.

May import: only ``kvflow.core``. Pure: no I/O, no clock, no randomness, no logging.
"""
