"""kvflow behind transformers' continuous batching.

- ``batching``: ``generate_batch`` and ``init_continuous_batching`` with ``tier=KvflowTier(...)``,
  the manager, scheduler and processor subclasses (imports transformers, one release of it);
- ``tier``: ``KvflowTier`` (the one argument), ``TierStats``, and kvflow's side: the engine,
  the requests' block hashes, the device blocks kvflow holds (no transformers import).

May import: ``kvflow.core``, ``kvflow.engine``, ``kvflow.executors``.
"""
