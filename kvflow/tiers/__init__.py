"""Tiers below host memory, reached through host slots.

- ``entry``: the framing of one block's bytes, so that a read can prove them;
- ``remote_executor`` and ``redis_store``: the remote tier on Redis, standalone or Cluster
  (redis-py, an optional dependency: ``pip install 'kvflow[redis]'``);
- ``simulated_remote``: a remote tier on a virtual clock, for ``kvflow simulate``.

May import: ``kvflow.core``.
"""
