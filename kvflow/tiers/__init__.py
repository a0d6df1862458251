"""Tiers beyond host memory: a remote tier on an existing store (Redis, standalone or Cluster).

``entry`` frames one block's bytes so that a read can prove them; ``redis_store`` talks to the
server (redis-py, an optional dependency: ``pip install 'kvflow[redis]'``).
"""
